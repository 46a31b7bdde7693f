"""The asynchronous run's plumbing: producer threads, the run state, checkpoints and resume, `train_async`.

Notebook 07 builds the pieces that teach (the gate and the bounded queue, the corrections, the
environments, the producers with in-flight updates, `trainer_step`); this module puts them
under stage 1's run loop (`minirl.train.run.run_in_dir`), so that an asynchronous run has what
every stage's run has: the run directory, the callbacks (evaluator, metrics.jsonl written as
steps happen, atomic checkpoints, progress bar), stops and `resume`.

- `producer_loop` is what a producer thread runs until the gate closes: tickets -> generation
  (`generate_call`: one engine call of the Producer's `sample`) -> environment sessions
  (`score_group`: one isolated session per completion, the scored Trajectory) -> queue. A ticket
  fixes its trajectory's prompt (`pick_row`) and seed (`trajectory_seed`), so a ticket handed out
  again after a resume samples the same way. A producer's failure is handed to the trainer,
  which raises it (`AsyncState.take_batch`).
- `Producers` is the run callback that starts the producer threads (or Ray actors with
  `AsyncConfig.ray`, `runtime/async_ray.py`) when the run starts, after a resume has restored
  the queue, and stops them when it ends.
- `Correction` wraps notebook 07's `apply_correction` as the `correct` step of notebook 01's
  `learn`, keeping the batch's mean token weight for the record.
- `AsyncState` is stage 1's RunState, whose engine is the weight store, plus the queue, the
  gate and the correction; `finish_step` adds stage 7's numbers to a step's record; its
  checkpoints add the queue's `state_dict` (`runtime/async_bookkeeping.py` says what is saved
  and what is sampled again). At max_staleness = 0 with single-turn sessions a resumed run
  repeats the uninterrupted one exactly; above it, which trajectory lands in which batch
  depends on timing, so a resumed run continues from the checkpoint's state exactly, not along
  the crashed run's future. A resume with other AsyncConfig settings is refused
  (`check_resume_async`).
- `train_async(config, acfg, model, tokenizer, rows)` builds the state and runs notebook 07's
  `trainer_step` under `run_in_dir`; `AsyncResult` holds the records, the weight snapshots
  (`runtime/async_snapshots.py`, evaluated after the run so that evaluation never pauses the
  trainer) and the timeline. An `eval_fn` runs stage 1's Evaluator inline instead: the trainer
  pauses for it while the producers fill the queue up to the gate's bound.

Simplified: one trainer process; a resumed run's timeline starts at the resume.
"""

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from minirl.asyncrl.corrections import apply_correction
from minirl.asyncrl.env import run_sessions
from minirl.asyncrl.producer import Producer
from minirl.asyncrl.queue import ExperienceQueue, StartGate, Trajectory
from minirl.asyncrl.runner import trainer_step
from minirl.config import AlgorithmConfig, RLConfig
from minirl.data import Experience, Rollout
from minirl.rollout.registry import build_engine
from minirl.runtime.async_bookkeeping import Timeline, WeightStore
from minirl.runtime.async_config import AREAL_WEIGHTS, AsyncConfig, check_async, check_correction, check_resume_async
from minirl.runtime.async_snapshots import Snapshot, Snapshots
from minirl.runtime.callbacks import run_in_dir
from minirl.runtime.reward_extras import TrainerClock, join_dumps, session_extras, takes_extras
from minirl.runtime.rundir import RUN_FILE, read_run_record
from minirl.runtime.validate import check_choice
from minirl.sync.base import InProcessSync
from minirl.train.run import Callback, RunState, build_roles


def trajectory_seed(seed: int, ticket: int) -> int:
    """The sampling seed of the ticket-th trajectory of a run: the same ticket samples the same way."""
    return (seed * 1_000_003 + ticket * 7_919) % 2**62


def pick_row(rows: list[dict], seed: int, ticket: int) -> dict:
    return rows[random.Random(trajectory_seed(seed, ticket)).randrange(len(rows))]


def generate_call(producer: Producer, rows: list[dict], seed: int) -> list[tuple[dict, Rollout, float, float]]:
    """Sample G completions of each row's prompt in one engine call of `producer` (its `sample`: in-flight
    updates included); returns (row, its G-row Rollout, started, generated) per row."""
    started = time.perf_counter()
    generator = torch.Generator(device=producer.engine.device).manual_seed(seed)
    with producer.lock:
        parts = producer.sample([r["prompt"] for r in rows], generator).split(len(rows))   # one part per prompt
    generated = time.perf_counter()
    return [(row, part, started, generated) for row, part in zip(rows, parts, strict=True)]


def score_group(producer: Producer, row: dict, rollout: Rollout, seed: int, started: float, generated: float,
                ticket: int = -1, clock: TrainerClock | None = None) -> Trajectory:
    """Run one isolated environment session per completion of one prompt's group; the scored Trajectory.

    An environment that takes `reward_extras` (RewardEnv) gets TRL's for its completion: its ids, the
    trainer state (global_step: the newest version in the producer's store; the run's length from
    `clock`, when given) and a log of its own; the Trajectory keeps the logs joined in `logged`."""
    G = len(rollout.completions)
    make_env, logs = producer.make_env, None
    if takes_extras(make_env):
        state = None if clock is None else clock.state(max(0, producer.store.version))
        extras, logs = session_extras(rollout, state)
        make_env = [partial(producer.make_env, reward_extras=e) for e in extras]
    results = run_sessions(make_env, row, rollout.completions, producer.policy,
                           [seed + i for i in range(G)], producer.env_timeout, producer.max_turns)
    failed = [r for r in results if r.error is not None]
    names = dict.fromkeys(name for r in results for name in (r.scores or {}))
    scores = {name: torch.tensor([(r.scores or {}).get(name, 0.0) for r in results]) for name in names}   # [G]
    return Trajectory(rollout, torch.tensor([r.reward for r in results], dtype=torch.float32), row, producer.name,
                      started, generated, time.perf_counter(), env_failures=len(failed),
                      env_timeouts=sum(r.timed_out for r in failed), env_errors=tuple(r.error for r in failed[:2]),
                      ticket=ticket, scores=scores,
                      logged=join_dumps([log.dump() for log in logs], [1] * G) if logs else {})


def _record(timeline, traj: Trajectory) -> None:
    if timeline is not None:
        timeline.add(traj.producer, "generate", traj.started, traj.generated)
        timeline.add(traj.producer, "environment", traj.generated, traj.finished)


def producer_loop(producer, rows: list[dict], seed: int, gate: StartGate, queue: ExperienceQueue, timeline=None,
                  errors: list | None = None, prompts_per_call: int = 1, clock: TrainerClock | None = None) -> None:
    """What a producer thread runs until the gate closes: tickets -> generation -> sessions -> queue.

    A ticket fixes its trajectory's prompt (`pick_row`) and seed (`trajectory_seed`); one call
    of up to `prompts_per_call` tickets samples with its first ticket's seed. A local Producer
    scores each prompt's group in a thread of its own and queues it as soon as its own
    sessions end (a slow session delays only its group), and goes on sampling. A
    RayProducerClient's `produce` returns the groups of one remote call together. An
    exception (a broken engine, a FutureVersionError) is appended to `errors` and closes the
    queue, so the trainer stops with it instead of waiting forever. clock: the run's, for the
    reward functions' trainer_state (`score_group`).
    """
    def fail(err):
        if errors is not None:
            errors.append(err)
        queue.close()
        gate.close()

    def finish(item, seed_, ticket):
        try:
            traj = score_group(producer, *item[:2], seed_, *item[2:], ticket=ticket, clock=clock)
            _record(timeline, traj)
            queue.put(traj)
        except Exception as err:  # handed to the trainer, which raises it
            fail(err)

    try:
        while (tickets := gate.acquire(prompts_per_call)) is not None:
            picked = [pick_row(rows, seed, t) for t in tickets]
            seeds = [trajectory_seed(seed, t) for t in tickets]
            if isinstance(producer, Producer):
                for item, seed_, ticket in zip(generate_call(producer, picked, seeds[0]), seeds, tickets,
                                                  strict=True):
                    threading.Thread(target=finish, args=(item, seed_, ticket), daemon=True).start()
            else:
                for traj in producer.produce(picked, seeds, tickets, clock):
                    _record(timeline, traj)
                    queue.put(traj)
    except Exception as err:  # handed to the trainer, which raises it
        fail(err)


class Correction:
    """`apply_correction` with a run's settings, as the `correct` step of notebook 01's `learn`; keeps the
    mean weight of its last batch's tokens (`weight_mean`, None without weights) for the step's record."""

    def __init__(self, correction: str, actor, algorithm: AlgorithmConfig, areal_weight: str = "clip"):
        self.correction = check_correction(correction, algorithm)
        check_choice("areal_weight", areal_weight, AREAL_WEIGHTS)
        self.actor, self.algorithm, self.areal_weight = actor, algorithm, areal_weight
        self.weight_mean = None

    def __call__(self, exp: Experience) -> Experience:
        exp = apply_correction(exp, self.correction, self.actor, self.algorithm, self.areal_weight)
        mask = exp.rollout.completion_mask.bool()
        self.weight_mean = None if exp.is_weights is None else exp.is_weights[mask].mean().item()
        return exp


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
    last_batch: list = field(default_factory=list)   # the trajectories of the last step (runtime/completion_log)

    def wall(self, now: float | None = None) -> float:
        """Seconds of the run so far (from the producers' start, across resumes)."""
        if self.t0 is None:
            return self.wall_offset
        return self.wall_offset + (time.perf_counter() if now is None else now) - self.t0

    def take_batch(self) -> list[Trajectory]:
        """The queue's next batch (waiting up to batch_timeout); the error of a producer that failed and closed
        the queue, if one did."""
        try:
            self.last_batch = self.queue.get_batch(timeout=self.batch_timeout)
            return self.last_batch
        except RuntimeError:
            if self.errors:
                raise self.errors[0] from None
            raise

    def finish_step(self, record: dict, waited: float, began: float) -> dict:
        """The step's record with what stage 7 adds (the correction's mean weight, time/wait, wall, samples, the
        queue's stats), and the trainer's wait and train events on the timeline. waited: when the trainer began
        to wait for its batch; began: when it got it (perf_counter seconds)."""
        self.last = end = time.perf_counter()
        self.timeline.add("trainer", "wait", waited, began)
        self.timeline.add("trainer", "train", began, end)
        self.samples += record["trajectories"]
        if self.correct.weight_mean is not None:
            record["correction/weight_mean"] = self.correct.weight_mean
        return (record | {"time/wait": began - waited, "wall": self.wall(end), "samples": self.samples}
                | self.queue.stats(end))

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
        clock = TrainerClock.of(config, len(state.rows))           # the reward functions' trainer_state
        if acfg.ray:
            from minirl.runtime.async_ray import start_ray_producers  # noqa: PLC0415 (Ray only when asked)
            self.producers, self.actors = start_ray_producers(config, acfg, self.model, self.tokenizer, state.engine,
                                                              self.make_env)
        else:
            self.producers = [Producer(f"producer {i}", build_engine(config, self.model, self.tokenizer), state.engine,
                                       self.make_env, config.sampling, acfg.env_timeout, acfg.max_turns,
                                       acfg.in_flight) for i in range(acfg.producers)]
        self.threads = [threading.Thread(target=producer_loop, daemon=True, name=f"producer-{i}",
                                         args=(p, state.rows, config.run.seed, state.gate, state.queue, state.timeline,
                                               state.errors, acfg.prompts_per_call, clock))
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
            from minirl.runtime.async_ray import stop_ray_producers  # noqa: PLC0415
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
