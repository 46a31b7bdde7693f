"""chapters/04_fsdp_lora.py under torchrun: summary, Hugging Face export, a rank killed and the run resumed
exactly from its sharded checkpoint; bad flags refused on every rank before anything is loaded."""

import dataclasses
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minirl.config import RLConfig
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import torchrun
from minirl.utils.io import atomic_write_json

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "chapters" / "04_fsdp_lora.py"
QUICK = ["--steps", 4, "--eval-every", 2, "--checkpoint-every", 2, "--prompts-per-step", 4, "--num-generations", 4,
         "--zero", 3, "--lora-rank", 4, "--learning-rate", 0.01, "--no-progress"]


def chapter():
    spec = importlib.util.spec_from_file_location("chapter04", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(*args, timeout=420):
    try:
        return torchrun(SCRIPT, 2, [*map(str, args)], timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"chapter 04 hung (killed after {err.timeout} s):\n{(err.output or '')[-3000:]}")


@pytest.mark.distributed
def test_a_killed_rank_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    job = launch("--out", whole, *QUICK)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert len(summary["peak_bytes"]) == 2 and all(p > 0 for p in summary["peak_bytes"])
    assert summary["sync_seconds"] > 0 and summary["sync_bytes"] > 0 and 0 < summary["sync_share"] < 1
    modes = [(r["mode"], r["transfer"]) for r in summary["sync_table"]]
    assert modes == [(m, t) for m in ("full", "merged", "adapter") for t in ("per tensor", "per layer",
                                                                             "256 MiB buckets")], modes
    table = {(r["mode"], r["transfer"]): r for r in summary["sync_table"]}
    for transfer in ("per tensor", "per layer", "256 MiB buckets"):
        assert table[("adapter", transfer)]["bytes"] < 0.2 * table[("merged", transfer)]["bytes"]
        assert table[("full", transfer)]["bytes"] == table[("merged", transfer)]["bytes"]
    assert summary["sync_every"] == 1 and summary["staleness_max"] == 0 and summary["pushes"] == 4
    assert "source flags > 5 %" in job.stdout and "rank 1: trainer state" in job.stdout

    from transformers import AutoModelForCausalLM

    from minirl.models.policy import greedy_accuracy, load_default_policy, load_tokenizer
    from minirl.tasks.arithmetic import make_task
    exported = AutoModelForCausalLM.from_pretrained(whole / "final")          # LoRA merged into the base
    base, _, _ = load_default_policy(progress=False)
    assert set(exported.state_dict()) == set(base.state_dict())
    assert any(not torch.equal(exported.state_dict()[k], v) for k, v in base.state_dict().items()), "it trained"
    accuracy = greedy_accuracy(exported, load_tokenizer(whole / "final"), make_task())
    assert accuracy == pytest.approx(summary["accuracy_after"]), "the export is the policy the engine evaluated"

    job = launch("--out", broken, *QUICK, "--kill-rank", "1:3")
    assert job.returncode != 0 and "rank 1: killed after step 3" in job.stdout
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["step-000002"]
    job = launch("--out", broken, "--resume", "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed != uninterrupted"
    steps = [json.loads(line)["step"] for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4], "each step logged once, the step before the crash replayed"


@pytest.mark.distributed
def test_sync_every_resumes_exactly(tmp_path):
    """--sync-every 2 with checkpoints every 3 steps: the step-3 checkpoint forces a push (3 is odd), so the
    resumed engine holds what the uninterrupted one held, and both runs end with the same weights."""
    flags = ["--steps", 6, "--eval-every", 0, "--checkpoint-every", 3, "--prompts-per-step", 4, "--num-generations",
             4, "--zero", 3, "--learning-rate", 0.001, "--sync-every", 2, "--no-colocate", "--no-progress"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    job = launch("--out", whole, *flags)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync/pushed"] for r in records] == [0, 1, 1, 1, 0, 1], "every 2nd step, the checkpoint, the last"
    assert [r["staleness"] for r in records] == [0, 1, 0, 0, 0, 1]
    assert summary["staleness_max"] == 1 and summary["pushes"] == 4 and 0 < summary["sync_share"] < 1
    assert "batches up to 1 updates behind" in job.stdout
    job = launch("--out", broken, *flags, "--kill-rank", "0:4")
    assert job.returncode != 0 and "rank 0: killed after step 4" in job.stdout
    job = launch("--out", broken, "--resume", "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed != uninterrupted"


@pytest.mark.distributed
def test_a_bad_flag_stops_every_rank_before_loading(tmp_path):
    job = launch("--out", tmp_path / "bad", "--prompts-per-step", 3, timeout=180)
    assert job.returncode != 0
    message = "argument --prompts-per-step: 3: 3 prompts do not divide over 2 ranks"
    assert job.stdout.count(message) == 2, job.stdout[-3000:]
    assert not (tmp_path / "bad").exists(), "nothing was written"


@pytest.mark.parametrize("flags, message", [
    (["--prompts-per-step", "6"], "6 prompts do not divide over 4 ranks"),
    (["--backend", "nccl"], "NCCL communicates between CUDA GPUs"),
    (["--rollout", "vllm"], "argument --rollout: 'vllm': vLLM is not installed"),
    (["--algo", "ppo"], "stage 4 trains GRPO"),
    (["--zero", "5"], "invalid choice: 5"),
    (["--lora-rank", "0", "--sync-mode", "merged"], "merging or shipping an adapter needs LoRA"),
    (["--zero", "1", "--mixed-precision", "bf16"], "use --zero 2 or 3"),
    (["--sync-every", "0"], "argument --sync-every: 0: must be >= 1"),
    (["--sync-every", "4"], "argument --sync-every: 4: a colocated engine discards its weights"),
    (["--rollout", "hf"], "argument --rollout: invalid choice: 'hf'"),
    (["--rollout", "vllm", "--rollout-engine", "paged"],
     "argument --rollout-engine: 'paged': names one of minirl's in-process engines"),
])
def test_bad_flags_are_refused_with_their_name(tmp_path, monkeypatch, capsys, flags, message):
    if "nccl" in flags and torch.cuda.is_available():
        pytest.skip("CUDA is available: NCCL is a valid backend here")
    if "vllm" in flags and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exit_:
        chapter().parse_args(["--out", str(tmp_path / "x"), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_resume_refuses_changed_settings(tmp_path):
    out = tmp_path / "run"
    atomic_write_json(out / "run.json", {"config": dataclasses.asdict(RLConfig()),
                                         "pconfig": dataclasses.asdict(ParallelConfig()), "model": None})
    for flags in (["--learning-rate", "0.1"], ["--zero", "2"]):
        with pytest.raises(SystemExit):
            chapter().parse_args(["--out", str(out), "--resume", *flags])
    args, config, pconfig = chapter().parse_args(["--out", str(out), "--resume", "--steps", "9"])
    assert config.run.steps == 9 and config.optimizer.learning_rate == RLConfig().optimizer.learning_rate
    assert pconfig == ParallelConfig()
