"""`diagnose(run_dir)`: the source's symptom table (`minirl.profiling.rules`) applied to a run directory.

Hand-written (bookkeeping around the rules notebook 09 teaches). `diagnose` decomposes the
run's time (`minirl.profiling.decompose`), computes its MFU where the run directory allows
it (`run_dir_mfu`), measures every symptom (`measurements`), and calls `rules_that_fire`;
whatever it cannot measure it lists in `partial`, and the report says so.

- `measurements`: every rule's measured value (None: not measured) and how it was measured:
  generation's, the sync's and the collectives' shares from the time decomposition (a Ray
  call's `rpc` time is not a collective and is named, not counted; a data-parallel run whose
  collectives ran untimed is "not measured"); out-of-memory errors in the records or
  summary.json; the hottest over the coldest expert load (a record's
  `moe/load_hottest_over_coldest`, or notebook 08's summary.json); the longest over the mean
  completion per step; the lower of the trainer's and the rollout's MFU.
- `run_dir_mfu`: the MFU of a decomposed run from its run.json settings (stage 4's pconfig
  adds LoRA and gradient checkpointing), its model's config.json, the device's peak, and
  the devices the work ran on (stage 4's world_size, stage 6's placement).
- `Finding` (one rule applied) and `Diagnosis` (a run's findings: the text report and the
  JSON summary that chapters/09_profile.py writes, with `mfu_dict`).
- `decomposition_table`: a `Decomposition` as a text table, by category and by stage.
- `read_json`: a JSON object file, or {} with a note.
"""

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from minirl.profiling.decompose import Decomposition, category_of, decompose
from minirl.profiling.mfu import MFUReport, run_mfu
from minirl.profiling.rules import RULES, Rule, rules_that_fire
from minirl.runtime.mfu_inputs import FlopShape, FlopShapeError, UnknownPeakError, flat_config, peak_flops
from minirl.runtime.run_records import NoMetricsError, rank_imbalance
from minirl.runtime.rundir import RUN_FILE


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

    def report(self, width: int | None = None) -> str:
        """The diagnosis as text: time, MFU, every rule, then each finding with the source's direction.

        width: wrap longer lines at that many characters (default: no wrapping)."""
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
        if width:
            lines = [textwrap.fill(line, width, subsequent_indent="    ") for line in lines]
        return "\n".join(lines)

    def summary(self) -> dict:
        """JSON-ready: stage_shares, mfu (trainer, rollout), findings (the rules that fired), and the details."""
        d = self.decomposition
        return {"run": self.run_dir, "stage_shares": d.shares if d else None,
                "stage_shares_by_stage": d.stage_shares if d else None, "bottleneck": d.bottleneck if d else None,
                "steps": len(d.steps) if d else 0, "seconds": d.total_seconds if d else None,
                "workers_busy": d.workers if d else {},
                "mfu": mfu_dict(self.mfu) if self.mfu else {"trainer": None, "rollout": None},
                "findings": self.fired, "measured": {f.rule.name: f.value for f in self.findings},
                "rules": [{"name": f.rule.name, "value": f.value, "threshold": f.rule.threshold,
                           "fires_above": f.rule.above, "fired": f.fired, "measured_as": f.detail,
                           "source_threshold": f.rule.source_threshold, "direction": f.rule.direction}
                          for f in self.findings],
                "partial": self.partial}


def read_json(path: Path, partial: list[str]) -> dict:
    """A JSON object file as a dict ({} if absent; {} and a note in partial if it does not load)."""
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


def mfu_dict(report: MFUReport) -> dict:
    """An MFUReport as JSON-ready values (summary.json's "mfu")."""
    return {"trainer": report.trainer, "rollout": report.rollout,
            "trainer_hardware": report.trainer_hardware, "flops_per_step": report.flops_per_step,
            "seconds": report.seconds, "peak_flops": {k: v[0] for k, v in report.peak.items()},
            "peak_source": {k: v[1] for k, v in report.peak.items()}, "partial": report.partial}


def decomposition_table(d: Decomposition, width: int = 100) -> str:
    """A run's time by category and by stage, as text (notes wrapped at `width` characters)."""
    seconds = {s: sum(step.get(s, 0.0) for step in d.per_step) for s in d.stage_shares}
    lines = [f"{len(d.steps)} steps, {d.total_seconds:.2f} s; largest: {d.bottleneck}",
             f"{'category':>18} | {'share':>7} | stages (seconds)"]
    for category, share in d.shares.items():
        stages = [f"{s} {seconds[s]:.2f}" for s in d.stage_shares
                  if (s == "other" and category == "other") or (s != "other" and category_of(s) == category)]
        lines.append(f"{category:>18} | {100 * share:6.1f}% | {', '.join(stages) or '-'}")
    if d.workers:
        lines.append("workers busy (share of the steps' time; the rest they wait): "
                     + ", ".join(f"{w} {100 * v:.0f} %" for w, v in d.workers.items()))
    notes = [textwrap.fill(f"partial: {note}", width, subsequent_indent="  ") for note in d.partial]
    return "\n".join(lines + notes)


def diagnose(run_dir, *, peak_tflops: float | None = None, threads: int = 1,
             shape: FlopShape | None = None, quiet: bool = False) -> Diagnosis:
    """Apply every rule of RULES to the run in `run_dir` (any stage's); print the report unless quiet.

    peak_tflops: the device's dense peak (default: measured for a CPU, a datasheet's for a
    known GPU); threads: the CPU threads the run used (run.json's "threads" wins); shape: the
    model's (default: from the run's config.json). What cannot be measured is listed in
    `partial`. Raises the named errors of `decompose` (NoMetricsError, ...).
    """
    run_dir = Path(run_dir)
    partial = []
    run_info = read_json(run_dir / RUN_FILE, partial) if run_dir.is_dir() else {}
    summary = read_json(run_dir / "summary.json", partial) if run_dir.is_dir() else {}
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
            mfu_report = run_dir_mfu(run_dir, run_info, decomposition, peak_tflops, threads, shape,
                                     summary)
            partial += mfu_report.partial
        except (UnknownPeakError, FlopShapeError) as err:
            partial.append(f"no MFU: {err}")
    records = decomposition.records if decomposition is not None else []
    measured = measurements(decomposition, mfu_report, records, summary)
    fired = set(rules_that_fire({name: value for name, (value, _) in measured.items()}))
    findings = [Finding(rule, *measured[rule.name], rule.name in fired) for rule in RULES]
    diagnosis = Diagnosis(str(run_dir), findings, decomposition, mfu_report, partial)
    if not quiet:
        print(diagnosis.report(width=100))
    return diagnosis
