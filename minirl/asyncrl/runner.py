# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The asynchronous runner: producers fill a bounded queue, the trainer consumes it and publishes weights.

`train_async(config, acfg, model, tokenizer, rows)` starts `acfg.producers` producer threads
(or Ray actors with `acfg.ray`), then runs `config.run.steps` trainer steps. Each step takes
the next batch of B = prompts_per_step admissible trajectories from the queue, runs the
algorithm of notebook 01 on it (`make_experience`, `apply_correction`, `compute_advantages`,
`Actor.update`), publishes the weights as the next version and logs one record. Snapshots
of the weights (every `acfg.snapshot_every` steps) are evaluated after the run
(`evaluate_snapshots`), so evaluation never pauses the trainer while producers go on.
max_staleness = 0 is synchronous RL with concurrent sessions: the same code, the baseline.

Simplified: no checkpoints or resume (an async run's in-flight trajectories are not saved);
one trainer process; the trajectory's version is its oldest token's.
"""

__all__ = ["AsyncConfig", "AsyncResult", "batch_of", "train_on", "train_async",
           "evaluate_snapshots", "time_to_accuracy"]

import copy
import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import ray
import torch

from minirl.asyncrl.corrections import AREAL_WEIGHTS, CORRECTIONS, apply_correction
from minirl.asyncrl.env import ArithmeticToolEnv, Latency
from minirl.asyncrl.producer import Producer, RayProducer, RayProducerClient, WeightStore, producer_loop
from minirl.asyncrl.queue import ExperienceQueue, StartGate, Trajectory
from minirl.asyncrl.timeline import Timeline
from minirl.config import RLConfig
from minirl.data import Batch
from minirl.train.run import build_engine, build_roles
from minirl.train.step import compute_advantages, make_experience
from minirl.utils.timing import StageTimer
from minirl.utils.validate import ConfigError, check_choice, check_float, check_int


@dataclass
class AsyncConfig:
    """What stage 7 adds to RLConfig: the staleness bound, the correction, producers and environment."""

    choices = {"correction": CORRECTIONS, "areal_weight": AREAL_WEIGHTS}      # for the chapter's flags

    max_staleness: int = 1             # eta: a trajectory may be at most this many versions behind the trainer
    correction: str = "none"           # none (LlamaRL), areal (decoupled objective), tis (truncated IS, notebook 02)
    areal_weight: str = "clip"         # areal's behaviour weight: clip to [0.8, 1.2] (the source) or cap (AReaL's code)
    producers: int = 4                 # producer threads (or slots on the Ray actors)
    prompts_per_call: int = 4          # prompts a producer samples in one engine call (their groups are queued apart)
    queue_capacity: int | None = None  # trajectories the queue holds; None: (max_staleness + 1) * prompts_per_step
    env_latency: float = 0.01          # the calculator tool's median latency, seconds (lognormal)
    env_latency_sigma: float = 1.5     # the lognormal's sigma: the tail's weight (0: every call takes the median)
    env_timeout: float = 5.0           # seconds a session may take before it is scored 0 as hung
    max_turns: int = 1                 # 1: one answer per episode; more: the environment asks again when wrong
    in_flight: bool = False            # producers pick up new weights between decoding steps
    ray: bool = False                  # producers are Ray actors (needs a running Ray cluster: ray.init)
    ray_actors: int = 2                # Ray actors sharing the producer slots
    snapshot_every: int = 10           # weights kept for the held-out evaluation every N steps (and at the end)

    def __post_init__(self):
        check_int("max_staleness", self.max_staleness, low=0)
        check_choice("correction", self.correction, CORRECTIONS)
        check_choice("areal_weight", self.areal_weight, AREAL_WEIGHTS)
        check_int("producers", self.producers, low=1)
        check_int("prompts_per_call", self.prompts_per_call, low=1)
        if self.queue_capacity is not None:
            check_int("queue_capacity", self.queue_capacity, low=1)
        Latency(self.env_latency, self.env_latency_sigma)
        check_float("env_timeout", self.env_timeout, low=0.0, low_open=True)
        check_int("max_turns", self.max_turns, low=1)
        check_int("ray_actors", self.ray_actors, low=1)
        check_int("snapshot_every", self.snapshot_every, low=1)

    def capacity(self, batch_size: int) -> int:
        return self.queue_capacity if self.queue_capacity is not None else (self.max_staleness + 1) * batch_size

    def make_env(self):
        """A picklable factory of fresh environments (one per session)."""
        return partial(ArithmeticToolEnv, Latency(self.env_latency, self.env_latency_sigma), self.max_turns)


@dataclass
class AsyncResult:
    """A run's records (one per trainer step), weight snapshots, timeline and the producers' counters."""

    records: list[dict]
    snapshots: list[tuple[int, float, int, dict]]   # (step, wall seconds, completions trained on, weights)
    timeline: Timeline
    wall: float                                     # seconds from the producers' start to the last publish
    switches: int = 0                               # in-flight weight loads in the middle of a sequence
    accuracy: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """trajectories_per_second, trainer_idle_share, max_staleness_seen, drops, env failures, ..."""
        recs = self.records
        waited = sum(r["time/wait"] for r in recs)
        out = {"steps": len(recs), "seconds": self.wall,
               "trajectories": sum(r["trajectories"] for r in recs),
               "trajectories_per_second": sum(r["trajectories"] for r in recs) / max(self.wall, 1e-9),
               "trainer_idle_share": waited / max(self.wall, 1e-9),
               "max_staleness_seen": max((r["staleness/max"] for r in recs), default=0),
               "mean_staleness": sum(r["staleness/mean"] for r in recs) / max(len(recs), 1),
               "dropped": recs[-1]["queue/dropped"] if recs else 0,
               "env_failures": sum(r["env/failures"] for r in recs),
               "env_timeouts": sum(r["env/timeouts"] for r in recs),
               "mixed_version_sequences": sum(r["tokens/mixed_versions"] for r in recs),
               "queue_depth_mean": sum(r["queue/depth"] for r in recs) / max(len(recs), 1)}
        if self.accuracy:
            out |= {"accuracy_before": self.accuracy[0]["accuracy"], "accuracy_after": self.accuracy[-1]["accuracy"]}
        return out


def batch_of(trajectories: list[Trajectory]):
    """(rollout, rewards) of a batch: the trajectories' rows one after another, version = the oldest."""
    oldest = min(t.version for t in trajectories)
    rollout = Batch.concat([dataclasses.replace(t.rollout, version=oldest) for t in trajectories])
    return rollout, torch.cat([t.rewards for t in trajectories])                       # rewards [N]


def train_on(roles, trajectories: list[Trajectory], config: RLConfig, acfg: AsyncConfig) -> dict:
    """Notebook 01's algorithm on one batch from the queue; the record's metrics (without the sync)."""
    timer = StageTimer()
    rollout, rewards = batch_of(trajectories)
    with timer("reference"):
        exp = make_experience(rollout, rewards, roles, config.algorithm)
        exp = apply_correction(exp, acfg.correction, roles.actor, config.algorithm, acfg.areal_weight)
    with timer("advantages"):
        exp = compute_advantages(exp, config.algorithm)
    with timer("update"):
        metrics = roles.actor.update(exp)
    if roles.critic is not None:
        with timer("update_critic"):
            metrics |= roles.critic.update(exp)
    behind = [roles.version - t.version for t in trajectories]
    mask = rollout.completion_mask.bool()
    tv = rollout.token_versions.masked_fill(~mask, -1)
    mixed = ((tv.max(1).values != rollout.token_versions.masked_fill(~mask, 2**62).min(1).values)
             & mask.any(1)).sum().item()
    if exp.is_weights is not None:
        metrics["correction/weight_mean"] = exp.is_weights[mask].mean().item()
    lengths = rollout.completion_mask.float().sum(1)                                    # [N]
    return metrics | timer.times | {
        "generated_version": rollout.version, "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
        "completion_length": lengths.mean().item(), "completion_length_max": lengths.max().item(),
        "tokens/prompt": int(rollout.prompt_mask.sum()), "tokens/completion": int(lengths.sum()),
        "trajectories": len(rewards),
        "staleness/max": max(behind), "staleness/mean": sum(behind) / len(behind), "tokens/mixed_versions": mixed,
        "env/failures": sum(t.env_failures for t in trajectories),
        "env/timeouts": sum(t.env_timeouts for t in trajectories),
        "env/errors": [e for t in trajectories for e in t.env_errors][:2]}


def _start_producers(config, acfg, model, tokenizer, store):
    """Local Producers (each its own engine), or clients of Ray actors; and the actors to kill after."""
    make_env = acfg.make_env()
    if not acfg.ray:
        return [Producer(f"producer {i}", build_engine(config, model, tokenizer), store, make_env, config.sampling,
                         acfg.env_timeout, acfg.max_turns, acfg.in_flight) for i in range(acfg.producers)], []
    if not ray.is_initialized():
        raise RuntimeError("AsyncConfig.ray=True needs a Ray cluster: call ray.init(num_cpus=2) (or "
                           "minirl.controller.resource_pool.connect) first")
    if acfg.in_flight:
        raise ConfigError("in_flight", True, "in-flight updates run in local producer threads only; "
                          "drop --in-flight with --ray")
    slots = math.ceil(acfg.producers / acfg.ray_actors)
    remote = ray.remote(RayProducer)
    actors = [remote.options(num_cpus=0.5, max_concurrency=slots).remote(
        "rollout", r, acfg.ray_actors, model, tokenizer, config, make_env, acfg.env_timeout, acfg.max_turns)
        for r in range(acfg.ray_actors)]
    ray.get([a.ping.remote() for a in actors])                   # started (a failure is named here)
    return [RayProducerClient(actors[i % len(actors)], f"ray {i % len(actors)} slot {i // len(actors)}", store)
            for i in range(acfg.producers)], actors


def train_async(config: RLConfig, acfg: AsyncConfig, model, tokenizer, rows: list[dict], on_step=None,
                batch_timeout: float = 300.0) -> AsyncResult:
    """config.run.steps trainer steps fed by producers; trains `model` in place. See the module docstring.

    on_step(record): called after every step (a logger, a progress line). batch_timeout:
    seconds the trainer waits for one batch before it gives up (TimeoutError).
    """
    B, eta = config.run.prompts_per_step, acfg.max_staleness
    if not rows:
        raise ValueError("train_async: rows is empty; pass dataset rows like {'prompt': '27+35=', 'answer': 62}")
    roles = build_roles(config, model)
    store = WeightStore()
    store.publish(roles.actor.named_weights(), 0)
    gate = StartGate(B, eta)
    queue = ExperienceQueue(acfg.capacity(B), B, eta, gate)
    timeline, errors = Timeline(), []
    producers, actors = _start_producers(config, acfg, model, tokenizer, store)
    threads = [threading.Thread(target=producer_loop, daemon=True, name=f"producer-{i}",
                                args=(p, rows, config.run.seed, gate, queue, timeline, errors,
                                      acfg.prompts_per_call))
               for i, p in enumerate(producers)]
    start = time.perf_counter()
    snapshots = [(0, 0.0, 0, {k: v.detach().clone() for k, v in roles.actor.named_weights()})]
    records, samples = [], 0
    try:
        for t in threads:
            t.start()
        for step in range(1, config.run.steps + 1):
            waited = time.perf_counter()
            try:
                batch = queue.get_batch(timeout=batch_timeout)
            except RuntimeError:
                if errors:
                    raise errors[0]
                raise
            began = time.perf_counter()
            timeline.add("trainer", "wait", waited, began)
            record = train_on(roles, batch, config, acfg)
            publish = time.perf_counter()
            sync_bytes = store.publish(roles.actor.named_weights(), roles.version + 1)
            roles.version += 1
            queue.advance(roles.version)
            gate.advance(roles.version)
            end = time.perf_counter()
            timeline.add("trainer", "train", began, end)
            samples += record["trajectories"]
            record |= {"step": step, "version": roles.version, "time/wait": began - waited,
                       "time/sync": end - publish, "sync/bytes": sync_bytes, "time/step": end - waited,
                       "wall": end - start, "samples": samples} | queue.stats(end)
            records.append(record)
            if step % acfg.snapshot_every == 0 or step == config.run.steps:
                snapshots.append((step, end - start, samples,
                                  {k: v.detach().clone() for k, v in roles.actor.named_weights()}))
            if on_step is not None:
                on_step(record)
        wall = time.perf_counter() - start
    finally:
        gate.close()
        queue.close()
        for t in threads:
            t.join(timeout=acfg.env_timeout + 5.0)
        for actor in actors:
            ray.kill(actor)
    switches = sum(getattr(p, "switches", 0) for p in producers)
    return AsyncResult(records, snapshots, timeline, wall, switches)


def evaluate_snapshots(result: AsyncResult, model, eval_fn) -> list[dict]:
    """Held-out accuracy of every snapshot: [{"step", "wall", "samples", "accuracy"}], also kept in result."""
    probe = copy.deepcopy(model)
    result.accuracy = []
    for step, wall, samples, weights in result.snapshots:
        probe.load_state_dict(weights)
        result.accuracy.append({"step": step, "wall": wall, "samples": samples, "accuracy": eval_fn(probe)})
    return result.accuracy


def time_to_accuracy(accuracy: list[dict], target: float, window: int = 1) -> float:
    """Wall seconds at which held-out accuracy first reaches `target`; inf when it never does.

    accuracy: evaluate_snapshots' list. The first time after step 0 that the mean of `window`
    consecutive evaluations (ending there) is at or above `target`: window = 2 keeps one lucky
    evaluation (a 500-problem test moves by a few points) from counting as arrival.
    """
    trained = [a for a in accuracy if a["step"] > 0]
    for i in range(window - 1, len(trained)):
        if sum(a["accuracy"] for a in trained[i - window + 1:i + 1]) / window >= target:
            return trained[i]["wall"]
    return math.inf
