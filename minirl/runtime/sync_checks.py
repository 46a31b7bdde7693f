"""Did the weights arrive? Step 1 of notebook 02's mismatch diagnosis, as one call.

A version number is a label; the weights are the truth. `check_synchronization` compares the
engine's version with the trainer's, then every tensor the engine holds with the trainer's,
allowing exactly the rounding a cast to the engine's dtype can cause (`rounding_tolerance`:
half a unit in the last place, plus a subnormal floor), and names the tensors that differ
with notebook 02's `minirl.sync.checks.stale_parameters` (exercise 2.3).
`InProcessSync(verify=...)` and the syncs of notebooks 04 and 06 run it after a push;
`dtype_name` reads an engine's weight precision as a name.
"""
import torch

from minirl.sync.checks import stale_parameters


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
