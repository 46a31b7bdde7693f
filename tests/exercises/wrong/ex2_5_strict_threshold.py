"""Exercise 2.5, wrong: keeps p > min_p * max p: at min_p = 1 nothing is kept, and ties at the threshold are dropped."""

import torch

EXERCISE = "2.5"


def vocabulary_keep_mask(logits, min_p):
    probs = torch.softmax(logits.float(), dim=-1)
    return probs > min_p * probs.max(dim=-1, keepdim=True).values
