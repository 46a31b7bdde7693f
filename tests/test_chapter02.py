"""chapters/02_mismatch.py end to end, small settings, in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_chapter_writes_summary_per_rollout_dtype(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "chapters" / "02_mismatch.py"), "--out", str(tmp_path),
                          "--sweep", "float32,float8_e4m3fn", "--num-prompts", "2", "--num-generations", "2"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Mismatch report" in out.stdout and "precision sweep" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    per = summary["per_rollout_dtype"]
    assert set(per) == {"float32", "float8_e4m3fn"}
    for stats in per.values():
        assert {"mean_abs_delta", "max_abs_delta", "share_outside"} <= set(stats)
    assert per["float32"]["max_abs_delta"] < 1e-4 < per["float8_e4m3fn"]["max_abs_delta"]


def test_chapter_rejects_unknown_dtype(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "chapters" / "02_mismatch.py"), "--out", str(tmp_path),
                          "--sweep", "float4"], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode != 0 and "float4" in out.stderr
