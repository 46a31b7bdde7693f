# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Corrections for stale experience: none (LlamaRL), AReaL's decoupled weight, truncated IS.

Each fills `old_logps` and `is_weights`, the Experience fields notebook 01's `policy_loss`
reads. Simplified vs AReaL: the proximal policy is always recomputed.
"""

__all__ = ["clipped_token_weight", "capped_token_weight", "apply_correction"]

import dataclasses

import torch
from torch import Tensor

from minirl.config import AlgorithmConfig
from minirl.data import Experience
from minirl.runtime.async_config import AREAL_WEIGHTS, check_correction
from minirl.runtime.logprob_checks import check_logprob_pair
from minirl.runtime.validate import check_choice
from minirl.train.step import importance_weights


def clipped_token_weight(current_logps: Tensor, behaviour_logps: Tensor, mask: Tensor,
                         low: float = 0.8, high: float = 1.2) -> Tensor:
    """The source's AReaL token weight: clamp(exp(current - behaviour), low, high), [B, C] float32.

    current_logps: [B, C] the trainer's (proximal) log-probs of the sampled tokens;
    behaviour_logps: [B, C] the log-probs the rollout recorded when it sampled them;
    mask: [B, C] 0/1 completion mask. The weight is 0 where mask is 0, even when the
    log-probs there are garbage (NaN or inf). No gradient flows through it. Raises ValueError
    unless 0 < low <= 1 <= high (a weight of 1, no correction, must stay inside the interval).
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"clipped_token_weight: need 0 < low <= 1 <= high, got low={low}, "
                         f"high={high}")
    check_logprob_pair(current_logps, behaviour_logps, mask)
    valid = mask.bool()
    diff = torch.where(valid, current_logps.detach().float() - behaviour_logps.detach().float(),
                       torch.zeros_like(current_logps, dtype=torch.float32))
    return torch.exp(diff).clamp(low, high) * valid                                 # [B, C]


def capped_token_weight(current_logps: Tensor, behaviour_logps: Tensor, mask: Tensor,
                        cap: float = 1.2) -> Tensor:
    """AReaL's code: exp(current - behaviour), and 0 for a token whose weight exceeds `cap`.

    Shapes as `clipped_token_weight`; cap > 1 (AReaL's `behav_imp_weight_cap`).
    """
    if not cap > 1:
        raise ValueError(f"capped_token_weight: cap={cap} must be > 1 (behav_imp_weight_cap)")
    check_logprob_pair(current_logps, behaviour_logps, mask)
    valid = mask.bool()
    diff = torch.where(valid, current_logps.detach().float() - behaviour_logps.detach().float(),
                       torch.zeros_like(current_logps, dtype=torch.float32))
    weight = torch.exp(diff)
    return torch.where(weight <= cap, weight, torch.zeros_like(weight)) * valid     # [B, C]


def apply_correction(exp: Experience, correction: str, actor, algorithm: AlgorithmConfig,
                     areal_weight: str = "clip", low: float = 0.8,
                     high: float = 1.2) -> Experience:
    """Fill exp.old_logps and exp.is_weights for `correction`; returns exp.

    actor: anything with `logprobs(rollout) -> [N, C]` (the trainer's current weights: the
    proximal policy), asked only when exp.old_logps is None and the correction needs them.
    exp.old_logps that `make_experience` computed (for num_iterations > 1, say) are kept by
    every correction. none and tis are stage 1's `importance_weights`, with truncated IS off
    or on (tis uses algorithm.importance_sampling_mode and importance_sampling_cap: per token,
    truncated at 2 by default). areal_weight: "clip" (the source: clamp to [low, high]) or
    "cap" (AReaL's code: drop tokens above `high`).
    """
    check_choice("areal_weight", areal_weight, AREAL_WEIGHTS)
    correction = check_correction(correction, algorithm)
    ro = exp.rollout
    if correction != "none" and exp.old_logps is None:
        exp.old_logps = actor.logprobs(ro)                                          # [N, C]
    if correction == "areal":
        weight = clipped_token_weight if areal_weight == "clip" else capped_token_weight
        bounds = (low, high) if areal_weight == "clip" else (high,)
        exp.is_weights = weight(exp.old_logps, ro.logprobs, ro.completion_mask, *bounds)
        return exp
    tis = dataclasses.replace(algorithm, importance_sampling_correction=correction == "tis")
    return importance_weights(exp, tis)
