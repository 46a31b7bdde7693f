"""Weight synchronization as an interface: push the trainer's weights into an engine, as a new version.

Step 4 of the loop. A `WeightSync` takes the actor's named tensors, gets them into the
rollout engine however the placement requires, and returns a `SyncReport` (the version the
engine now holds, how many tensors and bytes moved, how long it took). Stage 1 copies
in-process (`InProcessSync`); notebook 04 gathers FSDP-sharded tensors or merges LoRA
first; notebook 06 broadcasts across Ray actors. All of them end with the same check: the
engine reports the version that was pushed (`check_pushed`), and on request a check of the
weights it holds against the trainer's (`InProcessSync(verify=...)`: step 1 of notebook 02's diagnosis,
`minirl.runtime.sync_checks.check_synchronization`).
"""

__all__ = ["SyncReport", "WeightSync", "check_pushed", "InProcessSync"]

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from torch import Tensor

from minirl.rollout.base import RolloutEngine, VersionMismatchError


@dataclass
class SyncReport:
    """What one synchronization did."""

    version: int      # the policy version the engine holds now
    tensors: int      # named tensors handed over
    bytes: int        # their size, in the trainer's dtype
    seconds: float    # wall-clock time of the push


class WeightSync(Protocol):
    def push(self, named_weights: Iterable[tuple[str, Tensor]], engine: RolloutEngine, version: int) -> SyncReport:
        """Load `named_weights` into `engine` as `version`; raise if the engine does not end up holding it."""
        ...


def check_pushed(engine: RolloutEngine, version: int) -> None:
    """The engine must report the version just pushed (an engine that ignored the push is caught here)."""
    if engine.version != version:
        raise VersionMismatchError(f"after pushing version {version}, {type(engine).__name__} reports version "
                                   f"{engine.version}: its load_weights did not take the new weights")


class InProcessSync:
    """Stage 1: the engine lives in the trainer's process and copies the trainer's tensors.

    verify: a check run after every push, verify(trainer_weights: {name: tensor}, engine) ->
    a list of problems, e.g. notebook 02's `check_synchronization`, which compares every weight
    the engine holds with the trainer's within the rounding of the engine's dtype (slower: it
    reads every tensor twice). Raises RuntimeError naming the problems.
    """

    def __init__(self, verify: Callable[[dict, RolloutEngine], list[str]] | None = None):
        self.verify = verify

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        named = [(name, tensor.detach()) for name, tensor in named_weights]
        engine.load_weights(named, version)
        check_pushed(engine, version)
        if self.verify is not None:
            problems = self.verify(dict(named), engine)
            if problems:
                raise RuntimeError("weight sync left the engine stale: " + "; ".join(problems))
        return SyncReport(version, len(named), sum(t.numel() * t.element_size() for _, t in named),
                          time.perf_counter() - start)
