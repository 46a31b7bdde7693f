# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Who waits when: idle shares of a synchronous step, and the events of a run's timeline.

`sync_step_idle` is the arithmetic of a synchronous step from its trajectories' durations;
`Timeline` collects what each producer and the trainer did, and when, in a run (thread-safe,
appended from any thread), for the plots of notebook 07 and for the trainer's idle share.
"""

__all__ = ["sync_step_idle", "Timeline"]

import threading
import time


def sync_step_idle(durations: list[float], train_seconds: float) -> dict[str, float]:
    """Idle shares of one synchronous step: each trajectory on its own rollout slot, then the update.

    durations: seconds each of the step's n trajectories takes (n >= 1, each >= 0), one per
    rollout slot, all started together at time 0. train_seconds: the update's seconds (>= 0),
    which starts when the slowest trajectory ends. The step lasts
    T = max(durations) + train_seconds. Returns
      "trainer": the trainer's idle share, max(durations) / T (it waits for the slowest);
      "rollout": the rollout slots' mean idle share, mean over slots of (T - d_i) / T (a slot
                 waits for the slowest trajectory, then for the update).
    Both are 0 when T is 0. Raises ValueError for no durations or a negative time.
    """
    if not durations:
        raise ValueError("sync_step_idle: durations is empty; pass one duration per trajectory of the step")
    if min(durations) < 0 or train_seconds < 0:
        raise ValueError(f"sync_step_idle: times must be >= 0 (durations min {min(durations)}, "
                         f"train_seconds {train_seconds})")
    slowest = max(durations)
    total = slowest + train_seconds
    if total == 0:
        return {"trainer": 0.0, "rollout": 0.0}
    return {"trainer": slowest / total,
            "rollout": sum(total - d for d in durations) / (len(durations) * total)}


class Timeline:
    """Events (who, what, start, end) in perf_counter seconds, appended from any thread."""

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    def add(self, who: str, what: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append((who, what, start, end))

    def busy(self, who: str, what: str) -> float:
        """Total seconds of `who` doing `what`."""
        with self._lock:
            return sum(end - start for w, x, start, end in self.events if w == who and x == what)

    def window(self, start: float, end: float) -> dict[str, list[tuple[str, float, float]]]:
        """{who: [(what, start, end), ...]} of the events that overlap [start, end], times from t0."""
        rows: dict[str, list] = {}
        with self._lock:
            for who, what, s, e in sorted(self.events, key=lambda ev: (ev[0], ev[2])):
                if e >= start and s <= end:
                    rows.setdefault(who, []).append((what, s - self.t0, e - self.t0))
        return rows
