"""Reading a run directory's step records for notebook 09's profiler, safely; the notes it leaves.

Hand-written (it teaches nothing). `minirl.profiling.decompose` reads a run's time from its
`metrics.jsonl`, one JSON record per line. Real files go wrong, so `read_records` names each
way: a directory without metrics (`NoMetricsError`), a damaged line in the middle
(`MetricsFileError`), two runs' records in one file (`MixedRunsError`), all `RunDataError`s.
A last line cut short by a crash, and step records without `time/step`, are left out and
listed in the notes it returns. `profiled_steps` names the steps that ran under
torch.profiler (slower: the decomposition leaves them out). For data-parallel runs (stage
4's ranks, stage 6's trainer pool), `rank_notes` says what the reader cannot split (the
collectives run untimed inside update and sync) and `rank_imbalance` compares the ranks'
busy seconds from stage 4's `time_by_rank`. `step_records` does all of it for
`minirl.profiling.decompose.decompose`, and splits a Ray run's calls out of its stages with
the workers' timeline (`minirl.runtime.ray_timeline`).

What a run directory must hold to be analysed, whichever stage wrote it:
- metrics.jsonl: `step` (int, increasing) and `time/step` (the step's wall clock) in every
  step record (else a named error); `time/<stage>` for the shared names (generate, score,
  reference, advantages, update, update_critic, sync; an unknown name counts as other, and
  the report says so); `time/<stage>/<part>` for a collective, `wait*`/`queue*` or `rpc`;
  `tokens/prompt` and `tokens/completion` (the whole batch's: MFU, else a lower bound);
  `completion_length` and `completion_length_max` (stragglers); `time_by_rank`,
  `moe/load_hottest_over_coldest`, `error` (rank balance, expert load, OOM);
- run.json: `config` (RLConfig as a dict); `world_size`, `pconfig` (stage 4); `threads`;
- final/ or checkpoints/: the model's `config.json` (MFU);
- summary.json: `placement` (stage 6: role -> devices, MFU per pool);
- timeline.json: each worker's `[what, start, end]` calls (stage 6: Ray calls split out).
"""

import json
import math
from pathlib import Path

from minirl.runtime.ray_timeline import read_timeline, split_calls

METRICS_FILE = "metrics.jsonl"
PROFILE_SUMMARY = "profile/summary.json"       # written by minirl.profiling.profiler.TorchProfiler


class RunDataError(ValueError):
    """A run directory whose records cannot be decomposed; the message names the file and what to do."""


class NoMetricsError(RunDataError):
    """The directory holds no metrics.jsonl, or no step records in it."""


class MetricsFileError(RunDataError):
    """A line of metrics.jsonl that is not a record (not the last line: a damaged file)."""


class MixedRunsError(RunDataError):
    """The steps of metrics.jsonl do not increase: the records of more than one run are mixed."""



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
    from minirl.profiling.decompose import category_of  # here: decompose imports this module
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


def rank_imbalance(records: list[dict]) -> float | None:
    """Mean over steps of the busiest rank's stage seconds / the ranks' mean, from stage 4's `time_by_rank`.

    1.0: every rank equally busy; 1.5: the busiest carries 50 % more than the average, and
    the others wait for it at the next collective. None when the records hold no per-rank times.
    """
    from minirl.profiling.decompose import NOT_STAGES, parent_of  # here: decompose imports this module
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


def step_records(run_dir, exclude_steps=None) -> tuple[list[dict], list[str], dict[str, float]]:
    """(the step records to decompose, notes on what was left out or cannot be split, Ray worker -> busy share).

    exclude_steps: steps to leave out; default: the steps TorchProfiler profiled (their times
    carry the profiler's overhead). A Ray run's records get `time/<stage>/rpc` from its
    timeline. Raises the errors of `read_records`.
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
    return records, partial + rank_notes(run_dir, records), workers
