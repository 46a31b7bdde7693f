# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Rollout producers: a weight store, token-level sampling with in-flight updates, threads and Ray actors.

`WeightStore` holds the trainer's latest published weights and their version. A `Producer`
owns an engine (any stage-1 engine: a copy of the policy), pulls the newest weights through
an `InProcessSync` before each trajectory (or between decoding steps with `in_flight`), samples
one prompt's G completions, runs their environment sessions and returns a `Trajectory` with
per-token versions and behaviour log-probs. `producer_loop` is what a producer thread runs:
gate ticket -> trajectory -> queue. `RayProducer` runs the same `Producer` inside a Ray actor
(stage 6's `Worker`), and `RayProducerClient` gives the driver's threads the same `produce`.

Simplified vs AReaL / PipelineRL: the KV cache is not recomputed after an in-flight switch;
the store is a dict of tensors in one process (on Ray, one object-store copy per version).
"""

__all__ = ["WeightStore", "trajectory_seed", "pick_row", "sample_in_flight", "Producer",
           "producer_loop", "RayProducer", "RayProducerClient"]

import dataclasses
import random
import threading
import time

import ray
import torch
from torch import Tensor

from minirl.asyncrl.env import run_sessions
from minirl.algo.logprobs import CACHE_ARG
from minirl.asyncrl.queue import ExperienceQueue, StartGate, Trajectory
from minirl.config import RLConfig, SamplingConfig
from minirl.controller.worker import Worker
from minirl.data import Rollout
from minirl.rollout.base import make_rollout
from minirl.sync.base import InProcessSync
from minirl.train.run import build_engine


class WeightStore:
    """The trainer's latest weights and version; `publish` from the trainer, `latest` from any producer."""

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

    def latest(self) -> tuple[int, dict[str, Tensor]]:
        with self._lock:
            return self.version, self.weights


def trajectory_seed(seed: int, ticket: int) -> int:
    """The sampling seed of the ticket-th trajectory of a run: the same ticket samples the same way."""
    return (seed * 1_000_003 + ticket * 7_919) % 2**62


def pick_row(rows: list[dict], seed: int, ticket: int) -> dict:
    return rows[random.Random(trajectory_seed(seed, ticket)).randrange(len(rows))]


@torch.no_grad()
def sample_in_flight(engine, prompt: str, sampling: SamplingConfig, generator: torch.Generator,
                     refresh=None) -> Rollout:
    """G completions of one prompt, token by token with a KV cache; refresh() runs before every token.

    engine: an HFEngine-like object (`model`, `tokenizer`, `version`); refresh: a callable that
    may load new weights into engine.model and bump engine.version (None: never). Returns a
    Rollout whose token_versions [G, C] hold the version each token was sampled with and whose
    version is the oldest of them; logprobs [G, C] are the behaviour log-probs of the sampled
    tokens under the weights and cache that sampled them.
    """
    tok, G = engine.tokenizer, sampling.num_generations
    enc = tok([prompt] * G, return_tensors="pt", add_special_tokens=False).to(engine.device)
    ids, attention = enc.input_ids, enc.attention_mask                                    # [G, P]
    past, step_input = None, ids
    tokens, logps, versions = [], [], []
    done = torch.zeros(G, dtype=torch.bool, device=engine.device)
    for _ in range(sampling.max_completion_length):
        if refresh is not None:
            refresh()                                               # new weights between decoding steps
        cached = {} if past is None else {CACHE_ARG: past}
        out = engine.model(input_ids=step_input, attention_mask=attention, use_cache=True, **cached)
        logits = out.logits[:, -1].float() / sampling.temperature                        # [G, V]
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)                      # [G, 1]
        nxt = torch.where(done[:, None], torch.full_like(nxt, tok.pad_token_id), nxt)
        tokens.append(nxt)
        logps.append(logp.gather(1, nxt))
        versions.append(torch.full_like(nxt, engine.version))
        done |= nxt[:, 0] == tok.eos_token_id
        past, step_input = getattr(out, CACHE_ARG), nxt
        attention = torch.cat([attention, torch.ones_like(nxt)], 1)
        if done.all():
            break
    completion_ids = torch.cat(tokens, 1)                                                 # [G, C]
    rollout = make_rollout(tok, [prompt], G, ids, enc.attention_mask, completion_ids, torch.cat(logps, 1), 0)
    rollout.token_versions = torch.cat(versions, 1)                                       # [G, C]
    live = rollout.token_versions[rollout.completion_mask.bool()]
    rollout.version = int(live.min()) if live.numel() else int(rollout.token_versions.min())
    return rollout


class Producer:
    """One rollout worker: an engine, its environment, and the store it pulls weights from.

    make_env: a callable returning a fresh environment (one per session); env_timeout: seconds
    a session may take; in_flight: pick up new weights between decoding steps (else between
    trajectories only). Thread-safe: generation holds the producer's lock, sessions do not.
    """

    def __init__(self, name: str, engine, store: WeightStore, make_env, sampling: SamplingConfig,
                 env_timeout: float = 5.0, max_turns: int = 1, in_flight: bool = False):
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

    def generate(self, rows: list[dict], seed: int) -> list[tuple[dict, Rollout, float, float]]:
        """Sample G completions of each row's prompt (one engine call for all of them, or token by token
        with `in_flight`); returns (row, its G-row Rollout with token_versions, started, generated) per row."""
        started = time.perf_counter()
        generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        with self.lock:
            self.refresh()
            if self.in_flight:
                parts = []
                for row in rows:
                    tokens = [0]                                     # tokens sampled so far in this sequence

                    def between_tokens():
                        self.refresh(mid_sequence=tokens[0] > 0)
                        tokens[0] += 1
                    parts.append(sample_in_flight(self.engine, row["prompt"], self.sampling, generator,
                                                  between_tokens))
            else:
                rollout = self.engine.generate([r["prompt"] for r in rows], self.sampling, generator=generator)
                rollout.token_versions = torch.full_like(rollout.completion_ids, rollout.version)     # [N, C]
                parts = rollout.split(len(rows))                     # one G-row part per prompt
        generated = time.perf_counter()
        return [(row, part, started, generated) for row, part in zip(rows, parts)]

    def score(self, row: dict, rollout: Rollout, seed: int, started: float, generated: float) -> Trajectory:
        """Run one isolated environment session per completion; the scored Trajectory."""
        G = len(rollout.completions)
        results = run_sessions(self.make_env, row, rollout.completions, self.policy,
                               [seed + i for i in range(G)], self.env_timeout, self.max_turns)
        failed = [r for r in results if r.error is not None]
        return Trajectory(rollout, torch.tensor([r.reward for r in results], dtype=torch.float32), row, self.name,
                          started, generated, time.perf_counter(), env_failures=len(failed),
                          env_timeouts=sum(r.timed_out for r in failed), env_errors=tuple(r.error for r in failed[:2]))

    def produce(self, rows: list[dict], seeds: list[int]) -> list[Trajectory]:
        """generate, then score every row's group (their sessions all at once); one Trajectory per row."""
        generated = self.generate(rows, seeds[0])
        out: list[Trajectory | None] = [None] * len(rows)

        def finish(i, item):
            out[i] = self.score(*item[:2], seeds[i], *item[2:])
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

    A local Producer samples up to `prompts_per_call` prompts in one engine call, then scores
    each prompt's group in a thread of its own and queues it as soon as its own sessions end
    (a slow session delays only its group), and goes on sampling. A RayProducerClient's
    `produce` returns the groups of one remote call together. An exception (a broken engine,
    a FutureVersionError) is appended to `errors` and closes the queue, so the trainer stops
    with it instead of waiting forever.
    """
    def fail(err):
        if errors is not None:
            errors.append(err)
        queue.close()
        gate.close()

    def finish(item, ticket):
        try:
            traj = producer.score(*item[:2], trajectory_seed(seed, ticket), *item[2:])
            _record(timeline, traj)
            queue.put(traj)
        except Exception as err:  # handed to the trainer, which raises it
            fail(err)

    try:
        while (tickets := gate.acquire(prompts_per_call)) is not None:
            picked = [pick_row(rows, seed, t) for t in tickets]
            if isinstance(producer, Producer):
                for item, ticket in zip(producer.generate(picked, trajectory_seed(seed, tickets[0])), tickets):
                    threading.Thread(target=finish, args=(item, ticket), daemon=True).start()
            else:
                for traj in producer.produce(picked, [trajectory_seed(seed, t) for t in tickets]):
                    _record(timeline, traj)
                    queue.put(traj)
    except Exception as err:  # handed to the trainer, which raises it
        fail(err)


class RayProducer(Worker):
    """A Producer inside a Ray actor (stage 6's Worker): concurrent `produce` calls share its engine."""

    def __init__(self, group: str, rank: int, size: int, model, tokenizer, config: RLConfig, make_env,
                 env_timeout: float, max_turns: int, threads: int = 1):
        super().__init__(group, rank, size, "cpu", threads)
        self.store = WeightStore()
        self.producer = Producer(f"ray {rank}/{size}", build_engine(config, model, tokenizer), self.store, make_env,
                                 config.sampling, env_timeout, max_turns)

    def produce(self, rows: list[dict], seeds: list[int], version: int, weights_ref: list) -> list[Trajectory]:
        """weights_ref: [ObjectRef] of the store's weights at `version` (in a list, so Ray does not fetch
        it unless this actor needs it)."""
        if version > self.store.version:
            with self.producer.lock:
                if version > self.store.version:
                    self.store.publish(ray.get(weights_ref[0]).items(), version)
        return self.producer.produce(rows, seeds)


class RayProducerClient:
    """The driver's handle on a RayProducer: `produce(rows, seeds)` as a local Producer's, weights from `store`."""

    _refs: dict = {}          # (id of the store, version) -> [ObjectRef]: one object-store copy per version
    _lock = threading.Lock()

    def __init__(self, actor, name: str, store: WeightStore):
        self.actor, self.name, self.store = actor, name, store

    def produce(self, rows: list[dict], seeds: list[int]) -> list[Trajectory]:
        version, weights = self.store.latest()
        key = (id(self.store), version)
        with self._lock:
            if key not in self._refs:
                self._refs.clear()
                self._refs[key] = [ray.put(weights)]
            ref = self._refs[key]
        return ray.get(self.actor.produce.remote(rows, seeds, version, ref))
