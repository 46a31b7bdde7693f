# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""Where a run's time goes: stage shares per step and over the run, read from the run directory.

Any stage's run is decomposed the same way (notebook 09, section 1). Simplified vs veRL's
profiler: one wall-clock number per stage and step; a collective is seen only if timed.
"""

__all__ = ["STEP_ORDER", "CATEGORIES", "CATEGORY_OF", "COMMUNICATION", "WAIT_PREFIXES", "NESTED",
           "NOT_STAGES", "OVERLAP", "parent_of", "category_of", "stage_shares", "own_times",
           "categorize", "Decomposition", "decompose"]

from dataclasses import dataclass, field

from minirl.runtime.run_records import step_records

STEP_ORDER = ("generate", "score", "reference", "advantages", "update", "update_critic", "sync")
CATEGORIES = ("generation", "reward", "reference/values", "update", "sync", "communication",
              "waiting", "other")
CATEGORY_OF = {"generate": "generation", "score": "reward", "reference": "reference/values",
               "advantages": "reference/values", "update": "update", "update_critic": "update",
               "sync": "sync"}
COMMUNICATION = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "comm",
                 "collective", "rpc")      # rpc: a Ray call's time outside the worker (stage 6)
WAIT_PREFIXES = ("wait", "queue")
NESTED = {"sleep": "generate", "wake": "sync"}  # stage 4 times these inside their parents
NOT_STAGES = ("step", "eval")      # time/step is the wall clock; time/eval runs between steps
OVERLAP = 1.02                     # stages summing to more than 2 % over the wall clock overlap


def parent_of(stage: str) -> str | None:
    """The stage a sub-timer is timed inside ("update" for "update/all_reduce"), or None."""
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
    """Each stage's share (0-1) of a run's time: its `time/<stage>` seconds summed over the run
    / the total `time/step`.

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
    """(stage -> its own seconds, sub-timers taken out of their parents; the step's seconds,
    its wall clock or the top-level stages' sum when larger; overlapped?)."""
    times = {k[5:]: float(v) for k, v in record.items()
             if k.startswith("time/") and k[5:] not in NOT_STAGES}
    own, top = dict(times), 0.0
    for stage, seconds in times.items():
        parent = parent_of(stage)
        if parent in times:
            own[parent] -= seconds
        else:
            top += seconds
    # a part timed a hair longer than its parent
    own = {stage: max(seconds, 0.0) for stage, seconds in own.items()}
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
    steps: list[int]                     # the steps decomposed
    step_seconds: list[float]            # their seconds (wall clock, or the stages' sum)
    per_step: list[dict[str, float]]     # per step: stage -> its own seconds, and "other"
    stage_shares: dict[str, float]       # stage -> share of the run (sub-timers apart)
    shares: dict[str, float]             # category -> share of the run, CATEGORIES order
    step_shares: list[dict[str, float]]  # per step: category -> share of that step
    records: list[dict]                  # the step records (MFU and the rules read them)
    partial: list[str] = field(default_factory=list)  # what was left out, and why
    overlapped: int = 0                  # steps whose stages overlap
    workers: dict[str, float] = field(default_factory=dict)  # stage 6: worker -> busy share

    @property
    def total_seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def bottleneck(self) -> str:
        """The category with the largest share of the run."""
        return max(self.shares, key=self.shares.get)


def decompose(run_dir, exclude_steps=None) -> Decomposition:
    """The time decomposition of the run in `run_dir` (any stage's), from its metrics.jsonl.

    exclude_steps: steps to leave out; default: the steps TorchProfiler profiled (their
    times carry the profiler's overhead). Raises the errors of `read_records`: a missing,
    damaged or mixed metrics file.
    """
    records, partial, workers = step_records(run_dir, exclude_steps)
    per_step, step_seconds, flat, overlapped = [], [], [], 0
    for record in records:
        own, seconds, over = own_times(record)
        overlapped += over
        per_step.append(own)
        step_seconds.append(seconds)
        flat.append({"time/step": seconds}
                    | {f"time/{s}": v for s, v in own.items() if s != "other"})
    if overlapped:
        partial.append(f"in {overlapped} of {len(records)} steps the stages overlap (add up to "
                       "more than the wall clock): there, shares are of the stages' sum")
    unknown = sorted({s for own in per_step for s in own
                      if s != "other" and category_of(s) == "other"})
    if unknown:
        partial.append(f"stage(s) {unknown} are none of the shared names "
                       f"({', '.join(STEP_ORDER)}, communication, waiting): counted as other")
    shares = stage_shares(flat)
    return Decomposition(str(run_dir), [r["step"] for r in records], step_seconds, per_step,
                         shares, categorize(shares), [categorize(stage_shares([r])) for r in flat],
                         records, partial, overlapped, workers)
