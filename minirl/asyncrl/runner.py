# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The asynchronous trainer: producers fill a bounded queue; stage 1's run loop runs the trainer's step on it.

`train_async(config, acfg, model, tokenizer, rows)` builds an `AsyncState` (stage 1's
RunState, whose engine is the weight store, plus the queue and its gate) and hands
`trainer_step` to stage 1's `run_in_dir`, so an asynchronous run has what every stage's run
has: the run directory, the callbacks (evaluator, metrics.jsonl written as steps happen,
atomic checkpoints, progress bar), and `resume`. The `Producers` callback starts
`acfg.producers` producer threads (or Ray actors with `acfg.ray`) when the run starts, after
a resume has restored the queue, and stops them when it ends.

`trainer_step` takes the next batch of B = prompts_per_step admissible trajectories from the
queue (waiting for it is the trainer's idle time), runs notebook 01's `learn` on it with the
run's correction as its `correct` step, pushes the weights into the store as the next
version with stage 1's `InProcessSync`, and moves the gate and the queue's admission to it.
max_staleness = 0 is synchronous RL with concurrent sessions: the same code, the baseline.

Checkpoints (`AsyncState.extra_state`) add the queue's `state_dict`: queued trajectories are
saved and re-queued on resume; in-flight ones are not saved, their tickets are handed out
again, and they are sampled anew from the same prompts and seeds with the checkpoint's
weights. At max_staleness = 0 with single-turn sessions a resumed run repeats the
uninterrupted one exactly; above it, which trajectory lands in which batch depends on
timing, so a resumed run continues from the checkpoint's state exactly, not along the
crashed run's future. A resume with other AsyncConfig settings is refused (only
snapshot_every may change).

Evaluation: weight snapshots (`asyncrl/snapshots.py`) are evaluated after the run, so
evaluation never pauses the trainer while producers go on and wall time to an accuracy
counts training only. An `eval_fn` runs stage 1's Evaluator inline instead: the trainer
pauses for it while the producers fill the queue up to the gate's bound.

Simplified: one trainer process; a trajectory's version is its oldest token's; a resumed
run's timeline starts at the resume.
"""

__all__ = ["check_async", "check_resume_async", "AsyncState", "setup_async", "batch_of",
           "batch_health", "trainer_step", "Producers", "OnStep", "AsyncResult", "train_async"]

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minirl.asyncrl.config import ASYNC_SAFE_ON_RESUME, AsyncConfig
from minirl.asyncrl.corrections import Correction, check_correction
from minirl.asyncrl.producer import Producer, WeightStore, producer_loop
from minirl.asyncrl.queue import ExperienceQueue, StartGate, Trajectory
from minirl.asyncrl.snapshots import Snapshot, Snapshots
from minirl.asyncrl.timeline import Timeline
from minirl.config import RLConfig
from minirl.data import Batch
from minirl.rollout.registry import build_engine
from minirl.runtime.rundir import RUN_FILE, read_run_record
from minirl.runtime.timing import StageTimer
from minirl.runtime.validate import ConfigError
from minirl.sync.base import InProcessSync
from minirl.train.run import Callback, RunState, build_roles, run_in_dir
from minirl.train.step import learn, sync_and_record


def check_async(config: RLConfig, acfg: AsyncConfig) -> None:
    """The checks across the two configs, before anything is built: ConfigError naming the setting."""
    check_correction(acfg.correction, config.algorithm)
    if acfg.capacity(config.run.prompts_per_step) < config.run.prompts_per_step:
        raise ConfigError("queue_capacity", acfg.queue_capacity, "the queue must hold at least one batch of "
                          f"--prompts-per-step {config.run.prompts_per_step} trajectories; raise it, or leave it "
                          "unset")
    if acfg.in_flight and acfg.ray:
        raise ConfigError("in_flight", True, "in-flight updates run in local producer threads only; "
                          "drop --in-flight with --ray")
    if acfg.in_flight and config.rollout.rollout_engine != "shared_prefix":
        raise ConfigError("in_flight", True, "in-flight updates run the shared-prefix engine's decoding loop; "
                          f"pass --rollout-engine shared_prefix (not {config.rollout.rollout_engine})")


def check_resume_async(saved: dict | None, acfg: AsyncConfig) -> None:
    """Refuse to resume with AsyncConfig settings that change what the run computes (ConfigError naming the first)."""
    now = dataclasses.asdict(acfg)
    if saved is None:
        raise ConfigError("resume", True, "the run directory holds no asynchronous run (its run.json has no "
                          "'async' settings); resume it with the script that started it")
    changed = [k for k in now if k not in ASYNC_SAFE_ON_RESUME and saved.get(k) != now[k]]
    if changed:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise ConfigError(changed[0], now[changed[0]], f"the run was started with other settings ({diffs}); resume "
                          f"with the run's own settings (only {', '.join(ASYNC_SAFE_ON_RESUME)} may change), or "
                          "start a new run")


@dataclass
class AsyncState(RunState):
    """Stage 1's RunState with what stage 7 adds. engine: the WeightStore (what the trainer's sync pushes
    into); sync: an InProcessSync; reward_funcs: none (the producers' environments score)."""

    acfg: AsyncConfig | None = None
    queue: ExperienceQueue | None = None
    gate: StartGate | None = None
    correct: Correction | None = None       # the `correct` step of notebook 01's `learn`
    timeline: Timeline = field(default_factory=Timeline)
    errors: list = field(default_factory=list)   # what the producer threads raised
    samples: int = 0                        # completions trained on so far
    wall_offset: float = 0.0                # wall seconds of the run before this process (a resume)
    t0: float | None = None                 # perf_counter when the producers started
    last: float | None = None               # perf_counter of the last publish
    batch_timeout: float = 300.0            # seconds the trainer waits for one batch

    def wall(self, now: float | None = None) -> float:
        """Seconds of the run so far (from the producers' start, across resumes)."""
        if self.t0 is None:
            return self.wall_offset
        return self.wall_offset + (time.perf_counter() if now is None else now) - self.t0

    def extra_state(self) -> dict:
        return {"async": dataclasses.asdict(self.acfg), "queue": self.queue.state_dict(), "samples": self.samples,
                "wall": self.wall()}

    def load_extra_state(self, extra: dict) -> None:
        check_resume_async(extra.get("async"), self.acfg)
        self.queue.load_state_dict(extra["queue"], self.roles.version)
        self.samples, self.wall_offset = extra["samples"], extra["wall"]


def setup_async(config: RLConfig, acfg: AsyncConfig, model, rows: list[dict],
                batch_timeout: float = 300.0) -> AsyncState:
    """The state of a fresh asynchronous run: roles, a store holding version 0, the gate and the queue."""
    B, eta = config.run.prompts_per_step, acfg.max_staleness
    roles = build_roles(config, model)
    store = WeightStore()
    store.publish(roles.actor.named_weights(), 0)
    gate = StartGate(B, eta)
    queue = ExperienceQueue(acfg.capacity(B), B, eta, gate)
    correct = Correction(acfg.correction, roles.actor, config.algorithm, acfg.areal_weight)
    return AsyncState(config, roles, store, InProcessSync(), torch.Generator().manual_seed(config.run.seed), rows, [],
                      acfg=acfg, queue=queue, gate=gate, correct=correct, batch_timeout=batch_timeout)


def batch_of(trajectories: list[Trajectory]):
    """(rollout, rewards) of a batch: the trajectories' rows in ticket order (so that the rows never depend on
    which session ended first), version = the oldest."""
    ordered = sorted(trajectories, key=lambda t: t.ticket)
    oldest = min(t.version for t in ordered)
    rollout = Batch.concat([dataclasses.replace(t.rollout, version=oldest) for t in ordered])
    return rollout, torch.cat([t.rewards for t in ordered])                            # rewards [N]


def batch_health(trajectories: list[Trajectory], rollout, trainer_version: int) -> dict:
    """The record's stage-7 numbers about a batch: completions, staleness, mixed-version sequences, env failures,
    and `rewards/<name>`, each reward function's unweighted mean over the batch (stage 1's names), when the
    environment kept them."""
    behind = [trainer_version - t.version for t in trajectories]
    names = dict.fromkeys(name for t in trajectories for name in t.scores)
    means = {f"rewards/{name}": torch.cat([t.scores.get(name, torch.zeros(len(t.rewards))) for t in trajectories])
             .double().mean().item() for name in names}
    mask = rollout.completion_mask.bool()
    tv = rollout.token_versions                                                         # [N, C]
    mixed = ((tv.masked_fill(~mask, -1).max(1).values != tv.masked_fill(~mask, 2**62).min(1).values)
             & mask.any(1)).sum().item()
    return {"trajectories": len(rollout), "staleness/max": max(behind), "staleness/mean": sum(behind) / len(behind),
            "tokens/mixed_versions": mixed, "env/failures": sum(t.env_failures for t in trajectories),
            "env/timeouts": sum(t.env_timeouts for t in trajectories),
            "env/errors": [e for t in trajectories for e in t.env_errors][:2]} | means


def trainer_step(state: AsyncState) -> dict:
    """One trainer step: the next admissible batch from the queue, notebook 01's `learn` on it, the weights
    published as the next version."""
    waited = time.perf_counter()
    try:
        trajectories = state.queue.get_batch(timeout=state.batch_timeout)
    except RuntimeError:
        if state.errors:
            raise state.errors[0] from None
        raise
    began = time.perf_counter()
    state.timeline.add("trainer", "wait", waited, began)
    roles, timer = state.roles, StageTimer()
    rollout, rewards = batch_of(trajectories)
    health = batch_health(trajectories, rollout, roles.version)
    metrics = learn(roles, rollout, rewards, state.config, timer=timer, correct=state.correct)
    if state.correct.weight_mean is not None:
        metrics["correction/weight_mean"] = state.correct.weight_mean
    record = sync_and_record(roles, state.engine, state.sync, rollout, rewards, metrics, timer)   # stage 1's tail
    state.queue.advance(roles.version)
    state.gate.advance(roles.version)
    state.last = end = time.perf_counter()
    state.timeline.add("trainer", "train", began, end)
    state.samples += len(rewards)
    return (record | health | {"time/wait": began - waited, "wall": state.wall(end), "samples": state.samples}
            | state.queue.stats(end))


class Producers(Callback):
    """Starts the producers when the run starts (a resume has restored the queue by then), stops them at its end."""

    def __init__(self, config: RLConfig, acfg: AsyncConfig, model, tokenizer, make_env=None):
        self.config, self.acfg, self.model, self.tokenizer = config, acfg, model, tokenizer
        self.make_env = make_env or acfg.make_env()
        self.producers, self.actors, self.threads = [], [], []

    @property
    def switches(self) -> int:
        """In-flight weight loads in the middle of a sequence, over the local producers."""
        return sum(getattr(p, "switches", 0) for p in self.producers)

    def on_start(self, state: AsyncState) -> None:
        config, acfg = self.config, self.acfg
        if acfg.ray:
            from minirl.asyncrl.ray_producer import start_ray_producers  # noqa: PLC0415 (Ray only when asked)
            self.producers, self.actors = start_ray_producers(config, acfg, self.model, self.tokenizer, state.engine,
                                                              self.make_env)
        else:
            self.producers = [Producer(f"producer {i}", build_engine(config, self.model, self.tokenizer), state.engine,
                                       self.make_env, config.sampling, acfg.env_timeout, acfg.max_turns,
                                       acfg.in_flight) for i in range(acfg.producers)]
        self.threads = [threading.Thread(target=producer_loop, daemon=True, name=f"producer-{i}",
                                         args=(p, state.rows, config.run.seed, state.gate, state.queue, state.timeline,
                                               state.errors, acfg.prompts_per_call))
                        for i, p in enumerate(self.producers)]
        state.t0 = time.perf_counter()
        for t in self.threads:
            t.start()

    def on_end(self, state: AsyncState) -> None:
        state.gate.close()
        state.queue.close()
        for t in self.threads:
            t.join(timeout=self.acfg.env_timeout + 5.0)
        if self.actors:
            from minirl.asyncrl.ray_producer import stop_ray_producers  # noqa: PLC0415
            stop_ray_producers(self.actors)


class OnStep(Callback):
    """Calls fn(record) after every step (a progress line, a plot)."""

    def __init__(self, fn):
        self.fn = fn

    def on_step(self, state, record):
        self.fn(record)


@dataclass
class AsyncResult:
    """A run's trainer records (one per step, a resumed run's earlier ones included), weight snapshots,
    timeline and the producers' counters."""

    records: list[dict]
    snapshots: list[Snapshot]
    timeline: Timeline
    wall: float                                     # seconds from the producers' start to the last publish
    ended: float                                    # perf_counter of the last publish (the timeline's clock)
    switches: int = 0                               # in-flight weight loads in the middle of a sequence
    accuracy: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """steps, seconds, trajectories_per_second, trainer_idle_share, max_staleness_seen, drops, env failures, ..."""
        recs = self.records
        waited = sum(r["time/wait"] for r in recs)
        out = {"steps": recs[-1]["step"] if recs else 0, "seconds": self.wall,
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


def train_async(config: RLConfig, acfg: AsyncConfig, model, tokenizer, rows: list[dict], *, out_dir=None,
                resume: bool = False, overwrite: bool = False, eval_fn=None, progress: bool = False, on_step=None,
                stop_after: int | None = None, run_info: dict | None = None, extra_callbacks: tuple = (),
                batch_timeout: float = 300.0, make_env=None) -> AsyncResult:
    """config.run.steps trainer steps fed by producers, under stage 1's `run_in_dir`; trains `model` in place.

    out_dir, resume, overwrite, progress, stop_after, run_info, extra_callbacks: as stage 1's
    `train` (run.json then also records the AsyncConfig; snapshots go to out_dir/snapshots/).
    eval_fn(model) -> accuracy: evaluate inline every config.run.eval_every steps (None: only
    the snapshots, evaluated after the run with `evaluate_snapshots`). on_step(record): called
    after every step. batch_timeout: seconds the trainer waits for one batch (TimeoutError).
    make_env: a picklable factory of environments (default `acfg.make_env()`, the embedded task's
    calculator tool); `partial(RewardEnv, task.reward_funcs, task.reward_weights)` trains any task.
    See the module docstring for what a checkpoint holds.
    """
    if not rows:
        raise ValueError("train_async: rows is empty; pass dataset rows like {'prompt': '27+35=', 'answer': 62}")
    check_async(config, acfg)
    if acfg.ray:
        import ray  # noqa: PLC0415 (Ray only when asked)
        if not ray.is_initialized():
            raise RuntimeError("AsyncConfig.ray=True needs a Ray cluster: call minirl.runtime.ray_start."
                               "connect() first (a local cluster of its own: ray.init(address='local'))")
    if resume and out_dir is not None and (Path(out_dir) / RUN_FILE).exists():
        check_resume_async(read_run_record(out_dir).get("async"), acfg)          # before anything is built
    state = setup_async(config, acfg, model, rows, batch_timeout)
    producers = Producers(config, acfg, model, tokenizer, make_env)
    snapshots = Snapshots(acfg.snapshot_every, config.run.steps,
                          None if out_dir is None else Path(out_dir) / "snapshots")
    callbacks = ([snapshots] + ([OnStep(on_step)] if on_step is not None else []) + list(extra_callbacks)
                 + [producers])                  # last: they start after every other callback's on_start
    run_in_dir(state, trainer_step, tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite, eval_fn=eval_fn,
               progress=progress, label="stage 7", extra_callbacks=tuple(callbacks), stop_after=stop_after,
               run_info={"async": dataclasses.asdict(acfg)} | (run_info or {}))
    ended = state.last if state.last is not None else time.perf_counter()
    return AsyncResult([r for r in state.metrics if "trajectories" in r], snapshots.kept, state.timeline,
                       state.wall(ended), ended, producers.switches)
