"""The chapter scripts' shared refusals: a device this machine lacks, a --model path that does not exist, and the
one line a stopped run prints."""

import argparse

import pytest
import torch
from refusals import ROOT, last_line, run_script

from minirl.runtime.cli import check_device
from minirl.runtime.training_cli import stop_line
from minirl.runtime.validate import device_problem


def test_device_problem_names_what_is_missing():
    assert device_problem("cpu") is None
    assert "not a device" in device_problem("gpu")
    if not torch.cuda.is_available():
        assert "no CUDA device" in device_problem("cuda") and "--device cpu" in device_problem("cuda:0")
    else:
        assert device_problem("cuda") is None
        assert f"cuda:{torch.cuda.device_count() - 1}" in device_problem(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_device_is_one_parser_error(capsys):
    parser = argparse.ArgumentParser(prog="chapter")
    with pytest.raises(SystemExit) as stop:
        check_device(parser, "cuda")
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].startswith("chapter: error: argument --device: 'cuda': this machine")


def test_stop_line_names_the_checkpoint_and_the_resume_command():
    line = stop_line("interrupted", "runs/x/checkpoints/step-000004", "python chapters/01_single_process.py "
                     "--out runs/x --resume")
    assert line == ("interrupted: the last intact checkpoint is runs/x/checkpoints/step-000004; continue with: "
                    "python chapters/01_single_process.py --out runs/x --resume")
    nothing = stop_line("rank 1 died", None, "torchrun --nproc_per_node 2 04_fsdp_lora.py --out r --resume --steps 9")
    assert nothing == ("rank 1 died: no checkpoint was written yet; start the run again with: "
                       "torchrun --nproc_per_node 2 04_fsdp_lora.py --out r --overwrite --steps 9"), "nothing to resume"


@pytest.mark.parametrize("script", ["01_single_process.py", "04_fsdp_lora.py", "06_ray.py", "07_async.py"])
def test_a_missing_model_path_is_named_before_torch_loads(script, tmp_path):
    proc, imported = run_script(ROOT / "chapters" / script, "--model", "/nonexistent", "--out", tmp_path / "run")
    assert proc.returncode == 2 and last_line(proc) == (f"{script}: error: argument --model: /nonexistent: no such "
                                                        "directory, and not a hub id (a hub id looks like "
                                                        "'Qwen/Qwen2.5-0.5B')"), proc.stderr
    assert "torch" not in imported and not (tmp_path / "run").exists()
