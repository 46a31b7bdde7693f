# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Losses: the PPO clipped objective, TRL's four loss aggregations, GSPO, k3 KL, value loss.

`policy_loss` reproduces TRL GRPOTrainer's `_compute_loss` for loss_type in
{"grpo", "bnpo", "dr_grpo", "dapo"} and importance_sampling_level in {"token", "sequence"}
on one process without gradient accumulation. There, "dapo" (normalize by the tokens of the
whole generation batch) equals "bnpo" (normalize by the tokens of the micro-batch): they
differ only when a batch is split across accumulation steps or processes. minirl's own
micro-batches (section 11.4) are weighted by `micro_batch_weight`, so that splitting the update
never changes its loss: "bnpo" keeps the batch's token count (TRL's would take each micro-batch's).
Simplified: no CISPO/SAPO/Vespo variants, no entropy masking, no off-policy masking.
"""

__all__ = ["clipped_surrogate", "aggregate_loss", "kl_k3", "policy_loss", "value_loss",
           "micro_batch_weight"]

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES


def clipped_surrogate(ratio: Tensor, advantages: Tensor, epsilon_low: float = 0.2,
                      epsilon_high: float | None = None) -> Tensor:
    """PPO's clipped per-token loss (to minimize).

    ratio: [B, T] (or [B, 1] for sequence-level ratios), pi/pi_old, > 0;
    advantages: broadcastable to ratio ([B, 1] or [B, T]). epsilon_high defaults to epsilon_low.
    Returns -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A), with the
    broadcast shape of ratio and advantages. Gradient flows through `ratio` only where the
    unclipped term is the minimum.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def aggregate_loss(per_token_loss: Tensor, mask: Tensor, loss_type: str = "dapo",
                   max_completion_length: int | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar, as TRL's GRPOTrainer does for `loss_type`.

    per_token_loss: [B, C] or [B, 1] (broadcast over C); mask: [B, C] of 0/1.
      "grpo":    mean over rows of (sum of row's masked loss / max(row's token count, 1))
      "bnpo":    sum of masked loss / max(total token count, 1)
      "dapo":    same as "bnpo" in one process without gradient accumulation
      "dr_grpo": sum of masked loss / (B * max_completion_length); max_completion_length
                 defaults to C.
    Returns a 0-dim tensor. Raises ValueError for an unknown loss_type.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")
    mask = mask.to(per_token_loss.dtype)
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type == "grpo":
        return masked_mean(per_token_loss, mask, dim=-1).mean()
    if loss_type in ("bnpo", "dapo"):
        return masked_mean(per_token_loss, mask)
    length = mask.shape[1] if max_completion_length is None else max_completion_length
    return (per_token_loss * mask).sum() / (mask.shape[0] * length)


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

    logps (with grad), old_logps, ref_logps, is_weights, mask: [B, C]; advantages: [B]
    (one per sequence, GRPO) or [B, C] (per token, PPO/GAE).
    use_bias_correction_kl: multiply the k3 KL term by the importance ratio pi/pi_old (the
    token ratio, or the sequence ratio for GSPO; with its gradient), as TRL 1.16 does by
    default (DeepSeek-V3.2): the tokens were sampled from pi_old, so this makes the KL an
    estimate under pi. False: the classic GRPO k3 term.
    Returns (loss, metrics) with metrics "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "ratio_mean", and "kl" (the KL term as added, so corrected when
    use_bias_correction_kl) when ref_logps is given.
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: "
                         f"use one of {IMPORTANCE_SAMPLING_LEVELS}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs)")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)                                   # [B, 1]
    log_ratio = logps - old_logps                                              # [B, C]
    if importance_sampling_level == "sequence":                                # GSPO
        log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)         # [B, 1]
    ratio = torch.exp(log_ratio)
    per_token = clipped_surrogate(ratio, advantages, epsilon, epsilon_high)    # [B, C] or [B, 1]
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = kl_k3(logps, ref_logps) if ref_logps is not None else None
    if kl is not None and use_bias_correction_kl:
        kl = kl * ratio                                                        # [B, C]
    if beta != 0.0:
        per_token = per_token + beta * kl
    loss = aggregate_loss(per_token, mask, loss_type, max_completion_length)

    with torch.no_grad():
        def share(flags):                    # TRL's global masked mean; [B, 1] counts per sequence
            flags = flags.to(mask.dtype)
            return (flags.mean() if flags.shape[1] == 1 and mask.shape[1] != 1
                    else masked_mean(flags.expand_as(mask), mask)).item()
        low = (ratio < 1 - epsilon) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        metrics = {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
                   "clip_ratio/region_mean": share(low | high), "ratio_mean": share(ratio)}
        if kl is not None:
            metrics["kl"] = masked_mean(kl, mask).item()
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float = 0.2,
               loss_type: str = "dapo") -> Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), aggregated like the policy loss.

    values (with grad), old_values, returns, mask: [B, C]. V_clipped = old_values +
    clamp(values - old_values, -cliprange_value, cliprange_value).
    """
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    per_token = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return aggregate_loss(per_token, mask, loss_type)


def micro_batch_weight(loss_type: str, rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """w such that the sum over micro-batches of w * (micro-batch's loss) is the whole batch's loss.

    rows, tokens: the micro-batch's completions and completion tokens (mask sum); total_*: the
    batch's. "grpo", "dr_grpo": w = rows / total_rows; "bnpo", "dapo": w = max(tokens, 1) /
    max(total_tokens, 1) (the clamps of masked_mean). "dr_grpo" needs an explicit
    max_completion_length in the loss: micro-batches have different widths.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")
    if loss_type in ("grpo", "dr_grpo"):
        return rows / total_rows
    return max(tokens, 1) / max(total_tokens, 1)
