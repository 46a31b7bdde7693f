"""chapters/00_warm_start.py: the summary, the thread policy, flags checked at the door, cache errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import last_line, run_script

from minirl.models.policy import default_policy_dir, load_default_policy

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "chapters" / "00_warm_start.py"


def run(*args, env=None, check=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--no-progress", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


def test_summary_of_the_cached_policy(tmp_path):
    load_default_policy(progress=False)                       # built once, shared with the other tests
    proc = run("--out", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy_dir"] == str(default_policy_dir()) and summary["built"] is False
    assert summary["heldout_accuracy"] == summary["recorded_accuracy"]
    assert summary["threads"] == 1, "one torch thread by default, like chapter 01"
    assert (tmp_path / "warm_start.png").stat().st_size > 0
    assert f"{summary['heldout_accuracy']:.3f}" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (("--threads", "-1"), "argument --threads: -1: must be >= 0"),
    (("--threads", "two"), "argument --threads: invalid int value: 'two'"),
    (("--device", "gpu:0"), "argument --device: 'gpu:0': not a device: use cpu, cuda, cuda:1, ..."),
    (("--model", "Qwen/Qwen2.5-0.5B"), "argument --model: chapter 00 builds the embedded policy"),
])
def test_bad_flags_exit_2_with_one_line(args, message):
    proc = run(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("00_warm_start.py: error: ") and message in last, last


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_flag_error():
    proc = run("--device", "cuda", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "00_warm_start.py: error: argument --device: 'cuda': this machine has no CUDA device "
        "(torch.cuda.is_available() is False): run with --device cpu")


def test_a_mistyped_flag_fails_before_torch_loads():
    proc, imported = run_script(SCRIPT, "--rebuidl")
    assert proc.returncode == 2 and last_line(proc).endswith("error: unrecognized arguments: --rebuidl")
    assert "torch" not in imported and "transformers" not in imported


def test_unwritable_cache_is_reported_before_any_training(tmp_path):
    """It used to train the whole warm start (344 s on a busy machine) before failing to save it."""
    (tmp_path / "a-file").write_text("")
    proc = run("--out", tmp_path / "out", env={"MINIRL_CACHE": str(tmp_path / "a-file" / "cache")}, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot write the warm-started policy under {tmp_path / 'a-file' / 'cache'} (Not a directory): "
        f"set MINIRL_CACHE to a writable directory (MINIRL_CACHE is {tmp_path / 'a-file' / 'cache'})"]


def test_a_truncated_cached_model_names_the_file_and_the_fix(tmp_path):
    _, _, path = load_default_policy(progress=False)
    copy = tmp_path / "cache" / path.name
    shutil.copytree(path, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = run("--out", tmp_path / "out", env={"MINIRL_CACHE": str(tmp_path / "cache")}, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: the cached policy is damaged: {weights} cannot be read" in proc.stderr
    assert f"rm -r {copy}" in proc.stderr and "--rebuild" in proc.stderr


def test_no_gpu_driver_is_known_without_torch(monkeypatch):
    """device_problem answers "cuda" at once where no GPU driver shows, and asks torch where one does."""
    import minirl.runtime.validate as validate

    monkeypatch.setattr(validate, "gpu_driver_visible", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("imported torch to answer"))
    assert validate.device_problem("cuda") == validate.device_problem("cuda:1") == validate.NO_CUDA
    assert validate.device_problem("cpu") is None
    monkeypatch.setattr(validate, "gpu_driver_visible", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)     # a driver, and a CPU build of torch
    assert validate.device_problem("cuda") == validate.NO_CUDA
    assert validate.device_problem("cuda:x") == "not a device: use cpu, cuda, cuda:1, ..."
    if not validate.gpu_driver_visible():                              # this machine: the whole refusal without torch
        proc, imported = run_script(SCRIPT, "--device", "cuda")
        assert proc.returncode == 2 and "torch" not in imported
