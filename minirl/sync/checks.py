# Generated from notebooks/02_mismatch.py by tools/build.py -- edit the notebook, not this file.
"""Did the weights arrive? The stale-parameter check every weight sync can run after a push.

A version number is a label; the weights are the truth. `check_synchronization` compares
every tensor an engine holds with the trainer's, allowing exactly the rounding of the
engine's dtype (`rounding_tolerance`), and reports the tensors that differ (`stale_parameters`).
Notebook 02 uses it as step 1 of the mismatch diagnosis; `InProcessSync(verify=True)` and the
syncs of notebooks 04 and 06 run it after a push.
"""

__all__ = ["stale_parameters", "rounding_tolerance", "dtype_name", "check_synchronization"]

import torch
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


def rounding_tolerance(dtype: str, amax: float = 1.0) -> tuple[float, float]:
    """(rel_tol, abs_tol) of a round-to-nearest cast of a tensor with max |value| amax to dtype.

    Half a unit in the last place: 2^-(mantissa bits + 1) relative, plus an absolute term for
    subnormals (float8_e4m3fn here is scaled per tensor so that amax maps to 448).
    """
    mantissa = {"float32": 23, "bfloat16": 7, "float16": 10, "float8_e4m3fn": 3}
    if dtype not in mantissa:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(mantissa)}")
    rel = 2.0 ** -(mantissa[dtype] + 1) * 1.01
    smallest = {"float32": 2.0 ** -149, "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24,
                "float8_e4m3fn": amax / 448 * 2.0 ** -9}[dtype]
    return rel, smallest


def dtype_name(engine) -> str:
    """The engine's weight precision as a name ("float32", "bfloat16", ...)."""
    dtype = getattr(engine, "dtype", "float32")
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


@torch.no_grad()
def check_synchronization(trainer_weights, engine, trainer_version: int | None = None) -> list[str]:
    """The problems found with an engine's version and weights ([] if none).

    trainer_weights: the trainer's tensors by name (a dict, or a model: its state_dict);
    engine: has `version`, `named_weights()` and `dtype`. Compares the versions (when
    trainer_version is given), then every tensor within the engine dtype's rounding.
    """
    if isinstance(trainer_weights, torch.nn.Module):
        trainer_weights = trainer_weights.state_dict()
    problems = []
    if trainer_version is not None and engine.version != trainer_version:
        problems.append(f"version: the engine holds {engine.version}, the trainer is at "
                        f"{trainer_version}; push the trainer's weights (load_weights) before "
                        "generating")
    engine_weights = dict(engine.named_weights())
    dtype = dtype_name(engine)
    stale = []
    for name in sorted(set(trainer_weights) | set(engine_weights)):
        t = trainer_weights.get(name)
        amax = t.detach().abs().max().item() if t is not None and t.numel() else 1.0
        rel, abs_ = rounding_tolerance(dtype, amax)
        ours = {name: t.detach()} if t is not None else {}
        theirs = {name: engine_weights[name].detach()} if name in engine_weights else {}
        stale += stale_parameters(ours, theirs, rel, abs_)
    if stale:
        problems.append(f"weights: {len(stale)} of {len(trainer_weights)} tensors differ beyond "
                        f"{dtype} rounding (first: {stale[0]}); the last synchronization did not "
                        "complete")
    return problems
