# Generated from notebooks/02_mismatch.py by tools/build.py -- edit the notebook, not this file.
"""Did the weights arrive? The stale-parameter check every weight sync can run after a push.

A version number is a label; the weights are the truth. `stale_parameters` names the tensors
whose rollout copy differs from the trainer's beyond a rounding tolerance;
`minirl.runtime.sync_checks.check_synchronization` runs it on every tensor of an engine.
"""

__all__ = ["stale_parameters"]

from torch import Tensor


def stale_parameters(trainer_state: dict[str, Tensor], rollout_state: dict[str, Tensor],
                     rel_tol: float = 0.0, abs_tol: float = 0.0) -> list[str]:
    """Names of the parameters whose rollout copy is not the trainer's, up to rounding.

    trainer_state, rollout_state: name -> tensor (any dtypes; compare in float32).
    A name is reported when it is missing from either side, when its shapes differ, or when
    any element has |rollout - trainer| > abs_tol + rel_tol * |trainer|. rel_tol / abs_tol
    are the rounding a cast to the rollout's dtype can cause (`rounding_tolerance`).
    Returns the names sorted alphabetically (an empty list: synchronized).
    """
    stale = []
    for name in sorted(set(trainer_state) | set(rollout_state)):
        if name not in trainer_state or name not in rollout_state:
            stale.append(name)
            continue
        t, r = trainer_state[name].float(), rollout_state[name].float()
        if t.shape != r.shape or ((r - t).abs() > abs_tol + rel_tol * t.abs()).any():
            stale.append(name)
    return stale
