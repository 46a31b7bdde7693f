"""Exercise 7.3, wrong: forgets to detach, so the weight carries a gradient into the loss."""

import torch

EXERCISE = "7.3"


def clipped_token_weight(current_logps, behaviour_logps, mask, low=0.8, high=1.2):
    if not 0 < low <= 1 <= high:
        raise ValueError("need 0 < low <= 1 <= high")
    valid = mask.bool()
    diff = torch.where(valid, current_logps - behaviour_logps, torch.zeros_like(current_logps))
    return torch.exp(diff).clamp(low, high) * valid
