# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Losses: the GRPO/PPO policy loss of any registered loss type, k3 KL, the value loss.

`policy_loss` reproduces TRL GRPOTrainer's `_compute_loss` for every registered loss type, on one
process. Simplified: no entropy masking, no off-policy masking.
"""

__all__ = ["kl_k3", "policy_loss", "value_loss"]

import torch
from torch import Tensor

from minirl.loss_types import IMPORTANCE_SAMPLING_LEVELS, aggregate_loss, loss_type_entry
from minirl.runtime.arg_checks import check_loss_args
from minirl.runtime.gauges import clip_metrics


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp. [B, C]."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def policy_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, *, epsilon: float = 0.2,
                epsilon_high: float | None = None, loss_type: str = "dapo",
                importance_sampling_level: str = "token", beta: float = 0.0, ref_logps: Tensor | None = None,
                max_completion_length: int | None = None, is_weights: Tensor | None = None,
                use_bias_correction_kl: bool = False) -> tuple[Tensor, dict[str, float]]:
    """The GRPO/PPO policy loss and its metrics, as TRL GRPOTrainer's `_compute_loss`.

    logps (with grad), old_logps, ref_logps, is_weights, mask: [B, C]; advantages: [B] (GRPO)
    or [B, C] (PPO/GAE). Returns (loss, metrics): TRL's clip ratios, "ratio_mean", and "kl".
    """
    entry = loss_type_entry(loss_type)
    check_loss_args(importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, beta, ref_logps)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)                                   # [B, 1]
    log_ratio = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](logps - old_logps, mask)  # [B, C] or [B, 1]
    ratio = torch.exp(log_ratio)
    per_token, low, high = entry.objective(logps, ratio, advantages, epsilon, epsilon_high)    # [B, C] or [B, 1]
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = kl_k3(logps, ref_logps) if ref_logps is not None else None
    if kl is not None and use_bias_correction_kl:
        kl = kl * ratio                                                        # [B, C]
    if beta != 0.0:
        per_token = per_token + beta * kl
    loss = entry.normalise(per_token.expand_as(mask), mask, max_completion_length)
    return loss, clip_metrics(low, high, ratio, mask, kl)      # TRL's clip ratios, ratio_mean, kl


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float = 0.2,
               loss_type: str = "dapo") -> Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), aggregated like the policy loss.

    values (with grad), old_values, returns, mask: [B, C]. V_clipped = old_values +
    clamp(values - old_values, -cliprange_value, cliprange_value).
    """
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    per_token = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return aggregate_loss(per_token, mask, loss_type)
