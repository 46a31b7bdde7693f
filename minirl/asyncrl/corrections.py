# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Corrections for stale experience: none (LlamaRL), AReaL's decoupled weight, truncated IS.

Each correction fills the Experience fields that notebook 01's `policy_loss` already reads:
`old_logps` (the policy the PPO ratio is taken against) and `is_weights` (a per-token
weight on the clipped objective). So the algorithm code is untouched; only the numbers
handed to it differ:

| correction | old_logps (trust region) | is_weights (behaviour correction) |
|---|---|---|
| none  | None (pi_theta detached: ratio 1) | None |
| tis   | the trainer's recomputed pi_old | min(pi_old / pi_behav, cap) (notebook 02) |
| areal | the proximal pi_prox (recomputed) | clip(pi_prox / pi_behav, 0.8, 1.2) (the source), or AReaL's cap |

Simplified vs AReaL: the proximal policy is always recomputed (no approximation from the
versions), and one update per batch, so pi_prox equals the weights before the update.
"""

__all__ = ["CORRECTIONS", "AREAL_WEIGHTS", "clipped_token_weight", "capped_token_weight",
           "apply_correction"]

import torch
from torch import Tensor

from minirl.algo.logprobs import check_logprob_pair
from minirl.algo.corrections import importance_sampling_weights
from minirl.config import AlgorithmConfig
from minirl.data import Experience
from minirl.utils.validate import check_choice

CORRECTIONS = ("none", "areal", "tis")
AREAL_WEIGHTS = ("clip", "cap")


def clipped_token_weight(current_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, low: float = 0.8,
                         high: float = 1.2) -> Tensor:
    """The source's AReaL token weight: clamp(exp(current - behaviour), low, high), [B, C] float32, detached.

    current_logps: [B, C] the trainer's (proximal) log-probs of the sampled tokens;
    behaviour_logps: [B, C] the log-probs the rollout recorded when it sampled them;
    mask: [B, C] 0/1 completion mask. The weight is 0 where mask is 0, even when the
    log-probs there are garbage (NaN or inf). No gradient flows through it. Raises ValueError
    unless 0 < low <= 1 <= high (a weight of 1, no correction, must stay inside the interval).
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"clipped_token_weight: need 0 < low <= 1 <= high, got low={low}, high={high}")
    check_logprob_pair(current_logps, behaviour_logps, mask)
    valid = mask.bool()
    diff = torch.where(valid, current_logps.detach().float() - behaviour_logps.detach().float(),
                       torch.zeros_like(current_logps, dtype=torch.float32))
    return torch.exp(diff).clamp(low, high) * valid                                     # [B, C]


def capped_token_weight(current_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, cap: float = 1.2) -> Tensor:
    """AReaL's code: exp(current - behaviour), and 0 for a token whose weight exceeds `cap` (it is dropped).

    Shapes as `clipped_token_weight`; cap > 1 (AReaL's `behav_imp_weight_cap`).
    """
    if not cap > 1:
        raise ValueError(f"capped_token_weight: cap={cap} must be > 1 (AReaL's behav_imp_weight_cap)")
    check_logprob_pair(current_logps, behaviour_logps, mask)
    valid = mask.bool()
    diff = torch.where(valid, current_logps.detach().float() - behaviour_logps.detach().float(),
                       torch.zeros_like(current_logps, dtype=torch.float32))
    weight = torch.exp(diff)
    return torch.where(weight <= cap, weight, torch.zeros_like(weight)) * valid          # [B, C]


def apply_correction(exp: Experience, correction: str, actor, algorithm: AlgorithmConfig,
                     areal_weight: str = "clip", low: float = 0.8, high: float = 1.2) -> Experience:
    """Fill exp.old_logps and exp.is_weights for `correction` (see the module's table); returns exp.

    actor: anything with `logprobs(rollout) -> [N, C]` (the trainer's current weights: the
    proximal policy). tis uses algorithm.importance_sampling_mode and importance_sampling_cap
    (notebook 02's defaults: per token, truncated at 2). areal_weight: "clip" (the source:
    clamp to [low, high]) or "cap" (AReaL's code: drop tokens above `high`).
    """
    check_choice("correction", correction, CORRECTIONS)
    check_choice("areal_weight", areal_weight, AREAL_WEIGHTS)
    ro = exp.rollout
    if correction == "none":
        exp.old_logps, exp.is_weights = None, None
        return exp
    if exp.old_logps is None:
        exp.old_logps = actor.logprobs(ro)                                                   # [N, C]
    if correction == "tis":
        exp.is_weights = importance_sampling_weights(exp.old_logps, ro.logprobs, ro.completion_mask,
                                                     algorithm.importance_sampling_mode,
                                                     algorithm.importance_sampling_cap)
    elif areal_weight == "clip":
        exp.is_weights = clipped_token_weight(exp.old_logps, ro.logprobs, ro.completion_mask, low, high)
    else:
        exp.is_weights = capped_token_weight(exp.old_logps, ro.logprobs, ro.completion_mask, high)
    return exp
