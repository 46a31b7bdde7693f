# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""The source's symptom table as rules: `diagnose(run_dir)` measures each symptom of a run and says which fire.

Each `Rule` has a measured value (from the time decomposition, MFU, or what the run
recorded), a threshold, a direction (fires above it, or below), the source's threshold as
its table states it, and the source's direction (what to try), in our words. A value the
run did not record is None ("not measured") and never fires. `diagnose` reads only the
run directory: metrics.jsonl (times, tokens, lengths, errors, expert loads), run.json (the
settings), the model's config.json (for MFU), and summary.json (what a chapter script
concluded: stage 8's expert load, an error).

Translations of the source's thresholds: expert imbalance "some devices at 90 %, others
near 30 %" is read as the hottest expert's (or rank's) load over the coldest's above 2
(the example's ratio is 3; notebook 08's load_imbalance records hottest_over_coldest, inf
when an expert gets nothing); stragglers, for which the
source gives no number, fire when the longest completion of a step is on average more
than twice the mean (half of the batch's decode slots idle behind it).
"""

__all__ = ["Rule", "RULES", "rules_that_fire", "measurements", "Finding", "Diagnosis",
           "run_dir_mfu", "diagnose"]

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from minirl.profiling.decompose import Decomposition, NoMetricsError, category_of, decompose, rank_imbalance
from minirl.profiling.mfu import (
    FlopShape,
    FlopShapeError,
    MFUReport,
    UnknownPeakError,
    flat_config,
    peak_flops,
    run_mfu,
)
from minirl.runtime.rundir import RUN_FILE


@dataclass(frozen=True)
class Rule:
    """One row of the source's symptom table."""

    name: str
    symptom: str
    measures: str
    threshold: float
    above: bool                  # fires when the value is above the threshold (False: below)
    source_threshold: str        # as the source's table states it
    direction: str               # what the source says to try, in our words
    unit: str = "share"          # how values print: "share" (0-1, as %), "ratio" (x.xx) or "count"


RULES = (
    Rule("slow_rollout", "slow rollout", "generation's share of the run's time", 0.80, True,
         "more than 80 % of total time",
         "add rollout devices, enable prefix caching, raise the batch size, or deploy the rollout separately"),
    Rule("slow_sync", "slow weight synchronization", "the weight sync's share of the run's time", 0.05, True,
         "more than 5 %", "synchronize only LoRA adapters, pack the NCCL transfers, or synchronize less often"),
    Rule("heavy_communication", "heavy cross-device communication",
         "collectives' share of the run's time (all-reduce, all-gather, ...)", 0.10, True,
         "all-reduce/all-gather over 10 %",
         "more micro-batches, gradient accumulation, or a different parallel partition"),
    Rule("activation_oom", "activation out of memory", "out-of-memory errors the run recorded", 0.0, True,
         "CUDA out of memory during training",
         "enable gradient checkpointing, shorten the maximum sequence length, or shrink the batch", "count"),
    Rule("expert_imbalance", "expert load imbalance", "the hottest expert's (or rank's) load over the coldest's", 2.0,
         True,
         "some GPUs at 90 % while others are near 30 %",
         "add an expert-balancing loss and adjust the routing or the expert-parallel placement", "ratio"),
    Rule("stragglers", "stragglers", "the longest completion over the mean, per step, averaged", 2.0, True,
         "the longest sequence determines the batch time (no number given)",
         "bucket sequences by length, or group them by predicted length", "ratio"),
    Rule("low_mfu", "low MFU", "the lower of the trainer's and the rollout's MFU", 0.30, False,
         "below 30 % MFU",
         "inspect communication, data loading and rollout waiting in the time decomposition"),
)


def rules_that_fire(measured: dict[str, float | None], rules: tuple[Rule, ...] = RULES) -> list[str]:
    """The names of the rules that fire, in the order of `rules`.

    measured: rule name -> measured value, or None when the run did not record it (a rule
    missing from `measured` is not measured either). A rule with above=True fires when its
    value is strictly greater than its threshold; with above=False, strictly less. A value
    that is not measured (None) or not a number (NaN) never fires. Values and thresholds are
    in the same units (shares 0-1, not percent).
    """
    fired = []
    for rule in rules:
        value = measured.get(rule.name)
        if value is None or math.isnan(value):
            continue
        if (value > rule.threshold) if rule.above else (value < rule.threshold):
            fired.append(rule.name)
    return fired


def _oom_errors(records: list[dict], summary: dict) -> int:
    texts = [str(r.get("error", "")) for r in records] + [str(summary.get("error", ""))]
    return sum("out of memory" in t.lower() for t in texts)


def _expert_load(records: list[dict], summary: dict) -> tuple[float | None, str]:
    """(hottest / coldest load, where it came from): the records' last sixth, or stage 8's summary (worst run)."""
    key = "moe/load_hottest_over_coldest"
    values = [r[key] for r in records if key in r]
    if values:
        tail = values[-max(1, len(values) // 6):]
        return sum(tail) / len(tail), f"{key}, mean of the last {len(tail)} steps"
    load = summary.get("expert_load_hottest_over_coldest")
    if isinstance(load, dict) and isinstance(load.get("after"), dict) and load["after"]:
        name, value = max(load["after"].items(), key=lambda kv: kv[1])
        runs = sorted(load["after"])
        return float(value), f"summary.json expert_load_hottest_over_coldest, run {name!r} (the worst of {runs})"
    if "expert_load_max_over_mean" in summary:
        return None, ("summary.json holds only expert_load_max_over_mean (hottest / mean), not the hottest / "
                      "coldest ratio the rule reads: rerun chapters/08_moe_pipelines.py")
    return None, "no expert loads recorded (a dense model, or not logged)"


def _stragglers(records: list[dict]) -> tuple[float | None, str]:
    ratios = [r["completion_length_max"] / r["completion_length"] for r in records
              if r.get("completion_length_max") and r.get("completion_length")]
    if not ratios:
        return None, "records carry no completion_length_max"
    detail = f"longest / mean completion, mean over {len(ratios)} steps (max {max(ratios):.2f})"
    return sum(ratios) / len(ratios), detail


def measurements(decomposition: Decomposition | None, mfu: MFUReport | None, records: list[dict],
                 summary: dict) -> dict[str, tuple[float | None, str]]:
    """rule name -> (measured value or None, how it was measured) for every rule of RULES."""
    out = {}
    if decomposition is not None:
        shares = decomposition.shares
        out["slow_rollout"] = (shares["generation"], "generation's share of the run's time")
        out["slow_sync"] = (shares["sync"], "sync's share of the run's time")
        comm = {s: v for s, v in decomposition.stage_shares.items()
                if s != "other" and category_of(s) == "communication"}
        rpc = sum(v for s, v in comm.items() if s.endswith("/rpc"))
        collectives = {s: v for s, v in comm.items() if not s.endswith("/rpc")}
        ray = f"; Ray calls (rpc, not collectives) {100 * rpc:.1f} %, not counted" if rpc else ""
        if collectives:
            out["heavy_communication"] = (sum(collectives.values()), "collectives' share of the run's time" + ray)
        elif any(" data-parallel ranks: " in note for note in decomposition.partial):
            out["heavy_communication"] = (None, "several ranks, but their collectives run untimed inside update and "
                                                "sync" + ray)
        else:
            out["heavy_communication"] = (None, "no collective timed apart in the records (one process, or "
                                                "untimed)" + ray)
    else:
        for name in ("slow_rollout", "slow_sync", "heavy_communication"):
            out[name] = (None, "no time decomposition")
    out["activation_oom"] = (float(_oom_errors(records, summary)), "errors mentioning 'out of memory'")
    out["expert_imbalance"] = _expert_load(records, summary)
    out["stragglers"] = _stragglers(records)
    ranks = rank_imbalance(records)
    if ranks is not None and out["stragglers"][0] is not None:
        out["stragglers"] = (out["stragglers"][0], out["stragglers"][1] + f"; busiest rank / mean rank {ranks:.2f}")
    values = [v for v in ((mfu.trainer, mfu.rollout) if mfu is not None else ()) if v is not None]
    out["low_mfu"] = ((min(values), "min(trainer, rollout) MFU") if values else (None, "MFU not computed"))
    return out


@dataclass
class Finding:
    """A rule applied to a run: its measured value (None: not measured), how it was measured, whether it fired."""

    rule: Rule
    value: float | None
    detail: str
    fired: bool

    def format(self, value: float | None) -> str:
        if value is None:
            return "not measured"
        if self.rule.unit == "share":
            return f"{100 * value:.1f} %"
        return f"{value:.0f}" if self.rule.unit == "count" else f"{value:.2f}"

    def line(self) -> str:
        sign = ">" if self.rule.above else "<"
        threshold = f"{sign} {self.format(self.rule.threshold):>7}"
        return (f"{self.rule.name:>19} | {self.format(self.value):>12} | {threshold} | "
                f"{'FIRES' if self.fired else 'no':>5} | {self.detail}")


@dataclass
class Diagnosis:
    """What `diagnose` found in one run directory."""

    run_dir: str
    findings: list[Finding]
    decomposition: Decomposition | None
    mfu: MFUReport | None
    partial: list[str] = field(default_factory=list)

    @property
    def fired(self) -> list[str]:
        return [f.rule.name for f in self.findings if f.fired]

    def report(self) -> str:
        """The diagnosis as text: time, MFU, every rule, then each finding with the source's direction."""
        d, lines = self.decomposition, [f"diagnosis of {self.run_dir}"]
        if d is not None:
            lines.append(f"  {len(d.steps)} steps, {d.total_seconds:.2f} s; shares: "
                         + ", ".join(f"{c} {100 * v:.1f} %" for c, v in d.shares.items() if v >= 0.0005))
            if d.workers:
                lines.append("  Ray workers busy (the rest of the steps' time they wait): "
                             + ", ".join(f"{w} {100 * v:.0f} %" for w, v in d.workers.items()))
        if self.mfu is not None:
            peaks = "; ".join(f"{k} peak {v[0] / 1e9:,.1f} GFLOP/s ({v[1]})" for k, v in self.mfu.peak.items())
            show = [f"{k} {100 * v:.2f} %" for k, v in (("trainer", self.mfu.trainer), ("rollout", self.mfu.rollout))
                    if v is not None]
            lines.append(f"  MFU: {', '.join(show)}  [{peaks}]")
        lines.append(f"{'rule':>19} | {'measured':>12} | {'threshold':>9} | fires | how measured")
        lines += [f.line() for f in self.findings]
        for f in self.findings:
            if f.fired:
                sign = "above" if f.rule.above else "below"
                lines.append(f"FINDING {f.rule.name}: {f.rule.symptom}, {f.format(f.value)} is {sign} "
                             f"{f.format(f.rule.threshold)} (source: {f.rule.source_threshold}); "
                             f"the source's direction: {f.rule.direction}")
        if not self.fired:
            lines.append("no rule fires")
        lines += [f"PARTIAL: {note}" for note in self.partial]
        return "\n".join(lines)

    def summary(self) -> dict:
        """JSON-ready: stage_shares, mfu (trainer, rollout), findings (the rules that fired), and the details."""
        d = self.decomposition
        return {"run": self.run_dir, "stage_shares": d.shares if d else None,
                "stage_shares_by_stage": d.stage_shares if d else None, "bottleneck": d.bottleneck if d else None,
                "steps": len(d.steps) if d else 0, "seconds": d.total_seconds if d else None,
                "workers_busy": d.workers if d else {},
                "mfu": self.mfu.as_dict() if self.mfu else {"trainer": None, "rollout": None},
                "findings": self.fired, "measured": {f.rule.name: f.value for f in self.findings},
                "rules": [{"name": f.rule.name, "value": f.value, "threshold": f.rule.threshold,
                           "fires_above": f.rule.above, "fired": f.fired, "measured_as": f.detail,
                           "source_threshold": f.rule.source_threshold, "direction": f.rule.direction}
                          for f in self.findings],
                "partial": self.partial}


def _read_json(path: Path, partial: list[str]) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        partial.append(f"{path.name} does not load ({err}): ignored")
        return {}
    return value if isinstance(value, dict) else {}


def run_dir_mfu(run_dir, run_info: dict, decomposition: Decomposition, peak_tflops: float | None = None,
                threads: int = 1, shape: FlopShape | None = None, summary: dict | None = None) -> MFUReport:
    """MFU of a decomposed run from its run.json settings and its model's config (raises when either is missing).

    Devices: run.json's world_size (stage 4's ranks) or summary.json's placement (stage 6:
    the actor's and the rollout's devices); one otherwise. Stage 4's pconfig adds LoRA and
    gradient checkpointing to the settings.
    """
    if not isinstance(run_info.get("config"), dict):
        raise FlopShapeError(f"{Path(run_dir) / RUN_FILE} holds no 'config' (the run's settings): cannot count "
                              "the batch")
    config = flat_config(run_info["config"]) | flat_config(run_info.get("pconfig") or {})   # stage 4: LoRA, ...
    missing = [k for k in ("prompts_per_step", "num_generations", "algo", "beta", "num_iterations",
                           "importance_sampling_correction") if k not in config]
    if missing:
        raise FlopShapeError(f"run.json's config lacks {missing}: not a minirl RL run's settings")
    shape = shape or FlopShape.from_run_dir(run_dir)
    device = str(config.get("device", "cpu"))
    threads = int(run_info.get("threads", threads))
    trainer = peak_flops(device, shape.dtype, threads, peak_tflops)
    rollout_dtype = str(config.get("rollout_dtype", shape.dtype))
    if rollout_dtype == "auto":                  # RLConfig's default: bfloat16 on CUDA, float32 elsewhere
        rollout_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    rollout = peak_flops(device, rollout_dtype, threads, peak_tflops)
    world = int(run_info.get("world_size", config.get("world_size", 1)) or 1)    # stage 4: every rank trains
    devices = (summary or {}).get("placement")                                   # stage 6: role -> its devices
    pools = {role: len(devices[role]) if isinstance(devices, dict) and isinstance(devices.get(role), list) else None
             for role in ("actor", "rollout")}
    report = run_mfu(decomposition.records, config, shape, trainer[0], rollout[0], pools["actor"] or world,
                     pools["rollout"] or world)
    if device.startswith("cpu") and peak_tflops is None and "threads" not in run_info:   # chapters 01, 04, 06
        trainer, rollout = ((p, f"{how}; --threads: run.json does not record the run's") for p, how in
                            (trainer, rollout))
    report.peak = {"trainer": trainer, "rollout": rollout}
    return report


def diagnose(run_dir, *, peak_tflops: float | None = None, threads: int = 1, shape: FlopShape | None = None,
             quiet: bool = False) -> Diagnosis:
    """Apply every rule of RULES to the run in `run_dir` (any stage's); print the report unless quiet.

    peak_tflops: the device's dense peak (default: measured for a CPU, the datasheet table for
    a known GPU); threads: the CPU threads the run used (run.json's "threads" wins; chapter
    01's default is 1); shape: the model's shape (default: from the run's config.json).
    What cannot be measured is listed in `partial` (an unknown peak asks for --peak-tflops).
    Raises NoMetricsError when the directory holds nothing to diagnose, and the named errors
    of `decompose` for a damaged or mixed metrics file.
    """
    run_dir = Path(run_dir)
    partial = []
    run_info = _read_json(run_dir / RUN_FILE, partial) if run_dir.is_dir() else {}
    summary = _read_json(run_dir / "summary.json", partial) if run_dir.is_dir() else {}
    try:
        decomposition = decompose(run_dir)
    except NoMetricsError as err:
        if not summary:
            raise
        decomposition = None
        partial.append(f"no time decomposition, no MFU: {err}")
    mfu_report = None
    if decomposition is not None:
        partial += decomposition.partial
        try:
            mfu_report = run_dir_mfu(run_dir, run_info, decomposition, peak_tflops, threads, shape, summary)
            partial += mfu_report.partial
        except (UnknownPeakError, FlopShapeError) as err:
            partial.append(f"no MFU: {err}")
    records = decomposition.records if decomposition is not None else []
    measured = measurements(decomposition, mfu_report, records, summary)
    fired = set(rules_that_fire({name: value for name, (value, _) in measured.items()}))
    findings = [Finding(rule, *measured[rule.name], rule.name in fired) for rule in RULES]
    diagnosis = Diagnosis(str(run_dir), findings, decomposition, mfu_report, partial)
    if not quiet:
        print(diagnosis.report())
    return diagnosis
