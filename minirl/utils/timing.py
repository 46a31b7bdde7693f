"""Stage timers: `with timer("generate"): ...` adds the seconds to `timer.times["time/generate"]`.

Hand-written (it teaches nothing). Every orchestration times its stages with the same names
(generate, score, reference, advantages, update, update_critic, sync), so that notebook 09
can read any run's time shares from its metrics file.
"""

from __future__ import annotations

import contextlib
import time


class StageTimer:
    """Wall-clock seconds per named stage, accumulated over `with timer(name):` blocks."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start
