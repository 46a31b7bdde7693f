"""The jobs around the loop of `minirl.train.run.run`: callbacks, and `run_in_dir`, the loop in a run directory.

Hand-written bookkeeping (the lessons call it, it teaches no RL). `run(state, step_fn, callbacks,
steps)` hands every step's record to callbacks, each of which does one job:
- `Evaluator`: held-out accuracy at step 0, every `eval_every` steps and at the last step;
- `ProgressBar`: a tqdm bar with the reward (and accuracy) of the last step;
- `NoSignalWarning`: says once when the first steps' groups all had equal rewards (every GRPO
  advantage 0: nothing to learn), and names the likely cause;
- `StopAfter`: stops right after step k, as a crash would (`RunStopped`), so resuming can be tried;
- `JSONLLogger`: metrics.jsonl, one line per step;
- `Checkpointer`: a checkpoint every `checkpoint_every` steps and the final policy (`minirl.runtime.checkpoint`);
- `SampleTap`, `CompletionLog` (`minirl.runtime.completion_log`): what each step generated and scored, its share
  cut at max_completion_length, and with `log_completions` a few rows of it in completions.jsonl and on screen.

`run_in_dir(state, step_fn, tokenizer, out_dir=..., resume=..., ...)` opens the run directory
(`minirl.runtime.rundir`: new, resumed or overwritten, locked), restores the newest intact
checkpoint when resuming (refusing settings that change what the run computes, `check_resume_config`),
puts these callbacks around `run` and closes the directory. Stage 1's `train`, stage 4's ranks, stage
6's driver and stage 7's trainer all call it: where the step runs changes, what a run directory holds
does not.
"""

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minirl.config import RLConfig
from minirl.runtime.checkpoint import (
    TMP_PREFIX,
    latest_checkpoint,
    remove_stale_temporaries,
    restore_checkpoint,
    save_checkpoint,
)
from minirl.runtime.completion_log import FILE as COMPLETIONS_FILE
from minirl.runtime.completion_log import CompletionLog, SampleTap, eval_metrics
from minirl.runtime.io import append_jsonl, atomic_write_json, temporary_beside, write_jsonl, writing
from minirl.runtime.rundir import RUN_FILE, RunDirError, open_run_dir
from minirl.runtime.validate import ConfigError
from minirl.train.run import Callback, RunState, RunStopped, run

SAFE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "device", "log_completions")


class Evaluator(Callback):
    """Adds "accuracy" (eval_fn(model), 0..1) at step 0, every `every` steps and at the last step, and each reward's
    held-out mean when eval_fn keeps them (`eval/reward`, `eval/rewards/<name>/mean`: a Task's evaluation does)."""

    def __init__(self, eval_fn, every: int, last_step: int):
        self.eval_fn, self.every, self.last_step = eval_fn, every, last_step

    def evaluate(self, state: RunState, record: dict) -> None:
        start = time.perf_counter()
        record["accuracy"] = self.eval_fn(state.roles.actor.model)
        record.update(eval_metrics(self.eval_fn))
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
    GRPO advantages were all 0, so nothing could be learned. Names the likely cause: completions cut at
    max_completion_length first, else what the mean rewards say."""

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
            print(no_signal_message(self.seen, state.config.sampling.max_completion_length), file=sys.stderr,
                  flush=True)


def truncation(records: list[dict], max_completion_length: int | None) -> str | None:
    """How the completions of `records` hit max_completion_length, when that is why they all scored alike: "N %
    hit the cap" (more than half did, by `completions/clipped_ratio`), or, for records without that share, "the
    longest hit the cap" (`completion_length_max`); else None."""
    if max_completion_length is None:
        return None
    shares = [r["completions/clipped_ratio"] for r in records if "completions/clipped_ratio" in r]
    if shares:
        share = sum(shares) / len(shares)
        return f"{100 * share:.0f} % hit the cap" if share > 0.5 else None
    if any(r.get("completion_length_max", 0) >= max_completion_length for r in records):
        return "the longest hit the cap"
    return None


def no_signal_message(records: list[dict], max_completion_length: int | None = None) -> str:
    """The warning of `NoSignalWarning`: what happened in `records` and what to check (truncation first)."""
    means = {k.removeprefix("rewards/"): sum(r[k] for r in records) / len(records)
             for k in records[-1] if k.startswith("rewards/")}
    reward = sum(r["reward"] for r in records) / len(records)
    cut = truncation(records, max_completion_length)
    if all(v == 0 for v in means.values()):
        why = ("every completion scored 0: check that the policy's completions can match the reward's format "
               "(the math reward wants a final '#### N' or \\boxed{N}; a base model may need a chat or few-shot "
               "prompt), that the reward reads the right dataset column, or warm-start the policy first")
    else:
        why = ("every completion of a prompt scored the same (all right or all wrong): use prompts nearer the "
               "policy's skill, more num_generations, a higher temperature, or a graded reward")
    return (f"warning: no learning signal in the first {len(records)} steps: in every group all completions had "
            f"equal rewards (frac_reward_zero_std = 1), so every advantage was 0 (mean reward {reward:.3g}; "
            + ", ".join(f"{k} {v:.3g}" for k, v in means.items()) + "). "
            + (f"Completions are cut at max_completion_length={max_completion_length} ({cut}): raise "
               "--max-completion-length first, and look at what the policy wrote (completions.jsonl in the run "
               f"directory); if they still score alike once whole: {why}." if cut else f"{why[0].upper()}{why[1:]}."))


class StopAfter(Callback):
    """Stop right after step k, as a crash would (no final save): raises RunStopped."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, state, record):
        if state.step >= self.step:
            raise RunStopped(f"stopped after step {state.step} (stop_after={self.step})")



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
        tmp = temporary_beside(self.final, TMP_PREFIX)
        with writing(self.final, tmp):                     # whole or not at all, as a checkpoint
            state.roles.actor.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(tmp, self.final)


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


def autocast_context(config):
    """A torch.autocast to config.autocast_dtype on config.run.device's type, or a no-op context when the run has
    no mixed precision (what `with_autocast` puts around a step and stage 6's workers around each call)."""
    if config.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(config.run.device).type, dtype=getattr(torch, config.autocast_dtype))


def with_autocast(step_fn, config):
    """`step_fn` run under torch.autocast to config.autocast_dtype (bf16 or fp16 mixed precision, as accelerate
    wraps TRL's forward passes), or `step_fn` itself when the run has no mixed precision. The weights, their
    gradients and AdamW's state stay in the policy's dtype (float32): only the products run in half precision."""
    if config.autocast_dtype is None:
        return step_fn

    def step(state):
        with autocast_context(config):
            return step_fn(state)
    return step


def run_in_dir(state: RunState, step_fn, tokenizer, *, out_dir=None, resume: bool = False, overwrite: bool = False,
               eval_fn=None, progress: bool = True, label: str = "", extra_callbacks: tuple = (),
               stop_after: int | None = None, run_info: dict | None = None, checkpoints=None, main: bool = True,
               agree=None, first_callbacks: tuple = (), autocast: bool = True) -> list[dict]:
    """`run` with the jobs around it: the run directory, resume, evaluation, log, checkpoints, progress.

    One copy for every orchestration that runs `step_fn` on a RunState (stage 1's `train`, stage 6's
    Driver, every rank of stage 4 and 7's trainer): where the step runs changes, what a run directory
    holds does not. checkpoints: `LocalCheckpoints` by default. In a job of several processes each
    calls it, main=False on all but the one that writes run.json and metrics.jsonl and shows the bar
    (all take part in checkpoints); agree(what, fn) runs the opening and the restore so that a
    failure on one process stops every one (`minirl.parallel.launch.agree`). first_callbacks run
    before the built-in ones (to add to a record before it is logged). autocast: run each step under
    the run's mixed precision (`with_autocast`); False where something else applies it (FSDP2's
    MixedPrecisionPolicy in stage 4, stage 6's workers).
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
        tap = SampleTap(getattr(tokenizer, "eos_token_id", None))   # first: the step's samples, before it is logged
        callbacks = [tap, *first_callbacks]
        if eval_fn:
            callbacks.append(Evaluator(eval_fn, config.run.eval_every, config.run.steps))
        if out_dir is not None:
            callbacks += [JSONLLogger(Path(out_dir) / "metrics.jsonl")] if main else []
            callbacks.append(checkpoints.callback())
        if progress and main:
            callbacks.append(ProgressBar(config.run.steps, f"{config.algorithm.algo} ({label})"))
        callbacks.append(NoSignalWarning())
        callbacks += list(extra_callbacks)
        if out_dir is not None and main and config.run.log_completions:
            callbacks.append(CompletionLog(Path(out_dir) / COMPLETIONS_FILE, config.run.log_completions, tap, eval_fn))
        if stop_after is not None:
            callbacks.append(StopAfter(stop_after))
        if main and config.policy_dtype != "float32":
            print(f"warning: --dtype {config.policy_dtype} trains {config.policy_dtype} weights and optimizer state: "
                  "at RL learning rates most updates round away; --mixed-precision bf16 keeps float32 weights "
                  "(as TRL trains)", file=sys.stderr)
        if main and config.resolved_mixed_precision == "fp16":
            print("warning: --mixed-precision fp16 autocasts without loss scaling here (TRL scales the loss with "
                  "accelerate's GradScaler): small gradients underflow to 0 in float16; prefer bf16 where the "
                  "device has it", file=sys.stderr)
        step_fn = tap.around(step_fn)
        return run(state, with_autocast(step_fn, config) if autocast else step_fn, callbacks, config.run.steps)
    finally:
        if run_dir is not None:
            run_dir.close()
