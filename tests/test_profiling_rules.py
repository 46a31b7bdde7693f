"""Stage 9: the symptom table as rules. Each rule fires on a run directory with its symptom planted, and only it; a
healthy run fires none; what a run did not record is "not measured" and marks the report partial."""

import dataclasses
import json

import pytest
import torch
from test_profiling import CONFIG, make_run, step_record

from minirl.profiling.decompose import decompose
from minirl.profiling.mfu import run_mfu
from minirl.profiling.rules import RULES, rules_that_fire
from minirl.runtime.diagnosis_report import diagnose
from minirl.runtime.mfu_inputs import FlopShape, flat_config
from minirl.runtime.run_records import MixedRunsError, NoMetricsError

HEALTHY_MFU = 0.5


def healthy_peak_tflops(run) -> float:
    """The peak at which the lower of the run's trainer and rollout MFU is HEALTHY_MFU."""
    d = decompose(run)
    throughput = run_mfu(d.records, flat_config(dataclasses.asdict(CONFIG)), FlopShape.from_run_dir(run), 1.0, 1.0)
    return min(throughput.trainer, throughput.rollout) / HEALTHY_MFU / 1e12


def healthy_records(n=4, **change):
    return [step_record(s, **change) for s in range(1, n + 1)]


def check(tmp_path, records, expected: list[str], *, summary=None, peak_scale=1.0, **kw):
    run = make_run(tmp_path / "run", records, summary=summary, **kw)
    diagnosis = diagnose(run, peak_tflops=healthy_peak_tflops(run) * peak_scale, quiet=True)
    assert diagnosis.fired == expected, diagnosis.report()
    return diagnosis


def test_a_healthy_run_fires_no_rule(tmp_path):
    d = check(tmp_path, healthy_records(), [])
    assert d.mfu.trainer >= HEALTHY_MFU - 1e-9 and d.mfu.rollout >= HEALTHY_MFU - 1e-9
    measured = d.summary()["measured"]
    assert measured["heavy_communication"] is None and measured["expert_imbalance"] is None
    assert measured["activation_oom"] == 0 and 1 < measured["stragglers"] < 2
    assert "no rule fires" in d.report()


@pytest.mark.parametrize("rule, records, extra", [
    ("slow_rollout", healthy_records(generate=4.0), {}),
    ("slow_sync", healthy_records(sync=0.06), {}),
    ("heavy_communication", healthy_records(update=0.5, **{"time/update/all_reduce": 0.12}), {}),
    ("activation_oom", healthy_records()[:2] + [step_record(3, error="torch.OutOfMemoryError: CUDA out of memory. "
                                                                     "Tried to allocate 2.00 GiB")], {}),
    ("activation_oom", healthy_records(), {"summary": {"error": "out of memory during the run"}}),
    ("expert_imbalance", healthy_records(**{"moe/load_hottest_over_coldest": 3.0}), {}),
    ("expert_imbalance", healthy_records(), {"summary": {"expert_load_hottest_over_coldest":
                                                         {"before": 4.0, "after": {"none": 2.6, "bias": 1.3}}}}),
    ("stragglers", healthy_records(longest=8.0, completion_tokens=16), {}),
    ("low_mfu", healthy_records(), {"peak_scale": 2.0}),
])
def test_each_planted_symptom_fires_its_rule_only(tmp_path, rule, records, extra):
    d = check(tmp_path, records, [rule], **extra)
    finding = next(f for f in d.findings if f.rule.name == rule)
    sign = "below" if rule == "low_mfu" else "above"
    assert f"FINDING {rule}" in d.report() and f"is {sign}" in d.report()
    assert finding.rule.direction in d.report() and finding.rule.source_threshold in d.report()


def test_thresholds_are_strict(tmp_path):
    # sync exactly 5 % of the step: "more than 5 %" does not fire
    rec = step_record(1, generate=0.43, sync=0.05, update=0.5, other=0.0, score=0.01, reference=0.005,
                      advantages=0.005)
    assert abs(rec["time/sync"] / rec["time/step"] - 0.05) < 1e-12
    assert rules_that_fire({"slow_sync": rec["time/sync"] / rec["time/step"]}) == []
    assert rules_that_fire({"slow_sync": 0.0500001, "low_mfu": 0.3}) == ["slow_sync"]


def test_rules_are_the_source_table():
    assert [r.name for r in RULES] == ["slow_rollout", "slow_sync", "heavy_communication", "activation_oom",
                                       "expert_imbalance", "stragglers", "low_mfu"]
    thresholds = {r.name: (r.threshold, r.above) for r in RULES}
    assert thresholds["slow_rollout"] == (0.80, True) and thresholds["slow_sync"] == (0.05, True)
    assert thresholds["heavy_communication"] == (0.10, True) and thresholds["low_mfu"] == (0.30, False)
    assert thresholds["expert_imbalance"] == (2.0, True), "hottest / coldest: 90 % vs 30 % is 3"


@pytest.mark.parametrize("loads", [[0.9, 0.3], [0.9, 0.9, 0.3, 0.3], [0.9, 0.6, 0.6, 0.3]])
def test_the_sources_expert_example_fires(tmp_path, loads):
    """"Some GPUs at 90 % while others are near 30 %": the rule fires, from a bare value and from a run's records."""
    from minirl.models.moe_balance import load_imbalance

    stats = load_imbalance(torch.tensor(loads))
    assert stats["hottest_over_coldest"] == pytest.approx(3.0)
    assert rules_that_fire({"expert_imbalance": stats["hottest_over_coldest"]}) == ["expert_imbalance"]
    if len(loads) == 4 and loads[1] == 0.9:                 # half at each level: hottest / mean is exactly 1.5
        assert stats["max_over_mean"] == pytest.approx(1.5)
    records = healthy_records(**{"moe/load_hottest_over_coldest": stats["hottest_over_coldest"]})
    check(tmp_path, records, ["expert_imbalance"])
    even = load_imbalance(torch.tensor([0.6, 0.6, 0.6, 0.6]))["hottest_over_coldest"]
    assert rules_that_fire({"expert_imbalance": even}) == []


def test_stage8_directory_without_metrics_is_a_partial_report(tmp_path):
    run = tmp_path / "08"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"expert_load_hottest_over_coldest":
                                                  {"before": 4.0, "after": {"none": 2.5, "aux loss": 1.2}}}))
    d = diagnose(run, quiet=True)
    assert d.fired == ["expert_imbalance"] and d.decomposition is None and d.mfu is None
    assert any("no time decomposition" in note for note in d.partial)
    summary = d.summary()
    assert summary["stage_shares"] is None and summary["mfu"] == {"trainer": None, "rollout": None}
    assert "'none'" in next(f.detail for f in d.findings if f.rule.name == "expert_imbalance")


def test_unknown_peak_asks_for_it(tmp_path):
    config = CONFIG.replace(device="cuda")
    run = make_run(tmp_path / "gpu", healthy_records(), config=config)
    d = diagnose(run, quiet=True)
    if d.mfu is None:                                      # no CUDA here, or a GPU minirl does not know
        assert any("--peak-tflops" in note for note in d.partial), d.partial
        assert "PARTIAL" in d.report() and "low_mfu" not in d.fired
    assert diagnose(run, peak_tflops=1e-3, quiet=True).mfu.trainer > 0


def test_missing_model_config_or_settings_is_partial(tmp_path):
    d = diagnose(make_run(tmp_path / "nomodel", healthy_records(), model=False), quiet=True)
    assert d.mfu is None and any("config.json" in note for note in d.partial)
    assert d.summary()["stage_shares"]["update"] > 0
    run = make_run(tmp_path / "norun", healthy_records())
    (run / "run.json").unlink()
    d = diagnose(run, quiet=True)
    assert d.mfu is None and any("run.json" in note for note in d.partial)


def test_bad_directories_are_named_errors(tmp_path):
    with pytest.raises(NoMetricsError):
        diagnose(tmp_path / "missing", quiet=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoMetricsError):
        diagnose(empty, quiet=True)
    with pytest.raises(MixedRunsError):
        diagnose(make_run(tmp_path / "mixed", [step_record(2), step_record(1)]), quiet=True)
    truncated = make_run(tmp_path / "cut", [], text=json.dumps(step_record(1)) + "\n" + json.dumps(step_record(2))[:50])
    d = diagnose(truncated, peak_tflops=1.0, quiet=True)
    assert any("cut short" in note for note in d.partial) and "PARTIAL" in d.report()


def test_diagnose_prints_its_report(tmp_path, capsys):
    run = make_run(tmp_path / "r", healthy_records(generate=4.0))
    diagnose(run, peak_tflops=healthy_peak_tflops(run))
    out = capsys.readouterr().out
    assert "slow_rollout" in out and "FINDING slow_rollout" in out and "prefix caching" in out


def test_an_old_stage8_summary_says_what_is_missing(tmp_path):
    """A summary.json from before the hottest/coldest key: not measured (never fires), and the detail says why."""
    run = tmp_path / "08-old"
    run.mkdir()
    old = {"expert_load_max_over_mean": {"before": 2.4, "after": {"none": 2.1}}}
    (run / "summary.json").write_text(json.dumps(old))
    d = diagnose(run, quiet=True)
    finding = next(f for f in d.findings if f.rule.name == "expert_imbalance")
    assert finding.value is None and not finding.fired and "hottest / coldest" in finding.detail
