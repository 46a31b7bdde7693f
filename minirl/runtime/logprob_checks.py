"""The input check of every function that compares log-probs: aligned [B, C] tensors, finite where it counts.

Hand-written (argument checks). Notebook 02's `mismatch_stats`, `probability_buckets` and
`importance_sampling_weights` (and notebook 07's corrections) call `check_logprob_pair` first, so
bad input fails at once with a message naming the tensor and the shape it wants: behaviour log-probs
missing (a trainer-side recomputation is no substitute), shapes that differ, a NaN where the mask
is 1, or probabilities passed where log-probs belong.
"""

import torch
from torch import Tensor

LOGP_TOLERANCE = 1e-3  # a log-prob above this is not rounding any more: p would exceed 1.001


def check_logprob_pair(trainer_logps: Tensor, behavior_logps: Tensor | None, mask: Tensor) -> None:
    """Raise ValueError unless trainer_logps, behavior_logps and mask are aligned [B, C] tensors.

    behavior_logps must be the rollout engine's own log-probs (never a recomputation), with
    a finite value at every position where mask is 1. Log-probs must be <= 0 (a tolerance of
    LOGP_TOLERANCE absorbs rounding in low precision).
    """
    if behavior_logps is None:
        raise ValueError("behavior_logps is missing: pass the rollout engine's log-probs of the sampled "
                         "tokens (Rollout.logprobs), a [B, C] tensor like trainer_logps; a trainer-side "
                         "recomputation is not a substitute for the behaviour policy")
    for name, t in (("trainer_logps", trainer_logps), ("behavior_logps", behavior_logps), ("mask", mask)):
        if not isinstance(t, Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a [B, C] tensor (one value per completion token), got {shape}")
    for name, t in (("behavior_logps", behavior_logps), ("mask", mask)):
        if t.shape != trainer_logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but trainer_logps has "
                             f"{tuple(trainer_logps.shape)}: both must be [B, C] over the same completion tokens")
    valid = mask.bool()
    for name, t in (("trainer_logps", trainer_logps), ("behavior_logps", behavior_logps)):
        missing = valid & ~torch.isfinite(t)
        if missing.any():
            b, c = missing.nonzero()[0].tolist()
            raise ValueError(f"{name} is missing a log-prob at {int(missing.sum())} unmasked positions "
                             f"(first at [{b}, {c}]): record a finite value for every completion token, "
                             f"shape [B, C] = {tuple(trainer_logps.shape)}")
        above = valid & (t > LOGP_TOLERANCE)
        if above.any():
            raise ValueError(f"{name} has values above 0 (max {t[above].max().item():.4g}): log-probs are "
                             "<= 0; pass log-probabilities of the sampled tokens [B, C], not probabilities or logits")
