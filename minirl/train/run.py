# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""A run: build the roles, the engine and the sync; then step, and hand each record to callbacks.

`run(state, step_fn, callbacks, steps)` is the whole loop: it calls the step and passes each
record to the callbacks, which do everything else a run needs (evaluate, log JSON lines,
checkpoint, show progress, stop early). `train()` assembles the stage-1 run from a config
and a policy; later stages reuse `run` and the callbacks with their own step functions.

Simplified vs TRL's Trainer: gradients accumulate only over the update's micro-batches
(within one optimizer step), no learning-rate schedule, no distributed launcher (notebook 04
adds torchrun).
"""

__all__ = ["SAFE_ON_RESUME", "build_roles", "RunState", "Callback", "RunStopped", "run",
           "Evaluator", "ProgressBar", "NoSignalWarning", "no_signal_message", "StopAfter",
           "setup", "stage1_step", "train", "JSONLLogger", "Checkpointer", "check_resume_config",
           "LocalCheckpoints", "run_in_dir"]

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minirl.config import RLConfig
from minirl.models.critic import ValueModel
from minirl.models.policy import load_default_policy
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.registry import build_engine
from minirl.runtime.io import append_jsonl, atomic_write_json, write_jsonl
from minirl.runtime.model_loading import check_prompts
from minirl.runtime.rundir import RUN_FILE, RunDirError, open_run_dir
from minirl.runtime.validate import ConfigError
from minirl.sync.base import InProcessSync
from minirl.tasks.task import Task, arithmetic_task
from minirl.train.checkpoint import latest_checkpoint, remove_stale_temporaries, restore_checkpoint, save_checkpoint
from minirl.train.step import Roles, rl_step, sample_prompts

SAFE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "device")


def build_roles(config: RLConfig, model) -> Roles:
    """Actor (always), Reference (when beta > 0), Critic (PPO) for `model`, on config.run.device in
    config.policy_dtype (a no-op for the float32 policy on a CPU)."""
    dtype = getattr(torch, config.policy_dtype)
    model.to(device=config.run.device, dtype=dtype).eval()
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    critic = None
    if config.algorithm.algo == "ppo":
        critic = Critic(ValueModel.from_policy(model).to(dtype), config.algorithm, config.optimizer)
    return Roles(Actor(model, config.algorithm, config.optimizer, config.sampling), reference, critic)


@dataclass
class RunState:
    """Everything a run changes, and what a checkpoint restores."""

    config: RLConfig
    roles: Roles
    engine: object                          # a RolloutEngine
    sync: object                            # a WeightSync
    generator: torch.Generator              # draws the prompts and the sampling seeds
    rows: list[dict]                        # the dataset
    reward_funcs: list
    reward_weights: list[float] | None = None   # one per reward function (None: 1 each)
    step: int = 0
    metrics: list[dict] = field(default_factory=list)
    interrupted: bool = False

    def extra_state(self) -> dict:
        """What a later stage's state adds to a checkpoint beyond the roles and the generator ({} here;
        notebook 07 saves its queue)."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        """Restore what `extra_state` returned (nothing here)."""


class Callback:
    """Hooks of a run; each does one job. on_end runs last, also after an error (see state.interrupted)."""

    def on_start(self, state: RunState) -> None: ...

    def on_step(self, state: RunState, record: dict) -> None: ...

    def on_end(self, state: RunState) -> None: ...


class RunStopped(Exception):
    """Raised by StopAfter: the run stopped on purpose before its last step (a simulated crash)."""


def run(state: RunState, step_fn, callbacks: list[Callback], steps: int) -> list[dict]:
    """Call step_fn(state) until `steps` steps are done; each record goes through every callback in order."""
    for cb in callbacks:
        cb.on_start(state)
    try:
        while state.step < steps:
            start = time.perf_counter()
            record = step_fn(state)
            state.step += 1
            record = {"step": state.step, **record, "time/step": time.perf_counter() - start}
            state.metrics.append(record)
            for cb in callbacks:
                cb.on_step(state, record)
    except BaseException:
        state.interrupted = True
        raise
    finally:
        for cb in callbacks:
            cb.on_end(state)
    return state.metrics


class Evaluator(Callback):
    """Adds "accuracy" (eval_fn(model), 0..1) at step 0, every `every` steps and at the last step."""

    def __init__(self, eval_fn, every: int, last_step: int):
        self.eval_fn, self.every, self.last_step = eval_fn, every, last_step

    def evaluate(self, state: RunState, record: dict) -> None:
        start = time.perf_counter()
        record["accuracy"] = self.eval_fn(state.roles.actor.model)
        record["time/eval"] = time.perf_counter() - start

    def on_start(self, state):
        if self.every and state.step == 0:
            state.metrics.append({"step": 0, "version": state.roles.version})
            self.evaluate(state, state.metrics[-1])

    def on_step(self, state, record):
        if self.every and (state.step % self.every == 0 or state.step == self.last_step):
            self.evaluate(state, record)


class ProgressBar(Callback):
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.bar = total, desc, None

    def on_start(self, state):
        self.bar = tqdm(total=self.total, initial=state.step, desc=self.desc)

    def on_step(self, state, record):
        postfix = {"reward": f"{record['reward']:.2f}"} | ({"acc": f"{record['accuracy']:.2f}"}
                                                           if "accuracy" in record else {})
        self.bar.set_postfix(postfix)
        self.bar.update(1)

    def on_end(self, state):
        self.bar.close()


class NoSignalWarning(Callback):
    """Says once, on stderr, when none of the first `steps` steps had a group with different rewards: the
    GRPO advantages were all 0, so nothing could be learned. Names the likely cause from the mean rewards."""

    def __init__(self, steps: int = 3):
        self.steps, self.seen, self.done = steps, [], False

    def on_step(self, state, record):
        if self.done or "frac_reward_zero_std" not in record:
            return
        self.seen.append(record)
        if record["frac_reward_zero_std"] < 1:
            self.done = True
        elif len(self.seen) >= self.steps:
            self.done = True
            print(no_signal_message(self.seen), file=sys.stderr, flush=True)


def no_signal_message(records: list[dict]) -> str:
    """The warning of `NoSignalWarning`: what happened in `records` and what to check."""
    means = {k.removeprefix("rewards/"): sum(r[k] for r in records) / len(records)
             for k in records[-1] if k.startswith("rewards/")}
    reward = sum(r["reward"] for r in records) / len(records)
    if all(v == 0 for v in means.values()):
        why = ("every completion scored 0: check that the policy's completions can match the reward's format "
               "(the math reward wants a final '#### N' or \\boxed{N}; a base model may need a chat or few-shot "
               "prompt), that the reward reads the right dataset column, or warm-start the policy first")
    else:
        why = ("every completion of a prompt scored the same (all right or all wrong): use prompts nearer the "
               "policy's skill, more num_generations, a higher temperature, or a graded reward")
    return (f"warning: no learning signal in the first {len(records)} steps: in every group all completions had "
            f"equal rewards (frac_reward_zero_std = 1), so every advantage was 0 (mean reward {reward:.3g}; "
            + ", ".join(f"{k} {v:.3g}" for k, v in means.items()) + f"). {why[0].upper()}{why[1:]}.")


class StopAfter(Callback):
    """Stop right after step k, as a crash would (no final save): raises RunStopped."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, state, record):
        if state.step >= self.step:
            raise RunStopped(f"stopped after step {state.step} (stop_after={self.step})")


def setup(config: RLConfig, model, tokenizer, rows: list[dict], reward_funcs: list,
          reward_weights: list[float] | None = None) -> RunState:
    """The state of a fresh run: roles, an engine holding version 0, an in-process sync, the generator."""
    roles = build_roles(config, model)
    return RunState(config, roles, build_engine(config, model, tokenizer), InProcessSync(),
                    torch.Generator().manual_seed(config.run.seed), rows, reward_funcs, reward_weights)


def stage1_step(state: RunState) -> dict:
    """Stage 1's step: draw this step's prompts, then `rl_step`."""
    rows = sample_prompts(state.rows, state.config.run.prompts_per_step, state.generator)
    return rl_step(state.roles, state.engine, state.sync, rows, state.reward_funcs, state.config, state.generator,
                   reward_weights=state.reward_weights)


def train(config: RLConfig, model=None, tokenizer=None, task: Task | None = None, *, out_dir=None,
          resume: bool = False, overwrite: bool = False, progress: bool = True, reward_funcs=None,
          reward_weights=None, dataset=None, eval_fn=None, stop_after: int | None = None,
          extra_callbacks: tuple = (), run_info: dict | None = None) -> list[dict]:
    """The stage-1 run: `config.run.steps` steps of `rl_step`; returns one record per step (and per evaluation).

    model/tokenizer: default the embedded warm-started policy. task: a `minirl.tasks.task.Task`
    (its training rows, reward functions and weights, and its held-out evaluation); default the
    embedded arithmetic task (`arithmetic_task()`). dataset, reward_funcs (with reward_weights)
    and eval_fn(model) -> 0..1 override the task's. With out_dir: run.json, metrics.jsonl,
    checkpoints/ and final/ there (the directory must be new, or resume=True continues its run
    from the newest intact checkpoint, or overwrite=True replaces it). stop_after=k raises
    RunStopped after step k. extra_callbacks run after the built-in ones (evaluator, logger,
    checkpointer, progress bar, the no-signal warning). run_info: more facts for run.json besides
    the settings (a script records the model's name).
    """
    if (model is None) != (tokenizer is None):
        raise ValueError("train: pass both model and tokenizer, or neither (the embedded policy)")
    if model is None:
        model, tokenizer, _ = load_default_policy(device=config.run.device, progress=progress)
    task = task or arithmetic_task()
    rows = task.train if dataset is None else list(dataset)
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    if "prompt" not in rows[0]:
        raise ValueError(f"dataset rows need a 'prompt' column; got columns {sorted(rows[0])}")
    check_prompts(tokenizer, [r["prompt"] for r in rows], getattr(model.config, "max_position_embeddings", None),
                  config.sampling.max_completion_length)     # at the door: unknown characters, too long
    if reward_funcs is None:
        reward_funcs, reward_weights = task.reward_funcs, task.reward_weights
    if not reward_funcs:
        raise ValueError("reward_funcs is empty: pass at least one f(prompts, completions, **columns)")
    eval_fn = eval_fn or task.eval_fn(tokenizer, task.max_new_tokens or config.sampling.max_completion_length)
    state = setup(config, model, tokenizer, rows, list(reward_funcs), reward_weights)
    return run_in_dir(state, stage1_step, tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite,
                      eval_fn=eval_fn, progress=progress, label="stage 1", extra_callbacks=extra_callbacks,
                      stop_after=stop_after, run_info=run_info)


class JSONLLogger(Callback):
    """metrics.jsonl: rewritten from the run's records at the start (a resume drops what came after
    its checkpoint), then one line appended per step."""

    def __init__(self, path):
        self.path = Path(path)

    def on_start(self, state):
        write_jsonl(self.path, state.metrics)

    def on_step(self, state, record):
        append_jsonl(self.path, record)


class Checkpointer(Callback):
    """A checkpoint every `every` steps (0: none during the run); at a normal end, a last checkpoint
    if the final step has none, and the final policy in Hugging Face format under `final/`."""

    def __init__(self, out_dir, every: int, keep: int, config: RLConfig, tokenizer):
        self.root, self.final = Path(out_dir) / "checkpoints", Path(out_dir) / "final"
        self.every, self.keep, self.config, self.tokenizer = every, keep, config, tokenizer
        self.saved_step = None

    def save(self, state):
        save_checkpoint(self.root, state, self.config, self.tokenizer, keep=self.keep)
        self.saved_step = state.step

    def on_start(self, state):
        remove_stale_temporaries(self.root)

    def on_step(self, state, record):
        if self.every and state.step % self.every == 0:
            self.save(state)

    def on_end(self, state):
        if state.interrupted:
            return
        if self.saved_step != state.step:
            self.save(state)
        state.roles.actor.model.save_pretrained(self.final)
        self.tokenizer.save_pretrained(self.final)


def check_resume_config(saved: dict, config: RLConfig) -> None:
    """Refuse to resume a run with settings that change what it computes (steps and bookkeeping may change)."""
    old, new = RLConfig.from_dict(saved).flat(), config.flat()
    changed = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if k not in SAFE_ON_RESUME and old[k] != new[k]]
    if changed:
        raise ConfigError(changed[0].split(":")[0], new[changed[0].split(":")[0]],
                          f"the checkpoint was made with other settings ({'; '.join(changed)}); resume with the "
                          f"run's own settings (only {', '.join(SAFE_ON_RESUME)} may change), or start a new run")


class LocalCheckpoints:
    """One process's checkpoints for `run_in_dir`: `callback()` saves them during the run, `restore(state)`
    loads the newest intact one (RunDirError if none). Stage 4's sharded checkpoints have the same two methods."""

    def __init__(self, out_dir, config: RLConfig, tokenizer):
        self.out_dir, self.config, self.tokenizer = Path(out_dir), config, tokenizer

    def callback(self) -> Callback:
        run = self.config.run
        return Checkpointer(self.out_dir, run.checkpoint_every, run.keep_checkpoints, self.config, self.tokenizer)

    def restore(self, state: RunState) -> None:
        found = latest_checkpoint(self.out_dir / "checkpoints")
        if found is None:
            raise RunDirError(f"resume: {self.out_dir} holds no intact checkpoint (the run stopped before its "
                              "first one); start it again with overwrite=True (--overwrite)")
        _, training, weights = found
        check_resume_config(training["config"], state.config)
        restore_checkpoint(training, weights, state)


def run_in_dir(state: RunState, step_fn, tokenizer, *, out_dir=None, resume: bool = False, overwrite: bool = False,
               eval_fn=None, progress: bool = True, label: str = "", extra_callbacks: tuple = (),
               stop_after: int | None = None, run_info: dict | None = None, checkpoints=None, main: bool = True,
               agree=None, first_callbacks: tuple = ()) -> list[dict]:
    """`run` with the jobs around it: the run directory, resume, evaluation, log, checkpoints, progress.

    One copy for every orchestration that runs `step_fn` on a RunState (stage 1's `train`, stage 6's
    Driver, every rank of stage 4 and 7's trainer): where the step runs changes, what a run directory
    holds does not. checkpoints: `LocalCheckpoints` by default. In a job of several processes each
    calls it, main=False on all but the one that writes run.json and metrics.jsonl and shows the bar
    (all take part in checkpoints); agree(what, fn) runs the opening and the restore so that a
    failure on one process stops every one (`minirl.parallel.launch.agree`). first_callbacks run
    before the built-in ones (to add to a record before it is logged).
    """
    config = state.config
    together = agree or (lambda what, fn: fn())
    if resume and out_dir is None:
        raise ValueError("resume=True needs the out_dir of the run to continue")
    record = {"config": dataclasses.asdict(config), **(run_info or {})}
    run_dir = together("opening the run directory", lambda: None if out_dir is None or not main else
                       open_run_dir(out_dir, record, resume=resume, overwrite=overwrite))
    if out_dir is not None and checkpoints is None:
        checkpoints = LocalCheckpoints(out_dir, config, tokenizer)
    try:
        if resume:
            together("restoring the checkpoint", lambda: checkpoints.restore(state))
            if main:
                atomic_write_json(Path(out_dir) / RUN_FILE, (run_dir.record() or {}) | record)   # more steps, say
        callbacks = list(first_callbacks)
        if eval_fn:
            callbacks.append(Evaluator(eval_fn, config.run.eval_every, config.run.steps))
        if out_dir is not None:
            callbacks += [JSONLLogger(Path(out_dir) / "metrics.jsonl")] if main else []
            callbacks.append(checkpoints.callback())
        if progress and main:
            callbacks.append(ProgressBar(config.run.steps, f"{config.algorithm.algo} ({label})"))
        callbacks.append(NoSignalWarning())
        callbacks += list(extra_callbacks)
        if stop_after is not None:
            callbacks.append(StopAfter(stop_after))
        return run(state, step_fn, callbacks, config.run.steps)
    finally:
        if run_dir is not None:
            run_dir.close()
