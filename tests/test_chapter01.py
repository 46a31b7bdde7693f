"""chapters/01_single_process.py end to end: summary, plot, checkpoints, --model, PPO, exact resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minirl.models.policy import PolicyConfig, build_policy, build_tokenizer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "chapters" / "01_single_process.py"
TIMING = ("time/", "seconds")


def run(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--no-progress", "--threads", "1", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A locally saved tiny Qwen2 with random weights and our tokenizer: the --model path."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_tokenizer()
    build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=5),
                 tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def read_metrics(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


def test_default_policy_writes_summary_plot_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = run("--out", out, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 2)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "seconds"):
        assert key in summary, key
    assert summary["steps"] == 4 and 0 <= summary["accuracy_after"] <= 1
    assert 0.3 < summary["accuracy_before"] < 0.7, "the warm start is about half right"
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert "held-out greedy accuracy" in proc.stdout and "reward_curve.png" in proc.stdout
    ckpt = out / "checkpoints" / "step-000004"
    assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists()
    assert (ckpt / "tokenizer.json").exists() and (ckpt / "training_state.pt").exists()
    assert not list((out / "checkpoints").glob(".tmp-*")), "no temporary checkpoint left behind"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpt)   # an ordinary HF checkpoint


def test_any_hf_model_path_and_ppo(tmp_path, tiny_model_dir):
    out = tmp_path / "ppo"
    run("--out", out, "--model", tiny_model_dir, "--algo", "ppo", "--steps", 3, "--prompts-per-step", 4,
        "--num-generations", 2, "--checkpoint-every", 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algo"] == "ppo" and summary["steps"] == 3
    assert summary["model"] == str(tiny_model_dir)
    assert "value_loss" in read_metrics(out)[-1]


@pytest.mark.slow
def test_resume_after_crash_is_bit_identical(tmp_path, tiny_model_dir):
    common = ["--model", tiny_model_dir, "--steps", 6, "--prompts-per-step", 4, "--num-generations", 4,
              "--checkpoint-every", 2, "--eval-every", 3, "--beta", 0.05]
    run("--out", tmp_path / "full", *common)
    crashed = run("--out", tmp_path / "crash", *common, "--stop-after", 4, check=False)
    assert crashed.returncode == 1, crashed.stderr[-2000:]
    assert (tmp_path / "crash" / "checkpoints" / "step-000004").exists()
    assert not (tmp_path / "crash" / "summary.json").exists()
    run("--out", tmp_path / "crash", *common, "--resume")
    assert read_metrics(tmp_path / "crash") == read_metrics(tmp_path / "full")
    full = load_file(tmp_path / "full" / "checkpoints" / "step-000006" / "model.safetensors")
    resumed = load_file(tmp_path / "crash" / "checkpoints" / "step-000006" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), f"{k} differs after resume"
    a = torch.load(tmp_path / "full" / "checkpoints" / "step-000006" / "training_state.pt", weights_only=False)
    b = torch.load(tmp_path / "crash" / "checkpoints" / "step-000006" / "training_state.pt", weights_only=False)
    assert a["version"] == b["version"] == 6
    assert torch.equal(a["generator"], b["generator"])
    s_full = json.loads((tmp_path / "full" / "summary.json").read_text())
    s_res = json.loads((tmp_path / "crash" / "summary.json").read_text())
    assert s_full["accuracy_after"] == s_res["accuracy_after"] and s_res["resumed"] is True
