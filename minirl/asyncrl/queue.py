# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The bounded experience queue of asynchronous RL: who may start, who is admitted, what waits.

- `admit(trainer_version, version, max_staleness)`: the staleness rule.
- `StartGate`: AReaL's bound on how far rollout runs ahead of training. It hands out
  numbered tickets, one per trajectory, in calls (the tickets of one engine call); at most
  (V + eta + 1) * B may be started for trainer version V and batch size B, so at eta = 0
  producers make exactly one batch per version and wait for the trainer (synchronous RL),
  and at eta = 1 they make the next batch while the trainer works on this. A ticket fixes
  its trajectory's prompt and seed, so a ticket handed out again samples the same way.
- `ExperienceQueue`: a bounded FIFO between producers and the trainer. `put` blocks while it
  is full and drops a trajectory that is already too stale (refunding its start at the gate),
  and `get_batch` checks every trajectory again against the trainer's version when it is
  taken. Its `stats` (depth, ages, drops) go into every step's record.

At a checkpoint (`ExperienceQueue.state_dict`, taken under both locks, so no trajectory is
counted twice or lost): the queued trajectories are saved and re-queued on resume; the
trajectories still in flight (being sampled, in an environment session, or waiting for room)
are not saved: their tickets are handed out again on resume, in their original calls, so
they are sampled again from the same prompts and seeds with the checkpoint's weights. A
queued trajectory whose call still has one in flight goes with its call (sampled again), so
that a call is always sampled whole; at eta = 0 the resumed run then repeats the
uninterrupted one exactly.

Simplified vs AReaL and LlamaRL: one process holds the queue (Ray producers ship their
trajectories to it); no priority by age, no training on partial batches.
"""

__all__ = ["FutureVersionError", "admit", "Trajectory", "StartGate", "QueueCheckpoint",
           "ExperienceQueue"]

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from torch import Tensor

from minirl.data import Rollout
from minirl.runtime.validate import ConfigError, check_int


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
    time.perf_counter seconds; ticket: its number at the start gate (-1: none); scores: each
    reward function's values [G] by name, when the environment keeps them (a task's RewardEnv).
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
    scores: dict = field(default_factory=dict)   # {reward function: [G] values} (a failed session: 0)

    @property
    def version(self) -> int:
        return self.rollout.version

    def shifted(self, seconds: float) -> "Trajectory":
        """The same trajectory with its times moved by `seconds` (to carry them across processes)."""
        return dataclasses.replace(self, started=self.started + seconds, generated=self.generated + seconds,
                                   finished=self.finished + seconds)


class StartGate:
    """Tickets for starting trajectories: at most (V + eta + 1) * B started for trainer version V.

    Each `acquire` is one call (the tickets one engine call samples together); the gate keeps
    every call until each of its tickets is resolved (`resolve`: queued, then trained, or
    dropped), so that a checkpoint knows what is in flight.
    """

    def __init__(self, batch_size: int, max_staleness: int):
        check_int("batch_size", batch_size, low=1)
        check_int("max_staleness", max_staleness, low=0)
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.started = 0        # trajectories counted against the bound: handed out, minus refunds
        self.next_ticket = 0    # ticket numbers are never reused
        self.version = 0
        self.closed = False
        self.calls: dict[int, dict[int, str]] = {}   # first ticket -> {ticket: out, queued, trained or dropped}
        self.again: deque[list[int]] = deque()        # calls to hand out again first (from a checkpoint)
        self._cond = threading.Condition()

    def limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_size

    def acquire(self, most: int = 1) -> list[int] | None:
        """Block until a trajectory may start; then the tickets of one call: up to `most` new ones, or a
        whole call to sample again (after a resume). None once the gate is closed."""
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

    def resolve(self, ticket: int, outcome: str) -> None:
        """What became of a ticket: "queued", "trained" or "dropped"; a call whose tickets are all past
        "out" is forgotten once none of them is queued either. Unknown tickets (-1) are ignored."""
        with self._cond:
            for first, call in self.calls.items():
                if ticket in call:
                    call[ticket] = outcome
                    if all(state in ("trained", "dropped") for state in call.values()):
                        del self.calls[first]
                    return

    def checkpoint(self) -> dict:
        """{"again": the calls to sample again if the run stopped now, "next_ticket"}: every call with a
        ticket still out (without its trained or dropped tickets), and those not yet handed out again."""
        with self._cond:
            open_calls = [[t for t, s in call.items() if s in ("out", "queued")] for call in self.calls.values()
                          if "out" in call.values()]
            return {"again": [list(c) for c in self.again] + open_calls, "next_ticket": self.next_ticket}

    def restore(self, checkpoint: dict, started: int, version: int) -> None:
        """Take a checkpoint's tickets back (before any producer starts): `started` trajectories counted."""
        with self._cond:
            self.again, self.next_ticket = deque(checkpoint["again"]), checkpoint["next_ticket"]
            self.started, self.version, self.calls = started, version, {}
            self._cond.notify_all()

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


class QueueCheckpoint:
    """The checkpoint half of ExperienceQueue (a mixin: it reads the queue's lock, items, gate and counters)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the module docstring says what and why): the queued trajectories (their
        times relative to now), the gate's calls to sample again and its next ticket, the counters.

        Taken while the queue is locked, so no producer queues meanwhile: each trajectory is either
        saved or sampled again, never both, never neither.
        """
        with self._cond:
            gate = self.gate.checkpoint() if self.gate is not None else {"again": [], "next_ticket": 0}
            again = {t for call in gate["again"] for t in call}
            now = time.perf_counter()
            queued = [t.shifted(-now) for t in self._items if t.ticket not in again]
            return {"queued": queued, "gate": gate, "admitted": self.admitted, "dropped": self.dropped}

    def load_state_dict(self, state: dict, version: int) -> None:
        """Continue from a checkpoint's `state_dict` with the trainer at `version`, before any producer starts."""
        now = time.perf_counter()
        with self._cond:
            self._items = deque(t.shifted(now) for t in state["queued"])
            self.admitted, self.dropped, self.trainer_version = state["admitted"], state["dropped"], version
            if self.gate is not None:                 # started: trained + queued (what is in flight starts again)
                self.gate.restore(state["gate"], self.admitted + len(self._items), version)
            self._cond.notify_all()


class ExperienceQueue(QueueCheckpoint):
    """A bounded, thread-safe FIFO of Trajectory objects with staleness admission.

    capacity: trajectories it holds at most (>= batch_size, or the trainer could never take
    a batch); batch_size: trajectories per training batch (B); max_staleness: eta.
    gate: the StartGate whose tickets it resolves and refunds (None: neither).
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

    def _resolve(self, traj: Trajectory, outcome: str) -> None:
        if self.gate is not None:
            self.gate.resolve(traj.ticket, outcome)

    def _drop(self, traj: Trajectory) -> None:
        self.dropped += 1
        self._resolve(traj, "dropped")
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
                    raise TimeoutError(f"ExperienceQueue: {len(batch)} of {self.batch_size} trajectories after "
                                       f"{timeout} s; are the producers running?")
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
