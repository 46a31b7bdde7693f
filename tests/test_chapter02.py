"""chapters/02_mismatch.py end to end, small settings; its flags are checked before anything is loaded."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import last_line, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "chapters" / "02_mismatch.py"


def test_chapter_writes_summary_per_rollout_dtype(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path),
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


@pytest.fixture(scope="module")
def chapter():
    spec = importlib.util.spec_from_file_location("chapter02", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--sweep", "float4"], "argument --sweep: 'float4'"),
    (["--num-prompts", "-1"], "argument --num-prompts: -1: must be >= 1"),
    (["--num-generations", "0"], "argument --num-generations: 0: must be >= 1"),
    (["--temperature", "0"], "argument --temperature: 0.0: must be > 0.0"),
    (["--learning-rate", "nan"], "argument --learning-rate: nan: must be finite"),
    (["--train-steps", "-2"], "argument --train-steps: -2: must be >= 0"),
    (["--prompts-file", "/nonexistent.txt"], "argument --prompts-file: '/nonexistent.txt': no such file"),
    (["--device", "gpu"], "argument --device: 'gpu': not a device: use cpu, cuda, cuda:1, ..."),
    (["--model", "/nonexistent"], "argument --model: /nonexistent: no such directory"),
])
def test_bad_flags_fail_before_loading(tmp_path, chapter, monkeypatch, capsys, args, message):
    monkeypatch.setattr(chapter, "load", lambda *a, **k: pytest.fail("loaded a model for a bad command line"))
    with pytest.raises(SystemExit) as exit_:
        chapter.main(["--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


def test_training_comparison_trains_the_given_model(tmp_path, tiny_model_dir, chapter, monkeypatch):
    """Item 12: --train-steps trains --model (not the embedded policy), both runs in their own directories."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = chapter.main(["--out", str(tmp_path), "--model", str(tiny_model_dir), "--sweep", "float32",
                         "--num-prompts", "2", "--num-generations", "2", "--train-steps", "1",
                         "--prompts-per-step", "2", "--eval-every", "0", "--quiet"])
    assert code == 0, "main returns the exit status"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["training"]) == {"no_correction", "tis"}
    for name in ("no_correction", "tis"):
        trained = json.loads((tmp_path / name / "final" / "config.json").read_text())
        assert trained["hidden_size"] == json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]


def test_a_mistyped_flag_fails_before_torch_loads(tmp_path):
    proc, imported = run_script(SCRIPT, "--out", tmp_path / "x", "--swep", "float32")
    assert proc.returncode == 2 and last_line(proc).endswith("error: unrecognized arguments: --swep float32")
    assert not {"torch", "transformers"} & imported
    proc, imported = run_script(SCRIPT, "--help")
    assert proc.returncode == 0 and "torch" not in imported


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(tmp_path):
    proc, imported = run_script(SCRIPT, "--out", tmp_path / "x", "--device", "cuda")
    assert proc.returncode == 2 and last_line(proc).endswith(
        "argument --device: 'cuda': this machine has no CUDA device (torch.cuda.is_available() is False): "
        "run with --device cpu")
    assert "transformers" not in imported and not (tmp_path / "x").exists()
