"""What stage 7 keeps besides learning: checkpoints of the queue and gate, and the numbers of each step's record.

Notebook 07 builds the staleness machinery (`asyncrl/queue.py`: the start gate and the bounded
queue); this module holds the bookkeeping around it, which teaches nothing about RL at scale:

- `GateBookkeeping` and `QueueBookkeeping` are mixins that `StartGate` and `ExperienceQueue`
  inherit: their checkpoints, their record numbers, and `close` (producers and the trainer
  blocked on them wake up and stop). The gate remembers every call (the tickets one engine call samples together) until
  each of its tickets is resolved (`resolve`: queued, then trained, or dropped), so that a
  checkpoint knows what is in flight. At a checkpoint (`ExperienceQueue.state_dict`, taken
  under both locks, so no trajectory is counted twice or lost) the queued trajectories are
  saved and re-queued on resume; the trajectories still in flight (being sampled, in an
  environment session, or waiting for room) are not saved: their tickets are handed out again
  on resume, in their original calls, so they are sampled again from the same prompts and seeds
  with the checkpoint's weights. A queued trajectory whose call still has one in flight goes with
  its call (sampled again), so that a call is always sampled whole; at eta = 0 the resumed run
  then repeats the uninterrupted one exactly.
- `QueueBookkeeping.stats` (depth, ages, drops) and `batch_health` (staleness, mixed-version
  sequences, environment failures, each reward function's mean) go into every step's record.
- `WeightStore` holds the trainer's latest published weights and their version: it stands
  where stage 1's engine stood for the trainer's weight sync (`load_weights`), so the trainer
  pushes into it with stage 1's `InProcessSync`, and producers pull from it (`latest`).
- `Timeline` collects what each producer and the trainer did, and when (thread-safe, appended
  from any thread), for the trainer's idle share and the plots of notebook 07.
"""

import dataclasses
import threading
import time
from collections import deque

import torch
from torch import Tensor

from minirl.runtime.reward_extras import join_dumps, logged_metrics


def shifted(traj, seconds: float):
    """The same Trajectory with its times moved by `seconds` (to save them relative to a checkpoint's clock)."""
    return dataclasses.replace(traj, started=traj.started + seconds, generated=traj.generated + seconds,
                               finished=traj.finished + seconds)


class GateBookkeeping:
    """The checkpoint half of StartGate, and `close` (a mixin: it reads the gate's lock, calls, tickets and
    counters)."""

    def close(self) -> None:
        """No more tickets: producers blocked in `acquire` get None and stop."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

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


class QueueBookkeeping:
    """The checkpoint half of ExperienceQueue, its numbers for the record, and `close` (a mixin: it reads the
    queue's lock, items, gate and counters)."""

    def close(self) -> None:
        """Producers blocked in `put` return False; a trainer blocked in `get_batch` gets RuntimeError."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _resolve(self, traj, outcome: str) -> None:
        """Tell the gate (if any) what became of a trajectory's ticket: queued, trained or dropped."""
        if self.gate is not None:
            self.gate.resolve(traj.ticket, outcome)

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
            queued = [shifted(t, -now) for t in self._items if t.ticket not in again]
            return {"queued": queued, "gate": gate, "admitted": self.admitted, "dropped": self.dropped}

    def load_state_dict(self, state: dict, version: int) -> None:
        """Continue from a checkpoint's `state_dict` with the trainer at `version`, before any producer starts."""
        now = time.perf_counter()
        with self._cond:
            self._items = deque(shifted(t, now) for t in state["queued"])
            self.admitted, self.dropped, self.trainer_version = state["admitted"], state["dropped"], version
            if self.gate is not None:                 # started: trained + queued (what is in flight starts again)
                self.gate.restore(state["gate"], self.admitted + len(self._items), version)
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


def batch_health(trajectories: list, rollout, trainer_version: int) -> dict:
    """The record's stage-7 numbers about a batch of Trajectory objects: completions, staleness, mixed-version
    sequences, env failures, and `rewards/<name>`, each reward function's unweighted mean over the batch (stage
    1's names; a completion it returned None for, NaN, left out as TRL does), when the environment kept them;
    and what the reward functions logged with TRL's `log_metric`, each name's mean over the batch."""
    behind = [trainer_version - t.version for t in trajectories]
    names = dict.fromkeys(name for t in trajectories for name in t.scores)
    means = {f"rewards/{name}": torch.cat([t.scores.get(name, torch.zeros(len(t.rewards))) for t in trajectories])
             .double().nanmean().item() for name in names}
    logs = [getattr(t, "logged", None) or {"values": {}, "columns": {}} for t in trajectories]
    means |= logged_metrics(join_dumps(logs, [len(t.rewards) for t in trajectories]))
    mask = rollout.completion_mask.bool()
    tv = rollout.token_versions                                                         # [N, C]
    mixed = ((tv.masked_fill(~mask, -1).max(1).values != tv.masked_fill(~mask, 2**62).min(1).values)
             & mask.any(1)).sum().item()
    return {"trajectories": len(rollout), "staleness/max": max(behind), "staleness/mean": sum(behind) / len(behind),
            "tokens/mixed_versions": mixed, "env/failures": sum(t.env_failures for t in trajectories),
            "env/timeouts": sum(t.env_timeouts for t in trajectories),
            "env/errors": [e for t in trajectories for e in t.env_errors][:2]} | means


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


class WeightStore:
    """The trainer's latest weights and version: `load_weights` from the trainer's sync,
    `latest` from a producer."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version, self.weights = -1, {}

    def publish(self, named_weights, version: int) -> int:
        """Store a detached copy of the weights as `version` (> the last one); returns bytes."""
        copy = {name: t.detach().clone() for name, t in named_weights}
        with self._lock:
            if version <= self.version:
                raise ValueError(f"WeightStore.publish: version {version} after {self.version}; "
                                 "versions must increase")
            self.version, self.weights = version, copy
        return sum(t.numel() * t.element_size() for t in copy.values())

    def load_weights(self, named_weights, version: int) -> None:
        """The engine protocol's name for `publish`: what a WeightSync pushes into."""
        self.publish(named_weights, version)

    def latest(self) -> tuple[int, dict[str, Tensor]]:
        with self._lock:
            return self.version, self.weights
