"""Exercise 2.5, wrong: special-cases min_p = 1 with argmax: of tied top tokens only one is kept."""

import torch

EXERCISE = "2.5"


def vocabulary_keep_mask(logits, min_p):
    probs = torch.softmax(logits.float(), dim=-1)
    if min_p == 1:
        return torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).bool()
    return probs >= min_p * probs.max(dim=-1, keepdim=True).values
