"""chapters/08_moe_pipelines.py end to end with small settings (no torchrun jobs), and its argument checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import last_line, run_script

ROOT = Path(__file__).resolve().parents[1]


def run(*args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    return subprocess.run([sys.executable, str(ROOT / "chapters" / "08_moe_pipelines.py"), "--out", str(tmp_path),
                           *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_chapter_writes_the_summary(tmp_path):
    out = run("--skip-torchrun", "--rl-steps", "2", "--warm-start-steps", "2", "--repeats", "1", "--quiet",
              tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["bubble"]) == {"gpipe", "1f1b", "dualpipev"}
    for b in summary["bubble"].values():
        assert b["P"] == 2 and b["M"] == 4 and 0 < b["ratio"] < 1 and b["kind"].startswith("simulated")
    assert abs(summary["bubble"]["gpipe"]["ratio"] - 1 / 5) < 1e-9, "(P-1)/(M+P-1) at P = 2, M = 4"
    assert summary["bubble"]["dualpipev"]["ratio"] < summary["bubble"]["1f1b"]["ratio"]
    util = summary["packing_utilization"]
    assert set(util) == {"padded_8", "next_fit", "first_fit_decreasing", "best_fit_decreasing"}
    assert all(0 < v <= 1 for v in util.values())
    assert util["best_fit_decreasing"] > 0.95 > util["next_fit"] > util["padded_8"]
    load = summary["expert_load_max_over_mean"]
    assert 1 <= load["before"] <= 4 and set(load["after"]) == {"none", "aux loss", "bias"}
    assert summary["moe_parameters"]["configs"]["DeepSeek-V3 defaults"]["total"] > 6.7e11
    assert summary["gspo"]["variance_ratio"] > 0
    assert (tmp_path / "pipeline_timelines.png").exists() and (tmp_path / "expert_load.png").exists()
    assert "bubble" in out.stdout and "packing" in out.stdout


def test_chapter_rejects_bad_arguments(tmp_path):
    out = run("--microbatches", "4,x", tmp_path=tmp_path)
    assert out.returncode != 0 and "--microbatches" in out.stderr
    out = run("--device", "cuda", tmp_path=tmp_path)
    assert out.returncode != 0 and "--device" in out.stderr
    out = run("--microbatches", "2", tmp_path=tmp_path)
    assert out.returncode != 0 and "DualPipeV needs at least" in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--hidden", "0"], "argument --hidden: 0: must be >= 1"),
    (["--repeats", "0"], "argument --repeats: 0: must be >= 1"),
    (["--gspo-seeds", "0"], "argument --gspo-seeds: 0: must be >= 1"),
    (["--rl-steps", "-1"], "argument --rl-steps: -1: must be >= 0"),
    (["--warm-start-steps", "x"], "argument --warm-start-steps: invalid int value: 'x'"),
    (["--model", "/nonexistent"], "argument --model: /nonexistent: no such directory; give a model directory"),
    (["--hiden", "8"], "unrecognized arguments: --hiden 8"),
])
def test_bad_flags_are_one_line_before_torch_loads(tmp_path, args, message):
    """Issue 22: --hidden 0 ran 293 s on a width-0 model; --model /nonexistent was an HFValidationError."""
    proc, imported = run_script(ROOT / "chapters" / "08_moe_pipelines.py", "--out", tmp_path, *args)
    assert proc.returncode == 2 and last_line(proc).startswith("08_moe_pipelines.py: error: ")
    assert message in last_line(proc), last_line(proc)
    assert not {"torch", "transformers"} & imported and not any(tmp_path.iterdir())


def test_a_model_that_is_no_model_is_refused_before_the_work(tmp_path):
    (tmp_path / "nomodel").mkdir()
    proc, _ = run_script(ROOT / "chapters" / "08_moe_pipelines.py", "--out", tmp_path / "out", "--model",
                         tmp_path / "nomodel", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and f"argument --model: no config.json in {tmp_path / 'nomodel'}" in last_line(proc)
    proc, _ = run_script(ROOT / "chapters" / "08_moe_pipelines.py", "--out", tmp_path / "out", "--model",
                         "no-such-org/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "argument --model: no-such-org/no-such-model: its config does not load" \
        in last_line(proc)
    if not torch.cuda.is_available():
        proc, _ = run_script(ROOT / "chapters" / "08_moe_pipelines.py", "--out", tmp_path / "out", "--device", "cuda")
        assert proc.returncode == 2 and "argument --device: 'cuda': this machine has no CUDA device" in last_line(proc)
    assert not (tmp_path / "out").exists()



def test_a_failed_torchrun_job_is_exit_status_1(tmp_path, monkeypatch, capsys):
    """main returns its exit status: a failed measurement job is 1, its cause on the last line of stderr."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter08", ROOT / "chapters" / "08_moe_pipelines.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)

    def failing(args, out):
        raise RuntimeError("pipeline job (world_size=2) failed with code 1:\nrank 1: boom")

    monkeypatch.setattr(chapter, "bubbles", failing)
    monkeypatch.setattr(chapter, "gspo", lambda *a: {})
    code = chapter.main(["--out", str(tmp_path), "--rl-steps", "0", "--warm-start-steps", "2", "--quiet"])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: a torchrun job failed: pipeline job (world_size=2) failed with code 1:"
