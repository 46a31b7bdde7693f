# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""GSPO's case on a MoE policy: the spread of token-level importance ratios exp(d_t) against
GSPO's sequence ratios exp(mean_t d_t), one per completion."""

__all__ = ["ratio_spread"]

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean


def ratio_spread(trainer_logps: Tensor, rollout_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """Variance of token ratios exp(trainer - rollout) over real tokens, and of GSPO's sequence
    ratios exp(mean over each completion's tokens), with their largest deviation from 1. [B, C]."""
    mask = mask.bool()
    diff = (trainer_logps - rollout_logps).masked_fill(~mask, 0.0)                   # [B, C]
    token = torch.exp(diff[mask])                                                    # [tokens]
    rows = mask.any(-1)
    sequence = torch.exp(masked_mean(diff, mask.to(diff.dtype), dim=-1))[rows]      # [B']
    token_var, sequence_var = token.var().item(), sequence.var().item()
    return {"tokens": int(mask.sum()), "sequences": int(rows.sum()), "token_var": token_var,
            "sequence_var": sequence_var, "variance_ratio": token_var / max(sequence_var, 1e-30),
            "token_max_dev": (token - 1).abs().max().item(),
            "sequence_max_dev": (sequence - 1).abs().max().item()}
