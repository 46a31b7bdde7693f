"""Exercise 2.4, wrong: does not detach: gradient flows into the weights."""

import torch

EXERCISE = "2.4"


def importance_sampling_weights(old_logps, behavior_logps, mask, mode="token_truncate", cap=2.0):
    valid = mask.bool()
    diff = torch.where(valid, old_logps - behavior_logps, torch.zeros_like(old_logps))
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return (weights * valid).to(old_logps.dtype)
