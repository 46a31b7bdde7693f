"""chapters/09_profile.py: a profiled stage-1 run end to end, the analysis of finished run directories (stage 1,
real stage-4 and stage-6 runs, notebook 08's, synthetic ones with planted symptoms or bad files), its flag checks."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import last_line
from refusals import run_script as run_with_imports
from test_profiling import CONFIG, make_run, step_record

from minirl.runtime.launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "chapters" / "09_profile.py"


def load_chapter():
    spec = importlib.util.spec_from_file_location("chapter09", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chapter = load_chapter()


def run_script(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_profile_a_new_run_then_analyse_it(tmp_path, capsys):
    out = tmp_path / "profiled"
    argv = ["--profile-steps", "2", "--steps", "3", "--prompts-per-step", "4", "--num-generations", "2",
            "--rollout-engine", "hf", "--no-progress", "--out", str(out)]
    assert chapter.main(argv) == 0                     # in-process: the CLI's own start is tested below
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["stage_shares"]) >= {"generation", "reward", "update", "sync", "communication", "waiting"}
    assert abs(sum(summary["stage_shares"].values()) - 1) < 1e-9
    assert 0 < summary["mfu"]["trainer"] < 1 and 0 < summary["mfu"]["rollout"] < 1
    assert isinstance(summary["findings"], list) and "low_mfu" in summary["findings"]
    trace = Path(summary["profile"]["per_step"]["2"]["trace"])
    assert trace.is_file() and trace.parent == out / "run" / "profile"
    assert (out / "shares.png").stat().st_size > 1000 and "perfetto" in stdout
    assert summary["steps"] == 2, "the profiled step is left out of the shares"

    again = tmp_path / "analysis"
    assert chapter.main(["--run", str(out / "run"), "--out", str(again)]) == 0
    second = json.loads((again / "summary.json").read_text())
    assert second["findings"] == summary["findings"] or set(second) == set(summary)
    assert set(second) >= {"stage_shares", "mfu", "findings", "partial", "rules", "measured"}


def test_analyse_synthetic_runs(tmp_path, capsys):
    healthy = make_run(tmp_path / "healthy", [step_record(s) for s in (1, 2, 3)])
    out = tmp_path / "a"
    assert chapter.main(["--run", str(healthy), "--out", str(out), "--peak-tflops", "1e-6"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["findings"] == [] and summary["mfu"]["trainer"] > 0.3
    assert summary["stage_shares"]["update"] == pytest.approx(3 * 0.5 / (3 * step_record(1)["time/step"]))

    slow = make_run(tmp_path / "slow", [step_record(s, generate=5.0) for s in (1, 2)])
    assert chapter.main(["--run", str(slow), "--out", str(tmp_path / "b"), "--peak-tflops", "1e-6"]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["findings"] == ["slow_rollout"]
    assert "FINDING slow_rollout" in capsys.readouterr().out


TINY_RUN = ["--steps", "2", "--prompts-per-step", "2", "--num-generations", "2", "--eval-every", "0",
            "--checkpoint-every", "0"]


@pytest.mark.distributed
def test_analyse_a_real_stage4_run(tmp_path):
    run = tmp_path / "r04"
    proc = torchrun(ROOT / "chapters" / "04_fsdp_lora.py", 2, ["--out", str(run), *TINY_RUN, "--zero", "3",
                                                               "--lora-rank", "2", "--no-progress"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert chapter.main(["--run", str(run), "--out", str(tmp_path / "a")]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    shares = summary["stage_shares"]
    assert abs(sum(shares.values()) - 1) < 1e-9 and shares["update"] > 0 and shares["sync"] > 0
    assert shares["communication"] == 0 and summary["measured"]["heavy_communication"] is None
    assert any(n.startswith("2 data-parallel ranks:") for n in summary["partial"]), "untimed collectives: said"
    mfu = summary["mfu"]
    assert 0 < mfu["trainer"] < 1 and 0 < mfu["rollout"] < 1
    expected = mfu["flops_per_step"]["trainer"] * 2 / (2 * mfu["peak_flops"]["trainer"] * mfu["seconds"]["trainer"])
    assert mfu["trainer"] == pytest.approx(expected), "the batch's FLOPs over both ranks' peak"


@pytest.mark.ray
def test_analyse_a_real_stage6_run(tmp_path):
    pytest.importorskip("ray")
    run = tmp_path / "r06"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg", RAY_ADDRESS="local")  # its own cluster
    proc = subprocess.run([sys.executable, str(ROOT / "chapters" / "06_ray.py"), "--out", str(run), *TINY_RUN,
                           "--placement", "colocated"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (run / "timeline.json").is_file()
    assert chapter.main(["--run", str(run), "--out", str(tmp_path / "a")]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert not [n for n in summary["partial"] if "timeline" in n or "Ray" in n], "the timeline matches the records"
    assert abs(sum(summary["stage_shares"].values()) - 1) < 1e-9
    assert summary["stage_shares"]["communication"] > 0, "the driver's time outside the workers' calls"
    assert {s for s in summary["stage_shares_by_stage"] if s.endswith("/rpc")} >= {"generate/rpc", "update/rpc"}
    assert list(summary["workers_busy"]) == ["shared[0]"] and 0 < summary["workers_busy"]["shared[0]"] < 1
    assert summary["measured"]["heavy_communication"] is None and 0 < summary["mfu"]["trainer"] < 1


def test_analyse_a_stage8_directory_and_an_unknown_gpu(tmp_path):
    moe = tmp_path / "08"
    moe.mkdir()
    load = {"expert_load_hottest_over_coldest": {"before": 4.0, "after": {"none": 3.0}}}
    (moe / "summary.json").write_text(json.dumps(load))
    assert chapter.main(["--run", str(moe), "--out", str(tmp_path / "a")]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["stage_shares"] is None and summary["mfu"]["trainer"] is None
    assert summary["findings"] == ["expert_imbalance"] and summary["partial"]

    gpu = make_run(tmp_path / "gpu", [step_record(1)], config=CONFIG.replace(device="cuda"))
    assert chapter.main(["--run", str(gpu), "--out", str(tmp_path / "b")]) == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    if summary["mfu"]["trainer"] is None:                      # this machine cannot name the run's GPU
        assert any("--peak-tflops" in note for note in summary["partial"])


def test_damaged_or_mixed_metrics_are_errors(tmp_path, capsys):
    mixed = make_run(tmp_path / "mixed", [step_record(2), step_record(1)])
    assert chapter.main(["--run", str(mixed), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "more than one run" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a" / "summary.json").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "pass --run DIR"),
    (["--run", "RUN", "--profile-steps", "2"], "one of the two"),
    (["--run", "MISSING"], "argument --run: .* is not a directory"),
    (["--run", "EMPTY"], "argument --run: .* holds no run"),
    (["--run", "RUN", "--out", "RUN"], "argument --out: must differ from --run"),
    (["--run", "RUN", "--learning-rate", "0.1"], "argument --learning-rate: applies to --profile-steps runs only"),
    (["--run", "RUN", "--peak-tflops", "0"], "argument --peak-tflops: 0.0: must be > 0"),
    (["--run", "RUN", "--threads", "0"], "argument --threads: 0: must be >= 1"),
    (["--profile-steps", "0"], "argument --profile-steps: '0': steps from 1 to --steps"),
    (["--profile-steps", "2,x"], "argument --profile-steps: '2,x': step numbers separated by commas"),
    (["--profile-steps", "7", "--steps", "6"], "argument --profile-steps: '7': steps from 1 to --steps \\(6\\)"),
    (["--profile-steps", "2", "--out", "HOLDS"], "already holds a run; pass --resume"),
    (["--run", "RUN", "--out", "RUN2"], "argument --out: .* holds a run"),
])
def test_bad_flags_fail_in_one_line(tmp_path, capsys, argv, message):
    run = make_run(tmp_path / "run", [step_record(1)])
    make_run(tmp_path / "run2", [step_record(1)])
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "holds" / "run", [step_record(1)])
    names = {"RUN": run, "RUN2": tmp_path / "run2", "MISSING": tmp_path / "missing", "EMPTY": tmp_path / "empty",
             "HOLDS": tmp_path / "holds"}
    argv = [str(names.get(a, a)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        chapter.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    import re
    assert re.search(message, err), err


def test_a_bad_flag_fails_before_anything_loads(tmp_path):
    proc = run_script("--profile-steps", "9", "--out", tmp_path / "x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].endswith("steps from 1 to --steps (6); step 1 is the run's first "
                                                         "(and slowest)")
    assert not (tmp_path / "x").exists(), "nothing was created"


@pytest.mark.parametrize("summary, chapter_name", [
    ({"kv_utilization": {"paged": 0.97}, "spec_speedup": {"1": 1.2}}, "chapter 05 (generation speed)"),
    ({"policy_dir": "/x", "heldout_accuracy": 0.46}, "chapter 00 (the warm start)"),
    ({"zero": {}, "activations": {}}, "chapter 03 (the memory tables)"),
    ({"something": 1}, "a summary.json"),
])
def test_a_run_of_another_stage_is_refused_naming_it(tmp_path, capsys, summary, chapter_name):
    """Issue 22: --run on a directory the analysis cannot read used to exit 0 saying that no rule fires."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as exit_:
        chapter.parse_args(["--run", str(other), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    what = chapter_name if chapter_name == "a summary.json" else f"the summary of {chapter_name}"
    assert exit_.value.code == 2, err
    assert f"argument --run: {other} holds {what} and no metrics.jsonl: nothing the analysis reads" in err, err
    assert "pass the --out of a training run" in err and not (tmp_path / "out").exists()


def test_a_mistyped_flag_or_a_missing_gpu_fails_before_torch_loads(tmp_path):
    proc, imported = run_with_imports(SCRIPT, "--profile-stesp", "3", "--out", tmp_path / "x")
    assert proc.returncode == 2 and last_line(proc).endswith("unrecognized arguments: --profile-stesp 3")
    assert not {"torch", "transformers"} & imported and not (tmp_path / "x").exists()
    if not torch.cuda.is_available():
        proc, imported = run_with_imports(SCRIPT, "--profile-steps", "3", "--device", "cuda", "--out", tmp_path / "x")
        assert proc.returncode == 2 and last_line(proc).endswith(
            "argument --device: 'cuda': this machine has no CUDA device (torch.cuda.is_available() is False): "
            "run with --device cpu")
        assert "transformers" not in imported and not (tmp_path / "x").exists()


def test_hopper_peaks_are_the_datasheets_dense_figures():
    """H100/H200 datasheets print bf16 1,979 (SXM) and 1,671 (NVL) TFLOP/s *with sparsity*: MFU uses half,
    and FP8's dense peak is twice bf16's."""
    from minirl.runtime.mfu_inputs import GPU_PEAK_TFLOPS, gpu_peak_flops

    table = dict(GPU_PEAK_TFLOPS)
    for name, key, dense in (("NVIDIA H200", "H200", 989e12), ("NVIDIA H100 80GB HBM3", "H100", 989e12),
                             ("NVIDIA H200 NVL", "H200 NVL", 835e12), ("NVIDIA H100 NVL", "H100 NVL", 835e12),
                             ("NVIDIA GH200 480GB", "H200", 989e12)):
        assert gpu_peak_flops(name, "bfloat16") == gpu_peak_flops(name, "float16") == dense, name
        assert gpu_peak_flops(name, "float32") < dense / 10, "FP32 runs on the CUDA cores, not the tensor cores"
        assert abs(table[key]["float8_e4m3fn"] * 1e12 - 2 * dense) <= 2e12, name
