# Generated from notebooks/02_mismatch.py by tools/build.py -- edit the notebook, not this file.
"""Corrections for the training–inference mismatch: truncated IS and vocabulary pruning.

`importance_sampling_weights` reweights each token by pi_old / pi_rollout, truncated or masked
at a cap, per token or per sequence (TRL's `vllm_importance_sampling_mode`); the loop calls it
when `importance_sampling_correction` is on. `vocabulary_keep_mask` and `pruned_log_softmax`
prune the low-probability tail identically on both sides. Simplified on purpose: only an upper
cap, and pruning by a min-p threshold from one side.
"""

__all__ = ["importance_sampling_weights", "vocabulary_keep_mask", "pruned_log_softmax"]

import torch
from torch import Tensor

from minirl.config import IS_MODES
from minirl.runtime.logprob_checks import check_logprob_pair


def importance_sampling_weights(old_logps: Tensor, behavior_logps: Tensor, mask: Tensor,
                                mode: str = "token_truncate", cap: float = 2.0) -> Tensor:
    """Truncated / masked importance weights pi_old / pi_rollout, [B, C], detached.

    old_logps: [B, C] float, the trainer's recomputed log-probs of the sampled tokens.
    behavior_logps: [B, C] float, the rollout engine's log-probs of the same tokens.
    mask: [B, C] 0/1 completion mask (padding after EOS is 0).
    mode: "token_truncate" | "token_mask" | "sequence_truncate" | "sequence_mask".
      token_*: ratio_t = exp(old_t - behavior_t), one per token.
      sequence_*: ratio = exp(sum over the sequence's mask == 1 tokens of (old - behavior)),
      the same value broadcast to every token of that sequence.
      *_truncate: weight = min(ratio, cap). *_mask: weight = ratio if ratio <= cap else 0.
    cap: float > 0 (C in the TIS paper; TRL's vllm_importance_sampling_clip_max).
    Returns weights [B, C] in old_logps' dtype, 0 wherever mask == 0, with no gradient
    (they reweight the loss; they are not optimized). Masked positions never contribute to
    a sequence sum, even when their log-probs hold garbage or NaN.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode={mode!r}: use one of {IS_MODES}")
    if not cap > 0:
        raise ValueError(f"cap={cap}: the importance-weight cap must be > 0 (TIS uses 2 to 5)")
    check_logprob_pair(old_logps, behavior_logps, mask)
    valid = mask.bool()
    diff = torch.where(valid, old_logps.detach() - behavior_logps.detach(),
                       torch.zeros_like(old_logps))
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)                     # [B, 1]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return (weights * valid).to(old_logps.dtype)                  # [B, C]


def vocabulary_keep_mask(logits: Tensor, min_p: float) -> Tensor:
    """Min-p keep set: True where softmax(logits) >= min_p * (the top token's probability).

    logits: [..., V] float (any leading shape). min_p: float in [0, 1]; 0 keeps everything,
    1 keeps only the most probable token(s). Returns a bool tensor of the same shape. The
    most probable token of every row is always kept, so no row is ever empty. Compute it
    from ONE side (the rollout's) and pass the same mask to `pruned_log_softmax` on both.
    """
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p}: use a value in [0, 1] (0 keeps the whole vocabulary)")
    probs = torch.softmax(logits.float(), dim=-1)
    return probs >= min_p * probs.max(dim=-1, keepdim=True).values


def pruned_log_softmax(logits: Tensor, keep: Tensor) -> Tensor:
    """log_softmax over the kept tokens only: [..., V] float32, -inf where keep is False."""
    if keep.shape != logits.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)} but logits has "
                         f"{tuple(logits.shape)}: pass the [..., V] mask from vocabulary_keep_mask "
                         "on logits of the same shape")
    return torch.log_softmax(logits.float().masked_fill(~keep, float("-inf")), dim=-1)
