"""Stage timers: `with timer("generate"): ...` adds the seconds to `timer.times["time/generate"]`.

Hand-written (it teaches nothing). Every orchestration times its stages with the same names
(generate, score, reference, advantages, update, update_critic, sync), so that notebook 09
can read any run's time shares from its metrics file.

On a GPU the host runs ahead of the device: a stage returns as soon as its kernels are
queued, and the next stage's first synchronizing call (a `.item()`, a copy to the CPU) pays
for them. So a timer that reads only the host's clock charges one stage's GPU work to
another, and the time shares notebook 09 reads are wrong. `StageTimer` therefore waits for
the device (`torch.cuda.synchronize`) when a stage starts and when it ends, whenever this
process has CUDA initialized: both clocks then bracket the stage's own kernels. On a CPU
nothing is synchronized and nothing is imported, so CPU runs time exactly as before.
Simplified: one synchronize of the current device (a process drives one GPU in minirl);
CUDA events would time the device without stalling the host, but the stall is what makes
the next stage start on an idle device, which is what a share means.

`median_ms(fns, reps)` times a few functions against each other, interleaved (one call of each
per round, so a change of machine load hits all of them alike), and returns each one's median
milliseconds with the first round dropped (warm-up).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time


def cuda_in_use(device=None) -> bool:
    """Whether a stage on `device` may have queued CUDA work: "cpu" never; "cuda..." yes when CUDA is up;
    None (auto) yes when this process has initialized CUDA. Never imports torch (no torch: no CUDA work)."""
    if device is not None and not str(device).startswith("cuda"):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


def synchronize(device=None) -> None:
    """Wait until every kernel queued on `device` (None: the current CUDA device) has finished; no-op on a CPU."""
    if cuda_in_use(device):
        torch = sys.modules["torch"]
        torch.cuda.synchronize(None if device is None or str(device) == "cuda" else device)


class StageTimer:
    """Wall-clock seconds per named stage, accumulated over `with timer(name):` blocks.

    device: where the stages run: None (auto: synchronize CUDA whenever this process uses
    it), "cpu" (never synchronize), or "cuda" / "cuda:N" (synchronize that device). With
    CUDA the clock starts after the queued work before the stage is done and stops after
    the stage's own work is done (see the module docstring).
    """

    def __init__(self, device=None):
        self.times: dict[str, float] = {}
        self.device = device

    @contextlib.contextmanager
    def __call__(self, name: str):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
            synchronize(self.device)                       # not after an error: it would hide it
        finally:
            key = f"time/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start


def median_ms(fns: dict, reps: int, desc: str | None = None) -> dict:
    """Run each function `reps` times, interleaved; median milliseconds per function, the first round
    dropped when there are more than two (with `desc`: a progress bar)."""
    from tqdm.auto import tqdm  # noqa: PLC0415 (only when something is timed)

    times = {name: [] for name in fns}
    for _ in tqdm(range(reps), desc=desc, disable=desc is None):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t[1:] if len(t) > 2 else t) for name, t in times.items()}
