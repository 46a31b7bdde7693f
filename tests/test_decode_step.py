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
