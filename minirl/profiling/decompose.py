# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""Where a run's time goes: stage shares per step and over the run, read from the run directory alone.

Every orchestration of minirl times its stages under the same names: each record of
`metrics.jsonl` holds `time/<stage>` seconds (generate, score, reference, advantages,
update, update_critic, sync) and `time/step`, the step's wall-clock time (notebook 01's
`rl_step` and `run`). This module reads nothing else, so a run of any stage (one process,
torchrun, Ray, asynchronous) is decomposed the same way:

- each stage belongs to a category (`CATEGORIES`): generation, reward, reference/values,
  update, sync, communication, waiting; what no timer covers is "other";
- a sub-timer `time/<stage>/<part>` is counted inside its stage: its seconds move out of the
  stage into the part's category (`time/update/all_reduce` -> communication, a part named
  `wait...` or `queue...` -> waiting, any other part stays in its stage's category); stage
  4's colocated engine times `sleep` inside generate and `wake` inside the sync (`NESTED`);
- when the top-level stages add up to more than the step's wall-clock time (stages that
  overlap, as in an asynchronous run), that step's shares are of the stages' sum, and the
  report says so.

Bad input is named: a directory without metrics (`NoMetricsError`), a damaged line in the
middle (`MetricsFileError`), two runs' records in one file (`MixedRunsError`). A last line
cut short by a crash, step records without `time/step`, and steps that ran under
torch.profiler (slower; `minirl.profiling.profiler`) are left out and listed in `partial`.

What later stages' run directories add: stage 4 (torchrun) writes rank 0's timers and
`time_by_rank`, every rank's (`rank_notes`: the ranks' collectives run inside update and
sync, untimed, and the report says so); stage 6 (Ray) times each stage on the driver, and
`timeline.json` holds what each worker ran (`minirl.profiling.timeline.split_calls` takes
the driver's time outside the workers' calls out of each stage as `<stage>/rpc`,
communication).

Simplified vs veRL's profiler: one wall-clock number per stage and step, not kernel
traces (torch.profiler gives those); a collective inside a stage is seen only if the stage
times it.
"""

__all__ = ["METRICS_FILE", "PROFILE_SUMMARY", "STEP_ORDER", "CATEGORIES", "CATEGORY_OF",
           "COMMUNICATION", "WAIT_PREFIXES", "NESTED", "NOT_STAGES", "OVERLAP", "RunDataError",
           "NoMetricsError", "MetricsFileError", "MixedRunsError", "parent_of", "category_of",
           "stage_shares", "own_times", "categorize", "Decomposition", "decompose",
           "rank_imbalance", "read_records", "profiled_steps", "rank_notes"]

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from minirl.profiling.timeline import read_timeline, split_calls

METRICS_FILE = "metrics.jsonl"
PROFILE_SUMMARY = "profile/summary.json"       # written by minirl.profiling.profiler.TorchProfiler
STEP_ORDER = ("generate", "score", "reference", "advantages", "update", "update_critic", "sync")   # rl_step's
CATEGORIES = ("generation", "reward", "reference/values", "update", "sync", "communication", "waiting", "other")
CATEGORY_OF = {"generate": "generation", "score": "reward", "reference": "reference/values",
               "advantages": "reference/values", "update": "update", "update_critic": "update", "sync": "sync"}
COMMUNICATION = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "comm", "collective",
                 "rpc")                         # rpc: a Ray call's time outside the worker (stage 6, `split_calls`)
WAIT_PREFIXES = ("wait", "queue")
NESTED = {"sleep": "generate", "wake": "sync"}  # stage 4 (rollout/colocated.py) times these inside their parents
NOT_STAGES = ("step", "eval")                   # time/step is the wall clock; time/eval runs between steps
OVERLAP = 1.02                                  # stages summing to more than 2 % over the wall clock overlap


class RunDataError(ValueError):
    """A run directory whose records cannot be decomposed; the message names the file and what to do."""


class NoMetricsError(RunDataError):
    """The directory holds no metrics.jsonl, or no step records in it."""


class MetricsFileError(RunDataError):
    """A line of metrics.jsonl that is not a record (not the last line: a damaged file)."""


class MixedRunsError(RunDataError):
    """The steps of metrics.jsonl do not increase: the records of more than one run are mixed."""


def parent_of(stage: str) -> str | None:
    """The stage a sub-timer is timed inside ("update" for "update/all_reduce"), or None for a top-level stage."""
    if "/" in stage:
        return stage.split("/", 1)[0]
    return NESTED.get(stage)


def category_of(stage: str) -> str:
    """The category of a stage name (CATEGORIES); "other" for a name no stage uses."""
    leaf = stage.rsplit("/", 1)[-1]
    if leaf.startswith(COMMUNICATION):
        return "communication"
    if leaf.startswith(WAIT_PREFIXES):
        return "waiting"
    if stage in CATEGORY_OF:
        return CATEGORY_OF[stage]
    parent = parent_of(stage)
    return category_of(parent) if parent is not None else "other"


def stage_shares(records: list[dict]) -> dict[str, float]:
    """Each stage's share (0-1) of a run's time: its `time/<stage>` seconds summed over the run / the total `time/step`.

    records: a run's records (as in metrics.jsonl). Only step records count: those with
    "time/step" (the step-0 evaluation record has none). Every other "time/<name>" key is a
    stage, except "time/eval" (an evaluation runs between steps, outside time/step). Shares
    are ratios of totals over the run, not means of per-step shares: a slow step weighs more.
    "other" is the part of the total that no stage timed: 1 - the sum of the stages' shares,
    or 0 if the stages add up to more. Returns {stage: share, ..., "other": share}; {} when
    no record has "time/step" or their total is 0. (Stages are assumed not to overlap:
    `decompose` takes sub-timers out of their parents before it calls this.)
    """
    steps = [r for r in records if "time/step" in r]
    total = sum(r["time/step"] for r in steps)
    if not steps or total <= 0:
        return {}
    seconds = {}
    for record in steps:
        for key, value in record.items():
            if key.startswith("time/") and key not in ("time/step", "time/eval"):
                seconds[key[5:]] = seconds.get(key[5:], 0.0) + value
    shares = {stage: s / total for stage, s in seconds.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def own_times(record: dict) -> tuple[dict[str, float], float, bool]:
    """(stage -> its own seconds, sub-timers taken out of their parents; the step's seconds; overlapped?).

    The step's seconds are its wall-clock `time/step`, or the top-level stages' sum when that
    is larger (overlapping stages); the own times then add up to it with "other".
    """
    times = {k[5:]: float(v) for k, v in record.items() if k.startswith("time/") and k[5:] not in NOT_STAGES}
    own, top = dict(times), 0.0
    for stage, seconds in times.items():
        parent = parent_of(stage)
        if parent in times:
            own[parent] -= seconds
        else:
            top += seconds
    own = {stage: max(seconds, 0.0) for stage, seconds in own.items()}   # a part timed a hair longer than its parent
    wall = float(record["time/step"])
    overlapped = top > wall * OVERLAP + 1e-4
    step = max(wall, top)
    return own | {"other": step - top}, step, overlapped


def categorize(shares: dict[str, float]) -> dict[str, float]:
    """Stage shares summed into CATEGORIES (every category present, in order)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for stage, share in shares.items():
        out["other" if stage == "other" else category_of(stage)] += share
    return out


@dataclass
class Decomposition:
    """A run's time by stage and by category, over the run and per step (shares are 0-1)."""

    run_dir: str
    steps: list[int]                        # the steps decomposed
    step_seconds: list[float]               # their seconds (wall clock, or the stages' sum where they overlap)
    per_step: list[dict[str, float]]        # per step: stage -> its own seconds, and "other"
    stage_shares: dict[str, float]          # stage -> share of the run (sub-timers as their own stages)
    shares: dict[str, float]                # category -> share of the run, CATEGORIES order
    step_shares: list[dict[str, float]]     # per step: category -> share of that step
    records: list[dict]                     # the step records decomposed (MFU and the rules read them)
    partial: list[str] = field(default_factory=list)    # what was left out or approximated, and why
    overlapped: int = 0                     # steps whose stages overlap
    workers: dict[str, float] = field(default_factory=dict)   # stage 6: Ray worker -> busy share of the steps' time

    @property
    def total_seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def bottleneck(self) -> str:
        """The category with the largest share of the run."""
        return max(self.shares, key=self.shares.get)

    def table(self) -> str:
        """The run's time by category and by stage, as text."""
        seconds = {s: sum(step.get(s, 0.0) for step in self.per_step) for s in self.stage_shares}
        lines = [f"{len(self.steps)} steps, {self.total_seconds:.2f} s; largest: {self.bottleneck}",
                 f"{'category':>18} | {'share':>7} | stages (seconds)"]
        for category, share in self.shares.items():
            stages = [f"{s} {seconds[s]:.2f}" for s in self.stage_shares
                      if (s == "other" and category == "other") or (s != "other" and category_of(s) == category)]
            lines.append(f"{category:>18} | {100 * share:6.1f}% | {', '.join(stages) or '-'}")
        if self.workers:
            lines.append("workers busy (share of the steps' time; the rest they wait): "
                         + ", ".join(f"{w} {100 * v:.0f} %" for w, v in self.workers.items()))
        return "\n".join(lines + [f"partial: {note}" for note in self.partial])


def decompose(run_dir, exclude_steps=None) -> Decomposition:
    """The time decomposition of the run in `run_dir` (any stage's), from its metrics.jsonl.

    exclude_steps: steps to leave out; default: the steps TorchProfiler profiled (their
    times carry the profiler's overhead). Raises the errors of `read_records`.
    """
    records, partial = read_records(run_dir)
    skip = set(profiled_steps(run_dir) if exclude_steps is None else exclude_steps)
    kept = [r for r in records if r["step"] not in skip]
    if len(kept) < len(records):
        if kept:
            gone = sorted(skip & {r["step"] for r in records})
            partial.append(f"step(s) {gone} ran under torch.profiler (slower): left out")
            records = kept
        else:
            partial.append("every step ran under torch.profiler: the times include its overhead")
    timeline, workers = read_timeline(run_dir, partial), {}
    if timeline is not None:
        records, workers = split_calls(records, timeline[0], partial, timeline[1])
    partial += rank_notes(run_dir, records)
    per_step, step_seconds, flat, overlapped = [], [], [], 0
    for record in records:
        own, seconds, over = own_times(record)
        overlapped += over
        per_step.append(own)
        step_seconds.append(seconds)
        flat.append({"time/step": seconds} | {f"time/{s}": v for s, v in own.items() if s != "other"})
    if overlapped:
        partial.append(f"in {overlapped} of {len(records)} steps the stages add up to more than the wall clock "
                       "(they overlap, as in an asynchronous run): there, shares are of the stages' sum")
    unknown = sorted({s for own in per_step for s in own if s != "other" and category_of(s) == "other"})
    if unknown:
        partial.append(f"stage(s) {unknown} are none of the shared names ({', '.join(STEP_ORDER)}, communication, "
                       "waiting): counted as other")
    shares = stage_shares(flat)
    return Decomposition(str(run_dir), [r["step"] for r in records], step_seconds, per_step, shares,
                         categorize(shares), [categorize(stage_shares([r])) for r in flat], records, partial,
                         overlapped, workers)


def rank_imbalance(records: list[dict]) -> float | None:
    """Mean over steps of the busiest rank's stage seconds / the ranks' mean, from stage 4's `time_by_rank`.

    1.0: every rank equally busy; 1.5: the busiest carries 50 % more than the average, and
    the others wait for it at the next collective. None when the records hold no per-rank times.
    """
    ratios = []
    for record in records:
        ranks = record.get("time_by_rank")
        if not ranks or len(ranks) < 2:
            continue
        busy = [sum(v for k, v in r.items() if k.startswith("time/") and k[5:] not in NOT_STAGES
                    and parent_of(k[5:]) is None) for r in ranks]
        if sum(busy) > 0:
            ratios.append(max(busy) / (sum(busy) / len(busy)))
    return sum(ratios) / len(ratios) if ratios else None


def read_records(run_dir) -> tuple[list[dict], list[str]]:
    """The step records of run_dir/metrics.jsonl in file order, and notes on what was left out.

    Step records are those with "time/step" (the step-0 evaluation record has none).
    Raises NoMetricsError (no file, or no step record), MetricsFileError (a damaged line
    before the last, a non-numeric or negative time), MixedRunsError (steps not increasing).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoMetricsError(f"run directory {run_dir}: not a directory; pass the --out directory of a finished run")
    path = run_dir / METRICS_FILE
    if not path.is_file() or path.stat().st_size == 0:
        raise NoMetricsError(f"run directory {run_dir} holds no {METRICS_FILE} (or an empty one): a run writes it "
                             "when it is given an out_dir (--out), one line per step")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    partial, found = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                partial.append(f"{METRICS_FILE} line {number} is cut short (the run stopped while writing it): "
                               "left out")
                break
            raise MetricsFileError(f"{path}:{number}: not a JSON record ({line[:60]!r}): the file is damaged; "
                                   f"keep lines 1-{number - 1} only, or analyse another run") from None
        if not isinstance(record, dict):
            raise MetricsFileError(f"{path}:{number}: a {type(record).__name__}, not a record (a JSON object)")
        found.append((number, record))
    steps, untimed, last = [], [], None
    for number, record in found:
        if "time/step" not in record:
            if "reward" in record or "loss" in record:
                untimed.append(number)
            continue
        step = record.get("step")
        if not isinstance(step, int):
            raise MetricsFileError(f"{path}:{number}: a step record without an integer 'step' ({step!r})")
        if last is not None and step <= last[1]:
            raise MixedRunsError(f"{path}: line {number} holds step {step} after step {last[1]} (line {last[0]}): "
                                 "the records of more than one run are mixed in this file (two runs writing into one "
                                 "directory, or files joined); analyse one run per directory")
        for key, value in record.items():
            seconds_ok = isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            if key.startswith("time/") and not seconds_ok:
                raise MetricsFileError(f"{path}:{number}: {key} = {value!r}; stage times are seconds >= 0")
        last = (number, step)
        steps.append(record)
    if untimed:
        partial.append(f"{len(untimed)} step record(s) carry no time/step (lines {untimed[0]}-{untimed[-1]}; written "
                       "by an older minirl?): left out")
    if not steps:
        raise NoMetricsError(f"{path} holds no step records with time/step ({len(found)} other record(s)): nothing "
                             "to decompose")
    return steps, partial


def profiled_steps(run_dir) -> list[int]:
    """The steps of this run that ran under torch.profiler (TorchProfiler's summary), [] if none."""
    path = Path(run_dir) / PROFILE_SUMMARY
    try:
        return sorted(int(s) for s in json.loads(path.read_text()).get("steps", []))
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def rank_notes(run_dir, records: list[dict]) -> list[str]:
    """What a data-parallel run does not let the reader split: stage 4's ranks (`time_by_rank`, run.json's
    world_size) or stage 6's trainer pool of several workers (summary.json's placement)."""
    ranks = max((len(r.get("time_by_rank") or ()) for r in records), default=0)
    try:
        ranks = max(ranks, int(json.loads((Path(run_dir) / "run.json").read_text()).get("world_size", 1) or 1))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        placement = json.loads((Path(run_dir) / "summary.json").read_text()).get("placement") or {}
        ranks = max(ranks, *(len(placement.get(role) or ()) for role in ("actor", "critic")))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    timed = any(category_of(k[5:]) == "communication" and not k.endswith("/rpc") for r in records for k in r
                if k.startswith("time/"))                                  # collectives timed apart: nothing hidden
    if ranks < 2 or timed:
        return []
    whose = "; the times are rank 0's (time_by_rank holds every rank's)" if any("time_by_rank" in r for r in records) \
        else ""
    return [f"{ranks} data-parallel ranks: their collectives (gradient all-reduce, FSDP's all-gather/reduce-scatter, "
            "a sharded sync's gathers) and the waits for the slowest rank run inside update and sync, not timed "
            f"apart: communication and waiting are in those shares, not measured on their own{whose}"]
