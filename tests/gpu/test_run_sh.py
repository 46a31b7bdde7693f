"""tests/gpu/run.sh on the CPU: the rehearsal passes every check, a failing check fails the command, bad usage is 2.

The rehearsal shows that the script itself works (the same checks, small, on the CPU, with
trl, ray and vllm hidden); what it prints on a GPU is in the README's "GPU machines" section.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run.sh"


def run_sh(*args, env=None, timeout=1200):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_every_check(tmp_path):
    proc = run_sh("--cpu", "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    assert list(rows) == ["env", "imports", "warm", "timer", "stage1", "engine", "fsdp2", "mismatch", "mfu", "vllm"]
    assert all(r["result"] == "ok" for name, r in rows.items() if name != "vllm"), rows
    assert rows["vllm"]["result"] == "skip"
    assert "trl absent, ray absent, vllm absent" in rows["env"]["figures"], "the rehearsal hides them"
    assert "dtype float32/rollout float32" in rows["stage1"]["figures"]
    table = proc.stdout[proc.stdout.index("check    | result"):]
    assert "10 of 10 checks passed or skipped" in table
    assert (tmp_path / "01" / "metrics.jsonl").is_file() and (tmp_path / "logs" / "fsdp2.log").is_file()


def test_a_failing_check_fails_the_command(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc = run_sh("--cpu", "--only", "warm", "--out", tmp_path / "out",
                  env={"MINIRL_CACHE": str(tmp_path / "a-file" / "cache")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "warm     | FAIL" in proc.stdout and "cannot write the warm-started policy" in proc.stdout
    assert "FAILED: warm" in proc.stdout


def test_bad_usage_is_one_line_and_status_2(tmp_path):
    proc = run_sh("--only", "stage1,bogus", "--out", tmp_path)
    assert proc.returncode == 2 and "argument --only: bogus: not a check" in proc.stderr.strip().splitlines()[-1]
    if not torch.cuda.is_available():
        proc = run_sh("--out", tmp_path)
        assert proc.returncode == 2
        assert "no CUDA device" in proc.stderr and "--cpu" in proc.stderr.strip().splitlines()[-1]
