"""Exercise 7.3, wrong: clips only from above (TIS's truncation), so small weights pass unclipped."""

import torch

EXERCISE = "7.3"


def clipped_token_weight(current_logps, behaviour_logps, mask, low=0.8, high=1.2):
    if not 0 < low <= 1 <= high:
        raise ValueError("need 0 < low <= 1 <= high")
    valid = mask.bool()
    diff = torch.where(valid, current_logps.detach() - behaviour_logps.detach(), torch.zeros_like(current_logps))
    return torch.exp(diff).clamp(max=high) * valid
