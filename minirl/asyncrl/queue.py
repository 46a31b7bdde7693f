# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The bounded experience queue of asynchronous RL: the staleness rule, a start gate, a queue.

Checkpoints, record numbers and closing are mixins from `minirl/runtime/async_bookkeeping.py`.
Simplified vs AReaL and LlamaRL: one process holds the queue; no priority by age.
"""

__all__ = ["FutureVersionError", "admit", "Trajectory", "StartGate", "ExperienceQueue"]

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from torch import Tensor

from minirl.data import Rollout
from minirl.runtime.async_bookkeeping import GateBookkeeping, QueueBookkeeping
from minirl.runtime.async_config import check_queue_sizes
from minirl.runtime.validate import check_int


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
        raise FutureVersionError(f"trajectory version {version} is newer than the trainer's "
                                 f"version {trainer_version}: versions must come from weights "
                                 "the trainer published")
    return trainer_version - version <= max_staleness


@dataclass
class Trajectory:
    """One prompt's G completions, scored by their environment sessions: what a producer queues.

    rollout: G rows, its `token_versions` [G, C] set and its `version` the oldest of its tokens'
    versions; rewards: [G] float; times in time.perf_counter seconds; ticket: its number at the
    start gate, which fixes its prompt and seed.
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
    ticket: int = -1              # the start gate's number for it: fixes its prompt and seed
    scores: dict = field(default_factory=dict)   # {reward function: [G] values}
    logged: dict = field(default_factory=dict)   # what its reward functions logged (TRL's log_metric)

    @property
    def version(self) -> int:
        return self.rollout.version


class StartGate(GateBookkeeping):
    """Tickets for starting trajectories: at most (V + eta + 1) * B started for trainer version V.

    Each `acquire` is one call (the tickets one engine call samples together), kept in `calls`
    so that a checkpoint knows what is in flight (`GateBookkeeping`).
    """

    def __init__(self, batch_size: int, max_staleness: int):
        check_queue_sizes(batch_size, max_staleness)
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.started = 0        # trajectories counted against the bound: handed out, minus refunds
        self.next_ticket = 0    # ticket numbers are never reused
        self.version = 0
        self.closed = False
        self.calls: dict[int, dict[int, str]] = {}   # first ticket -> {ticket: its state}
        self.again: deque[list[int]] = deque()        # calls to hand out again (after a resume)
        self._cond = threading.Condition()

    def limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_size

    def acquire(self, most: int = 1) -> list[int] | None:
        """Block until a trajectory may start; then the tickets of one call: up to `most` new ones,
        or a whole call to sample again (after a resume). None once the gate is closed."""
        with self._cond:
            while not self.closed:
                room = self.limit() - self.started
                if self.again and len(self.again[0]) <= room:
                    tickets = self.again.popleft()
                    break
                if not self.again and room > 0:
                    n = min(most, room)
                    tickets = list(range(self.next_ticket, self.next_ticket + n))
                    self.next_ticket += n
                    break
                self._cond.wait()
            if self.closed:
                return None
            self.started += len(tickets)
            self.calls[tickets[0]] = {t: "out" for t in tickets}
            return tickets

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


class ExperienceQueue(QueueBookkeeping):
    """A bounded, thread-safe FIFO of Trajectory objects with staleness admission.

    capacity: trajectories it holds at most (>= batch_size, or the trainer could never take
    a batch); batch_size: trajectories per training batch (B); max_staleness: eta.
    gate: the StartGate whose tickets it resolves and refunds (None: neither).
    """

    def __init__(self, capacity: int, batch_size: int, max_staleness: int,
                 gate: StartGate | None = None):
        check_queue_sizes(batch_size, max_staleness, capacity)
        self.capacity, self.batch_size, self.max_staleness = capacity, batch_size, max_staleness
        self.gate, self.trainer_version = gate, 0
        self.admitted = self.dropped = 0
        self.closed = False
        self._items: deque[Trajectory] = deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, traj: Trajectory) -> None:
        self.dropped += 1
        self._resolve(traj, "dropped")
        if self.gate is not None:
            self.gate.refund()

    def put(self, traj: Trajectory) -> bool:
        """Queue a trajectory (blocking while full). False when it was dropped as too stale or the
        queue closed. Raises FutureVersionError for a version newer than the trainer's."""
        with self._cond:
            while not self.closed and len(self._items) >= self.capacity:
                self._cond.wait()
            if self.closed:
                return False
            if not admit(self.trainer_version, traj.version, self.max_staleness):
                self._drop(traj)
                return False
            self._items.append(traj)
            self._resolve(traj, "queued")
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
                    raise TimeoutError(f"ExperienceQueue: {len(batch)} of {self.batch_size} "
                                       f"trajectories after {timeout} s; are the producers running?")
                self._cond.wait(left)
            self.admitted += len(batch)
            for traj in batch:
                self._resolve(traj, "trained")
        return batch

    def advance(self, version: int) -> None:
        """The trainer published `version`: admission is judged against it from now on."""
        with self._cond:
            self.trainer_version = version
            self._cond.notify_all()
