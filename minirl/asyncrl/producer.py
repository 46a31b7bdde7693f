# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Rollout producers: a weight store, sampling with in-flight updates, the producer threads' loop.

`WeightStore` holds the trainer's latest published weights and their version; it stands
where stage 1's engine stood for the trainer's weight sync (`load_weights`, `version`), so
the trainer pushes into it with stage 1's `InProcessSync`. A `Producer` owns an engine (any
stage-1 engine: a copy of the policy), pulls the newest weights through an `InProcessSync`
before each engine call, samples the G completions of each of its prompts, runs their
environment sessions and returns `Trajectory` objects with per-token versions and
behaviour log-probs. With `in_flight` it also pulls new weights between decoding steps: it
runs the shared-prefix engine's own loop (notebook 01) with a hook before every forward pass,
so there is no decoding loop here. `producer_loop` is what a producer thread runs: gate
tickets -> trajectories -> queue. The producers as Ray actors are in `asyncrl/ray_producer.py`.

Simplified vs AReaL / PipelineRL: the KV cache is not recomputed after an in-flight switch;
the store is a dict of tensors in one process.
"""

__all__ = ["WeightStore", "trajectory_seed", "pick_row", "Producer", "producer_loop"]

import dataclasses
import random
import threading
import time

import torch
from torch import Tensor

from minirl.asyncrl.env import run_sessions
from minirl.asyncrl.queue import ExperienceQueue, StartGate, Trajectory
from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.shared_prefix import SharedPrefixEngine
from minirl.sync.base import InProcessSync


class WeightStore:
    """The trainer's latest weights and version: `load_weights` from the trainer's sync, `latest` from a producer."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version, self.weights = -1, {}

    def publish(self, named_weights, version: int) -> int:
        """Store a detached copy of the weights as `version` (> the last one); returns the bytes copied."""
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


def trajectory_seed(seed: int, ticket: int) -> int:
    """The sampling seed of the ticket-th trajectory of a run: the same ticket samples the same way."""
    return (seed * 1_000_003 + ticket * 7_919) % 2**62


def pick_row(rows: list[dict], seed: int, ticket: int) -> dict:
    return rows[random.Random(trajectory_seed(seed, ticket)).randrange(len(rows))]


class Producer:
    """One rollout worker: an engine, its environment, and the store it pulls weights from.

    make_env: a callable returning a fresh environment (one per session); env_timeout: seconds
    a session may take; in_flight: pick up new weights between decoding steps (else between
    engine calls only; needs a SharedPrefixEngine, whose loop takes the hook). Thread-safe:
    generation holds the producer's lock, sessions do not.
    """

    def __init__(self, name: str, engine, store: WeightStore, make_env, sampling: SamplingConfig,
                 env_timeout: float = 5.0, max_turns: int = 1, in_flight: bool = False):
        if in_flight and not isinstance(engine, SharedPrefixEngine):
            raise TypeError(f"Producer(in_flight=True) needs a SharedPrefixEngine (its decoding loop takes new "
                            f"weights between tokens), not {type(engine).__name__}")
        self.name, self.engine, self.store, self.make_env = name, engine, store, make_env
        self.sampling, self.env_timeout, self.max_turns, self.in_flight = sampling, env_timeout, max_turns, in_flight
        self.sync = InProcessSync()
        self.lock = threading.Lock()
        self.switches = 0              # weight loads in the middle of a sequence

    def refresh(self, mid_sequence: bool = False) -> None:
        """Load the store's weights when they are newer than the engine's."""
        version, weights = self.store.latest()
        if version > self.engine.version:
            self.sync.push(weights.items(), self.engine, version)
            self.switches += int(mid_sequence)

    def policy(self, prompt: str) -> str:
        """One completion of `prompt` with the current weights: a later turn of a multi-turn session."""
        one = dataclasses.replace(self.sampling, num_generations=1)
        with self.lock:
            return self.engine.generate([prompt], one).completions[0]

    def sample(self, prompts: list[str], generator: torch.Generator) -> Rollout:
        """G completions per prompt in one engine call, with `token_versions` [N, C] and the oldest token's version.

        With in_flight the engine's loop calls `refresh` before every forward pass but the first,
        so each token records the version that sampled it (one per decoding step, shared by
        the rows) and its behaviour log-prob is the one it was sampled with.
        """
        self.refresh()
        if not self.in_flight:
            rollout = self.engine.generate(prompts, self.sampling, generator=generator)
            rollout.token_versions = torch.full_like(rollout.completion_ids, rollout.version)    # [N, C]
            return rollout
        versions = []                                                # the version of each decoding step

        def before_forward():
            if versions:
                self.refresh(mid_sequence=True)                      # new weights between decoding steps
            versions.append(self.engine.version)
        rollout = self.engine.generate(prompts, self.sampling, generator=generator, before_forward=before_forward)
        steps = torch.tensor(versions, device=rollout.completion_ids.device)                   # [C]
        rollout.token_versions = steps.expand_as(rollout.completion_ids).clone()               # [N, C]
        rollout.version = versions[0]                                # every row's first token is the oldest
        return rollout

    def generate(self, rows: list[dict], seed: int) -> list[tuple[dict, Rollout, float, float]]:
        """Sample G completions of each row's prompt in one engine call; returns (row, its G-row Rollout,
        started, generated) per row."""
        started = time.perf_counter()
        generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        with self.lock:
            parts = self.sample([r["prompt"] for r in rows], generator).split(len(rows))   # one part per prompt
        generated = time.perf_counter()
        return [(row, part, started, generated) for row, part in zip(rows, parts, strict=True)]

    def score(self, row: dict, rollout: Rollout, seed: int, started: float, generated: float,
              ticket: int = -1) -> Trajectory:
        """Run one isolated environment session per completion; the scored Trajectory."""
        G = len(rollout.completions)
        results = run_sessions(self.make_env, row, rollout.completions, self.policy,
                               [seed + i for i in range(G)], self.env_timeout, self.max_turns)
        failed = [r for r in results if r.error is not None]
        names = dict.fromkeys(name for r in results for name in (r.scores or {}))
        scores = {name: torch.tensor([(r.scores or {}).get(name, 0.0) for r in results]) for name in names}   # [G]
        return Trajectory(rollout, torch.tensor([r.reward for r in results], dtype=torch.float32), row, self.name,
                          started, generated, time.perf_counter(), env_failures=len(failed),
                          env_timeouts=sum(r.timed_out for r in failed), env_errors=tuple(r.error for r in failed[:2]),
                          ticket=ticket, scores=scores)

    def produce(self, rows: list[dict], seeds: list[int], tickets: list[int]) -> list[Trajectory]:
        """generate, then score every row's group (their sessions all at once); one Trajectory per row."""
        generated = self.generate(rows, seeds[0])
        out: list[Trajectory | None] = [None] * len(rows)

        def finish(i, item):
            out[i] = self.score(*item[:2], seeds[i], *item[2:], ticket=tickets[i])
        threads = [threading.Thread(target=finish, args=(i, item), daemon=True) for i, item in enumerate(generated)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def _record(timeline, traj: Trajectory) -> None:
    if timeline is not None:
        timeline.add(traj.producer, "generate", traj.started, traj.generated)
        timeline.add(traj.producer, "environment", traj.generated, traj.finished)


def producer_loop(producer, rows: list[dict], seed: int, gate: StartGate, queue: ExperienceQueue, timeline=None,
                  errors: list | None = None, prompts_per_call: int = 1) -> None:
    """What a producer thread runs until the gate closes: tickets -> generation -> sessions -> queue.

    A ticket fixes its trajectory's prompt (`pick_row`) and seed (`trajectory_seed`); one call
    of up to `prompts_per_call` tickets samples with its first ticket's seed. A local Producer
    scores each prompt's group in a thread of its own and queues it as soon as its own
    sessions end (a slow session delays only its group), and goes on sampling. A
    RayProducerClient's `produce` returns the groups of one remote call together. An
    exception (a broken engine, a FutureVersionError) is appended to `errors` and closes the
    queue, so the trainer stops with it instead of waiting forever.
    """
    def fail(err):
        if errors is not None:
            errors.append(err)
        queue.close()
        gate.close()

    def finish(item, seed_, ticket):
        try:
            traj = producer.score(*item[:2], seed_, *item[2:], ticket=ticket)
            _record(timeline, traj)
            queue.put(traj)
        except Exception as err:  # handed to the trainer, which raises it
            fail(err)

    try:
        while (tickets := gate.acquire(prompts_per_call)) is not None:
            picked = [pick_row(rows, seed, t) for t in tickets]
            seeds = [trajectory_seed(seed, t) for t in tickets]
            if isinstance(producer, Producer):
                for item, seed_, ticket in zip(producer.generate(picked, seeds[0]), seeds, tickets, strict=True):
                    threading.Thread(target=finish, args=(item, seed_, ticket), daemon=True).start()
            else:
                for traj in producer.produce(picked, seeds, tickets):
                    _record(timeline, traj)
                    queue.put(traj)
    except Exception as err:  # handed to the trainer, which raises it
        fail(err)
