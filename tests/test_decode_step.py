"""benchmarks/decode_step.py: the decode step at equal rows (HF against the engine), without the whole benchmark."""

import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_step.py"


def test_decode_step_quick_prints_the_limits_and_one_line_per_shape(capsys):
    spec = importlib.util.spec_from_file_location("decode_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--shapes", "long"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^machine_limits: matmul_gflops_1t [\d.]+ copy_gbps [\d.]+$", out, re.M), out
    line = re.search(r"^long: hf ([\d.]+) ms, paged ([\d.]+) ms, step_ratio_equal_rows ([\d.]+) \(min [\d.]+, "
                     r"max [\d.]+, n 2\), decode_roofline_share ([\d.]+)$", out, re.M)
    assert line, out
    hf, paged, ratio, share = map(float, line.groups())
    assert hf > 0 and paged > 0 and ratio > 0 and 0 < share < 1


def test_each_side_of_a_pair_runs_its_steps_back_to_back(monkeypatch):
    """engine_vs_hf.decode_steps: a side's turn is `burst` calls in a row (as generation runs them) and counts
    their CPU time / burst; the order alternates from pair to pair."""
    spec = importlib.util.spec_from_file_location("engine_vs_hf", SCRIPT.parent / "engine_vs_hf.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []
    monkeypatch.setattr(bench, "probe_step", lambda model, rows, n, context: (lambda step: calls.append("paged"), None))
    monkeypatch.setattr(bench, "hf_decode_step", lambda model, rows, context: lambda: calls.append("hf"))
    steps = bench.decode_steps(None, pairs=3, burst=4)
    assert calls == ["paged"] * 4 + ["hf"] * 8 + ["paged"] * 8 + ["hf"] * 4
    assert steps["burst"] == 4 and len(steps["seconds"]["paged"]) == len(steps["seconds"]["hf"]) == 3
