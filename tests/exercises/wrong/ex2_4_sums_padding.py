"""Exercise 2.4, wrong: sums the log-ratio over every position of the sequence, padding included."""

import torch

EXERCISE = "2.4"


def importance_sampling_weights(old_logps, behavior_logps, mask, mode="token_truncate", cap=2.0):
    valid = mask.bool()
    diff = old_logps.detach() - behavior_logps.detach()
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return (weights * valid).to(old_logps.dtype)
