"""Weight snapshots of an asynchronous run, evaluated after it: accuracy against wall time and samples.

`Snapshots` is a run callback (stage 1's `Callback`): it keeps a copy of the trainer's
weights at step 0, every `every` steps and at the last step, with the run's wall seconds
and completions trained on at that moment. Without a directory the copies stay in memory;
with one (a run directory's `snapshots/`) each is written there atomically, so a resumed run
keeps the earlier ones (those after the checkpoint it resumes from are deleted: the resumed
run makes its own). `evaluate_snapshots` measures each afterwards; `speedup_to_target` compares
a synchronous and an asynchronous run by their wall time to a target accuracy (`plateau`,
`time_to_stay`: the rule of the benchmark and of notebook 07).

Why after the run: evaluating in the trainer's thread would pause the trainer while the
producers go on, and put the evaluation's seconds into the wall time that asynchrony is
meant to shorten.
"""

import copy
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minirl.runtime.io import writing
from minirl.train.run import Callback


@dataclass
class Snapshot:
    """The weights after `step` trainer steps (in memory, or in the file at `path`)."""

    step: int
    wall: float                   # the run's wall seconds then
    samples: int                  # completions trained on by then
    weights: dict | None = None
    path: Path | None = None

    def load(self) -> dict:
        return self.weights if self.weights is not None else load_file(self.path)


class Snapshots(Callback):
    """Snapshots at step 0, every `every` steps and at `last_step`, in memory or under `directory`."""

    def __init__(self, every: int, last_step: int, directory=None):
        self.every, self.last_step = every, last_step
        self.directory = None if directory is None else Path(directory)
        self.kept: list[Snapshot] = []

    def take(self, state, wall: float, samples: int) -> None:
        weights = {k: v.detach().clone().cpu().contiguous() for k, v in state.roles.actor.named_weights()}
        snap = Snapshot(state.step, wall, samples)
        if self.directory is None:
            snap.weights = weights
        else:
            snap.path = self.directory / f"step-{state.step:06d}.safetensors"
            tmp = snap.path.with_suffix(".tmp")
            with writing(snap.path, tmp):                          # a full disk: tmp deleted, snap.path named
                save_file(weights, tmp, metadata={"step": str(state.step), "wall": repr(wall),
                                                  "samples": str(samples)})
                os.replace(tmp, snap.path)                         # atomic: a crash never leaves half a snapshot
        self.kept.append(snap)

    def on_start(self, state):
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(self.directory.glob("step-*")):
                step = -1
                if path.suffix == ".safetensors":
                    with safe_open(path, "pt") as f:
                        meta = f.metadata()
                    step = int(meta["step"])
                if step < 0 or step > state.step or state.step == 0:
                    path.unlink()                    # half-written, after the checkpoint, or of a replaced run
                else:
                    self.kept.append(Snapshot(step, float(meta["wall"]), int(meta["samples"]), path=path))
        due = state.step == 0 or state.step % self.every == 0
        if due and all(s.step != state.step for s in self.kept):
            self.take(state, state.wall(), state.samples)

    def on_step(self, state, record):
        if state.step % self.every == 0 or state.step == self.last_step:
            self.take(state, record["wall"], record["samples"])


def evaluate_snapshots(result, model, eval_fn, out_dir=None, log_completions: int = 0) -> list[dict]:
    """Held-out accuracy of every snapshot of `result` (an AsyncResult): [{"step", "wall", "samples",
    "accuracy", and each reward's mean when eval_fn keeps them: "eval/reward", "eval/rewards/<name>/mean"}],
    also kept in result.accuracy. model: one of the run's architecture (copied, not changed). With out_dir and
    log_completions N, N held-out rows of each evaluation go to out_dir/completions.jsonl (and on screen)."""
    from minirl.runtime.completion_log import eval_metrics, log_eval  # noqa: PLC0415

    probe = copy.deepcopy(model)
    result.accuracy = []
    for snap in sorted(result.snapshots, key=lambda s: s.step):
        probe.load_state_dict(snap.load())
        result.accuracy.append({"step": snap.step, "wall": snap.wall, "samples": snap.samples,
                                "accuracy": eval_fn(probe)} | eval_metrics(eval_fn))
        log_eval(out_dir, snap.step, eval_fn, log_completions)
    return result.accuracy


def plateau(accuracy: list[dict], last: int = 3) -> float:
    """The median held-out accuracy of a run's last `last` evaluations after step 0: where it settled.

    accuracy: evaluate_snapshots' list. Not the last evaluation alone, which may be a lucky blip
    (a 500-problem test moves by a few points from one snapshot to the next).
    """
    trained = [a["accuracy"] for a in accuracy if a["step"] > 0]
    return statistics.median(trained[-last:])


def time_to_stay(accuracy: list[dict], target: float) -> float:
    """Wall seconds of the first evaluation after step 0 from which held-out accuracy stays at or above
    `target` to the end of the run, the final evaluation included; inf when the final one is below it.

    A run that touches the target and falls back has not reached it (until it comes back for good).
    """
    reached = math.inf
    for a in reversed([a for a in accuracy if a["step"] > 0]):
        if a["accuracy"] < target:
            break
        reached = a["wall"]
    return reached


def speedup_to_target(sync: list[dict], run: list[dict], last: int = 3, tolerance: float = 0.03) -> dict:
    """Wall time to a target accuracy, a synchronous run against one asynchronous setting declared before
    either ran (the rule of benchmarks/async_vs_sync.py and notebook 07; never the best of several).

    sync, run: their evaluate_snapshots lists. The target is sync's plateau (`last` evaluations) minus
    `tolerance`; each run's time is `time_to_stay`. speedup = sync's time / the run's: 0.0 when the run
    never stays at the target, nan when sync itself does not (the comparison is then not measured).
    """
    target = plateau(sync, last) - tolerance
    sync_s, run_s = time_to_stay(sync, target), time_to_stay(run, target)
    speedup = math.nan if not math.isfinite(sync_s) else sync_s / run_s if math.isfinite(run_s) else 0.0
    return {"target": target, "sync_s": sync_s, "run_s": run_s, "speedup": speedup}
