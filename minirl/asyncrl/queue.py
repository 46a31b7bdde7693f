# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The bounded experience queue of asynchronous RL: who may start, who is admitted, what waits.

- `admit(trainer_version, version, max_staleness)`: the staleness rule.
- `StartGate`: AReaL's bound on how far rollout runs ahead of training. The k-th trajectory
  (0-based) may start only while k < (V + eta + 1) * B for trainer version V and batch size B,
  so at eta = 0 producers make exactly one batch per version and wait for the trainer
  (synchronous RL), and at eta = 1 they make the next batch while the trainer works on this.
- `ExperienceQueue`: a bounded FIFO between producers and the trainer. `put` blocks while it
  is full and drops a trajectory that is already too stale (refunding its start at the gate),
  and `get_batch` checks every trajectory again against the trainer's version when it is
  taken. Its `stats` (depth, ages, drops) go into every step's record.

Simplified vs AReaL and LlamaRL: one process holds the queue (Ray producers ship their
trajectories to it); no priority by age, no training on partial batches.
"""

__all__ = ["FutureVersionError", "admit", "Trajectory", "StartGate", "ExperienceQueue"]

import threading
import time
from collections import deque
from dataclasses import dataclass

from torch import Tensor

from minirl.data import Rollout
from minirl.utils.validate import ConfigError, check_int


class FutureVersionError(RuntimeError):
    """A trajectory claims a policy version the trainer has not published yet."""


def admit(trainer_version: int, version: int, max_staleness: int) -> bool:
    """May the trainer at `trainer_version` learn from a trajectory generated at `version`?

    True when trainer_version - version <= max_staleness (the versions behind, or the
    staleness, is at most eta). False when it is staler: the caller drops it and counts it.
    Raises ConfigError (a ValueError) naming max_staleness when it is negative or not an int,
    and FutureVersionError naming both versions when version > trainer_version (a trajectory
    from weights the trainer never published is a bookkeeping bug, not data).
    """
    check_int("max_staleness", max_staleness, low=0)
    if version > trainer_version:
        raise FutureVersionError(f"trajectory version {version} is newer than the trainer's version "
                                 f"{trainer_version}: versions must come from weights the trainer published")
    return trainer_version - version <= max_staleness


@dataclass
class Trajectory:
    """One prompt's G completions, scored by their environment sessions: what a producer queues.

    rollout: G rows (a Rollout with num_generations = G), its `token_versions` [G, C] set and
    its `version` the oldest of its tokens' versions; rewards: [G] float; times in
    time.perf_counter seconds.
    """

    rollout: Rollout
    rewards: Tensor               # [G]
    row: dict                     # the dataset row ({"prompt", "answer", ...})
    producer: str                 # who made it ("producer 3", "ray 1/2", ...)
    started: float                # the producer took it
    generated: float              # its generation ended (the environment sessions start)
    finished: float               # its last environment session ended
    env_failures: int = 0         # sessions that raised, hung past their timeout or returned junk
    env_timeouts: int = 0         # of those, the ones that hung
    env_errors: tuple = ()        # a few of the failures, as text

    @property
    def version(self) -> int:
        return self.rollout.version


class StartGate:
    """Tickets for starting trajectories: at most (V + eta + 1) * B started for trainer version V."""

    def __init__(self, batch_size: int, max_staleness: int):
        check_int("batch_size", batch_size, low=1)
        check_int("max_staleness", max_staleness, low=0)
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.started = 0        # tickets handed out, minus refunds
        self.version = 0
        self.closed = False
        self._cond = threading.Condition()

    def limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_size

    def acquire(self, most: int = 1) -> list[int] | None:
        """Block until a trajectory may start; then up to `most` ticket numbers (at least one).

        None once the gate is closed.
        """
        with self._cond:
            while not self.closed and self.started >= self.limit():
                self._cond.wait()
            if self.closed:
                return None
            n = min(most, self.limit() - self.started)
            self.started += n
            return list(range(self.started - n, self.started))

    def advance(self, version: int) -> None:
        """The trainer published `version`: more trajectories may start."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def refund(self, n: int = 1) -> None:
        """n started trajectories were dropped: others may start in their place."""
        with self._cond:
            self.started -= n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class ExperienceQueue:
    """A bounded, thread-safe FIFO of Trajectory objects with staleness admission.

    capacity: trajectories it holds at most (>= batch_size, or the trainer could never take
    a batch); batch_size: trajectories per training batch (B); max_staleness: eta.
    gate: a StartGate to refund when a trajectory is dropped (None: no refunds).
    """

    def __init__(self, capacity: int, batch_size: int, max_staleness: int, gate: StartGate | None = None):
        check_int("batch_size", batch_size, low=1)
        check_int("max_staleness", max_staleness, low=0)
        check_int("queue_capacity", capacity)
        if capacity < batch_size:
            raise ConfigError("queue_capacity", capacity, f"the queue must hold at least one batch of {batch_size} "
                              "trajectories (prompts_per_step); raise queue_capacity or lower prompts_per_step")
        self.capacity, self.batch_size, self.max_staleness, self.gate = capacity, batch_size, max_staleness, gate
        self.trainer_version = 0
        self.admitted = self.dropped = 0
        self.closed = False
        self._items: deque[Trajectory] = deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, traj: Trajectory) -> None:
        self.dropped += 1
        if self.gate is not None:
            self.gate.refund()

    def put(self, traj: Trajectory) -> bool:
        """Queue a trajectory (blocking while full). False when it was dropped as too stale or the queue closed.

        Raises FutureVersionError for a version newer than the trainer's.
        """
        with self._cond:
            while not self.closed and len(self._items) >= self.capacity:
                self._cond.wait()
            if self.closed:
                return False
            if not admit(self.trainer_version, traj.version, self.max_staleness):
                self._drop(traj)
                return False
            self._items.append(traj)
            self._cond.notify_all()
            return True

    def get_batch(self, timeout: float | None = None) -> list[Trajectory]:
        """The next batch_size admissible trajectories, oldest first (blocking); stale ones are dropped.

        Raises TimeoutError when no batch is complete after `timeout` seconds, and RuntimeError
        when the queue closes before one is.
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        batch: list[Trajectory] = []
        with self._cond:
            while len(batch) < self.batch_size:
                while self._items and len(batch) < self.batch_size:
                    traj = self._items.popleft()
                    if admit(self.trainer_version, traj.version, self.max_staleness):
                        batch.append(traj)
                    else:
                        self._drop(traj)
                self._cond.notify_all()                           # room for the producers
                if len(batch) == self.batch_size:
                    break
                if self.closed:
                    raise RuntimeError("ExperienceQueue closed before a batch was complete")
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    self._items.extendleft(reversed(batch))        # put them back, in order
                    raise TimeoutError(f"ExperienceQueue: {len(batch)} of {self.batch_size} trajectories after "
                                       f"{timeout} s; are the producers running?")
                self._cond.wait(left)
            self.admitted += len(batch)
        return batch

    def advance(self, version: int) -> None:
        """The trainer published `version`: admission is judged against it from now on."""
        with self._cond:
            self.trainer_version = version
            self._cond.notify_all()

    def stats(self, now: float | None = None) -> dict[str, float]:
        """queue/depth, queue/age_mean and queue/age_max (seconds since finished), queue/versions_behind_max,
        queue/dropped and queue/admitted (totals so far)."""
        now = time.perf_counter() if now is None else now
        with self._cond:
            ages = [now - t.finished for t in self._items]
            behind = [self.trainer_version - t.version for t in self._items]
            return {"queue/depth": len(self._items), "queue/age_mean": sum(ages) / len(ages) if ages else 0.0,
                    "queue/age_max": max(ages, default=0.0), "queue/versions_behind_max": max(behind, default=0),
                    "queue/dropped": self.dropped, "queue/admitted": self.admitted}

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
