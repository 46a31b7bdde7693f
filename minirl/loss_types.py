# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""The loss registry: each `loss_type` names one entry that holds every part of its loss.

An entry (`LossType`) holds the per-token `objective`, how it is `normalise`d to one number, and
the weights of a micro-batch and of a data-parallel rank (`minirl.runtime.loss_weights`). The
entries reproduce TRL 1.16's GRPOTrainer for "grpo", "bnpo", "dr_grpo", "dapo" and "cispo". Tensor
methods only (no torch import), so the config checks a loss type before torch loads. Simplified:
no SAPO, LUSPO or VESPO, and no `delta` (TRL's two-sided clipping).
"""

__all__ = ["clipped_surrogate", "sequence_mean", "token_mean", "max_length_mean",
           "clipped_objective", "LossType", "LOSS_TYPES", "check_loss_type", "register_loss_type",
           "loss_type_entry", "aggregate_loss", "token_log_ratio", "sequence_log_ratio",
           "IMPORTANCE_SAMPLING_LEVELS", "cispo_objective"]

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable

from minirl.runtime.loss_weights import by_rows, by_tokens, each_rank_alone, ranks_by_rows, ranks_by_tokens
from minirl.runtime.validate import ConfigError, check_parts

if TYPE_CHECKING:
    from torch import Tensor


def clipped_surrogate(ratio: "Tensor", advantages: "Tensor", epsilon_low: float = 0.2,
                      epsilon_high: float | None = None) -> "Tensor":
    """PPO's clipped per-token loss (to minimize).

    ratio: [B, T] (or [B, 1] for sequence-level ratios), pi/pi_old, > 0;
    advantages: broadcastable to ratio ([B, 1] or [B, T]). epsilon_high defaults to epsilon_low.
    Returns -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A), with the
    broadcast shape of ratio and advantages. Gradient flows through `ratio` only where the
    unclipped term is the minimum.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    return -(ratio * advantages).minimum(clipped * advantages)


def sequence_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"grpo": the mean over rows of each row's mean over its own tokens.

    per_token_loss, mask: [B, C] (mask 0/1, in per_token_loss's dtype). An empty row (no
    completion token) contributes 0: its token count is clamped to 1. max_completion_length
    is not used. Returns a 0-dim tensor.
    """
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def token_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"bnpo", "dapo", "cispo": the sum of the masked losses over the batch's token count.

    per_token_loss, mask: [B, C]. The count is clamped to 1, so an all-masked batch gives 0,
    not NaN. max_completion_length is not used. Returns a 0-dim tensor.
    """
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1)


def max_length_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"dr_grpo": the sum of the masked losses over B * max_completion_length, a constant.

    per_token_loss, mask: [B, C]; max_completion_length defaults to C (pass it when the
    columns are fewer, as a micro-batch's are). Returns a 0-dim tensor.
    """
    length = mask.shape[1] if max_completion_length is None else max_completion_length
    return (per_token_loss * mask).sum() / (mask.shape[0] * length)


def clipped_objective(logps: "Tensor", ratio: "Tensor", advantages: "Tensor", epsilon: float,
                      epsilon_high: float) -> tuple["Tensor", "Tensor", "Tensor"]:
    """PPO's clipped surrogate per token, and where it clipped: below 1 - epsilon with A < 0, above
    1 + epsilon_high with A > 0 (TRL's clip ratios). logps is not used (the ratio carries the gradient)."""
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return clipped_surrogate(ratio, advantages, epsilon, epsilon_high), low, high


@dataclass(frozen=True)
class LossType:
    """Every part of one loss type (see the module docstring for each part's arguments)."""

    objective: Callable           # (logps, ratio, advantages, epsilon, epsilon_high) -> (loss [B, C], low, high)
    normalise: Callable           # (per_token_loss [B, C], mask [B, C], max_completion_length) -> 0-dim tensor
    micro_batch_weight: Callable  # (rows, total_rows, tokens, total_tokens) -> a micro-batch's weight
    rank_weight: Callable         # (local_tokens, global_tokens, local_rows, global_rows, world_size) -> weight


LOSS_TYPES: dict[str, LossType] = {}


def check_loss_type(name: str, entry) -> None:
    """ConfigError naming the loss type and the part unless every part of a LossType is a function of `entry`."""
    check_parts("loss_type", name, entry, tuple(f.name for f in fields(LossType)), "LossType")


def register_loss_type(name: str, entry: LossType) -> LossType:
    """Add (or replace) loss type `name`; ConfigError if the entry lacks a part."""
    check_loss_type(name, entry)
    LOSS_TYPES[name] = entry
    return entry


def loss_type_entry(name: str) -> LossType:
    """The entry of loss type `name`; ConfigError for an unknown name or an entry that lacks a part."""
    if name not in LOSS_TYPES:
        raise ConfigError("loss_type", name, f"use one of {', '.join(map(repr, LOSS_TYPES))}, or register yours "
                                             "(minirl.loss_types.register_loss_type)")
    check_loss_type(name, LOSS_TYPES[name])
    return LOSS_TYPES[name]


def aggregate_loss(per_token_loss: "Tensor", mask: "Tensor", loss_type: str = "dapo",
                   max_completion_length: int | None = None) -> "Tensor":
    """A per-token loss [B, C] (or [B, 1], broadcast) as one number, as loss type `loss_type` normalises it.

    mask: [B, C] of 0/1. ConfigError (a ValueError) for an unknown loss_type."""
    entry = loss_type_entry(loss_type)
    mask = mask.to(per_token_loss.dtype)
    return entry.normalise(per_token_loss.expand_as(mask), mask, max_completion_length)


def token_log_ratio(log_ratio: "Tensor", mask: "Tensor") -> "Tensor":
    """One log-ratio per token: [B, C] unchanged."""
    return log_ratio


def sequence_log_ratio(log_ratio: "Tensor", mask: "Tensor") -> "Tensor":
    """GSPO: one log-ratio per completion, the mean of its tokens' (the log of their geometric mean): [B, 1]."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable] = {"token": token_log_ratio, "sequence": sequence_log_ratio}

register_loss_type("grpo", LossType(objective=clipped_objective, normalise=sequence_mean,
                                    micro_batch_weight=by_rows, rank_weight=ranks_by_rows))
register_loss_type("bnpo", LossType(objective=clipped_objective, normalise=token_mean,
                                    micro_batch_weight=by_tokens, rank_weight=each_rank_alone))
register_loss_type("dr_grpo", LossType(objective=clipped_objective, normalise=max_length_mean,
                                       micro_batch_weight=by_rows, rank_weight=ranks_by_rows))
register_loss_type("dapo", LossType(objective=clipped_objective, normalise=token_mean,
                                    micro_batch_weight=by_tokens, rank_weight=ranks_by_tokens))


def cispo_objective(logps: "Tensor", ratio: "Tensor", advantages: "Tensor", epsilon: float,
                    epsilon_high: float) -> tuple["Tensor", "Tensor", "Tensor"]:
    """CISPO's per-token loss, as TRL 1.16 computes it: -sg(min(ratio, epsilon_high)) * A * logps.

    The weight is detached: the gradient flows through logps alone, on every token. Clipped
    above: ratio > epsilon_high with A > 0 (TRL's `cispo_clip_ratio`); nothing is clipped below.
    """
    weight = ratio.clamp(max=epsilon_high).detach()
    high = (ratio > epsilon_high) & (advantages > 0)
    nothing = high.new_zeros(high.shape)                                        # CISPO never clips below
    return -weight * advantages * logps, nothing, high


register_loss_type("cispo", LossType(objective=cispo_objective, normalise=token_mean,
                                     micro_batch_weight=by_tokens, rank_weight=ranks_by_tokens))
