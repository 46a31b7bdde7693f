"""Exercise 8.1, wrong: uses the mean probability P for the token share f too (f = P), a 'soft count'."""

import torch

EXERCISE = "8.1"


def load_balancing_loss(router_logits, top_k, token_mask=None):
    probs = torch.softmax(router_logits.float(), -1)
    if token_mask is not None:
        probs = probs[token_mask.bool()]
    P = probs.mean(0)
    return probs.shape[1] * (P * P).sum()
