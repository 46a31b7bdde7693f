"""Exercise 8.1, wrong: counts only each token's top-1 expert, not all top_k slots it fills."""

import torch

EXERCISE = "8.1"


def load_balancing_loss(router_logits, top_k, token_mask=None):
    probs = torch.softmax(router_logits.float(), -1)
    mask = torch.ones(len(probs)) if token_mask is None else token_mask.float()
    f = torch.zeros(probs.shape[1]).index_add_(0, probs.argmax(-1), mask) / mask.sum()
    return probs.shape[1] * (f * (probs * mask[:, None]).sum(0) / mask.sum()).sum()
