"""Precision as TRL trains: float32 weights on every device, mixed precision by autocast ("auto": bf16 on CUDA);
the rollout copy's "auto" is bfloat16 on CUDA and float32 on a CPU; a CPU run is as before."""

import json

import pytest
import torch

from minirl.config import RLConfig, auto_dtype
from minirl.runtime.validate import ConfigError


def test_auto_resolves_by_device_and_names_pass_through():
    assert auto_dtype("auto", "cpu") == "float32" and auto_dtype("auto", "cuda:1") == "bfloat16"
    assert auto_dtype("float16", "cuda") == "float16" and auto_dtype("bfloat16", "cpu") == "bfloat16"
    cpu, gpu = RLConfig(), RLConfig.from_flat(device="cuda")
    assert (cpu.run.dtype, cpu.rollout.rollout_dtype) == ("auto", "auto"), "the setting stays auto (run.json says so)"
    assert (cpu.policy_dtype, cpu.engine_dtype) == ("float32", "float32")
    assert (gpu.policy_dtype, gpu.engine_dtype) == ("float32", "bfloat16"), "weights float32, as TRL's"
    assert (cpu.autocast_dtype, gpu.autocast_dtype) == (None, "bfloat16")
    assert RLConfig.from_flat(mixed_precision="bf16").autocast_dtype == "bfloat16"
    assert RLConfig.from_flat(device="cuda", mixed_precision="no").autocast_dtype is None
    assert RLConfig.from_flat(device="cuda", dtype="float32", rollout_dtype="float8_e4m3fn").engine_dtype == \
        "float8_e4m3fn"
    with pytest.raises(ConfigError, match="dtype='float16'"):
        RLConfig.from_flat(dtype="float16")                     # no loss scaling: a float16 policy would diverge


def test_the_cpu_default_is_bit_for_bit_the_explicit_float32_run():
    from minirl.train.run import train

    def metrics(**dtypes):
        config = RLConfig.from_flat(steps=2, prompts_per_step=4, eval_every=0, seed=3, **dtypes)
        return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in train(config, progress=False)]
    assert metrics() == metrics(dtype="float32", rollout_dtype="float32")


def test_build_roles_and_engine_use_the_resolved_dtypes(tiny):
    import copy

    from minirl.rollout.registry import build_engine
    from minirl.train.run import build_roles

    model, tokenizer = tiny
    config = RLConfig.from_flat(dtype="bfloat16", rollout_dtype="float16", algo="ppo", beta=0.1)
    roles = build_roles(config, copy.deepcopy(model))
    assert {p.dtype for p in roles.actor.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in roles.critic.model.parameters()} == {torch.bfloat16}, "the value head too: one dtype"
    assert {p.dtype for p in roles.reference.model.parameters()} == {torch.bfloat16}
    assert build_engine(config, model, tokenizer).dtype == "float16"
    assert build_engine(RLConfig(), model, tokenizer).dtype == "float32", "auto on a CPU"


def test_the_mfu_rules_read_an_auto_rollout_dtype(tmp_path):
    from test_profiling import CONFIG, make_run, step_record

    from minirl.runtime.diagnosis_report import run_dir_mfu
    from minirl.runtime.mfu_inputs import FlopShape

    run = make_run(tmp_path / "run", [step_record(1)], config=CONFIG)
    info = json.loads((run / "run.json").read_text())
    assert info["config"]["rollout"]["rollout_dtype"] == "auto"
    shape = FlopShape(params=1e6, layers=2, attn_dim=64, total_params=1.1e6)
    from minirl.profiling.decompose import decompose

    report = run_dir_mfu(run, info, decompose(run), shape=shape)     # a CPU run: the peak measured at float32
    assert report.rollout is not None and "best float32 matmul" in report.peak["rollout"][1]


def _changed_share(out, dtype) -> float:
    """The share of the policy's parameters that one run in `out` changed from the embedded start."""
    from transformers import AutoModelForCausalLM

    from minirl.models.policy import load_default_policy
    start, _, _ = load_default_policy(progress=False)
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    before = {n: p.detach().to(dtype) for n, p in start.named_parameters()}
    changed = total = 0
    for name, p in final.named_parameters():
        changed += (p.detach().to(dtype) != before[name]).sum().item()
        total += p.numel()
    return changed / total


@pytest.mark.slow
def test_mixed_precision_keeps_every_update_that_pure_bf16_loses(tmp_path):
    """One step at lr 1e-6 (bf16 autocast runs on the CPU): with --mixed-precision bf16 the float32 weights take
    (nearly) every update; with --dtype bfloat16 (pure bf16) most updates round away and a warning says so."""
    import subprocess
    import sys
    from pathlib import Path

    chapter = Path(__file__).resolve().parents[1] / "chapters" / "01_single_process.py"
    common = ["--steps", "1", "--learning-rate", "1e-6", "--eval-every", "0", "--checkpoint-every", "0"]
    mixed, pure = tmp_path / "mixed", tmp_path / "pure"
    ran = [subprocess.run([sys.executable, str(chapter), "--out", str(out), *common, *extra], capture_output=True,
                          text=True, timeout=600)
           for out, extra in ((mixed, ["--mixed-precision", "bf16"]), (pure, ["--dtype", "bfloat16"]))]
    for proc in ran:
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((mixed / "run.json").read_text())["config"]["run"]["mixed_precision"] == "bf16"
    summary = json.loads((mixed / "summary.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["settings"]["disable_dropout"] is True
    assert "warning: --dtype bfloat16 trains bfloat16 weights" in ran[1].stderr
    assert "warning" not in ran[0].stderr
    kept, lost = _changed_share(mixed, torch.float32), _changed_share(pure, torch.bfloat16)
    assert kept > 0.9 and lost < 0.3, f"float32 weights + bf16 autocast changed {kept:.1%}; pure bf16 {lost:.1%}"


def test_fp16_mixed_precision_says_it_has_no_loss_scaling(tmp_path):
    """fp16 autocast runs (float32 weights), and a warning says that no GradScaler scales the loss."""
    import subprocess
    import sys
    from pathlib import Path

    chapter = Path(__file__).resolve().parents[1] / "chapters" / "01_single_process.py"
    proc = subprocess.run([sys.executable, str(chapter), "--out", str(tmp_path / "run"), "--steps", "1",
                           "--eval-every", "0", "--checkpoint-every", "0", "--mixed-precision", "fp16"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: --mixed-precision fp16 autocasts without loss scaling" in proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mixed_precision"] == "fp16"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [3, 0])
def test_chapter_04_mixed_precision_keeps_every_update(tmp_path, zero):
    """Stage 4 on 2 ranks, one step at lr 1e-6 with --mixed-precision bf16: ZeRO-3 computes by FSDP2's
    MixedPrecisionPolicy (bf16 products, float32 shards and reduction), DDP (zero 0) under autocast; either way the
    float32 weights take (nearly) every update, and summary.json records the resolved value."""
    from pathlib import Path

    from minirl.runtime.launch import torchrun

    chapter = Path(__file__).resolve().parents[1] / "chapters" / "04_fsdp_lora.py"
    out = tmp_path / "run"
    proc = torchrun(chapter, 2, ["--out", str(out), "--steps", "1", "--learning-rate", "1e-6", "--eval-every", "0",
                                 "--checkpoint-every", "0", "--zero", str(zero), "--mixed-precision", "bf16",
                                 "--no-progress"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["settings"]["mixed_precision"] == "bf16"
    assert summary["config"]["run"]["mixed_precision"] == "bf16" and "warning" not in proc.stdout
    kept = _changed_share(out, torch.float32)
    assert kept > 0.9, f"zero {zero}, float32 weights + bf16 mixed precision changed {kept:.1%}"


def test_a_stage6_worker_runs_each_call_under_the_runs_autocast(make_tiny_policy):
    """Chapter 06's worker (the class itself, without Ray) runs each role's call under the run's autocast, as stage 1
    runs its step: with --mixed-precision bf16 the actor's forward passes give bfloat16 logits while its weights and
    AdamW's state stay float32 and one update at lr 1e-6 changes every trained tensor; with no, float32 logits."""
    from test_packed_update import experience, long_tail_rollout

    from minirl.controller.roles import RoleWorker

    model, tok = make_tiny_policy(seed=3, num_layers=1)
    exp = experience(long_tail_rollout(tok))
    for mode, want in (("bf16", torch.bfloat16), ("no", torch.float32)):
        worker = RoleWorker("shared", 0, 1, threads=0)
        worker.setup(["actor"], RLConfig.from_flat(mixed_precision=mode, learning_rate=1e-6), model, tok)
        actor = worker.roles["actor"].model
        seen = set()
        actor.lm_head.register_forward_hook(lambda _m, _i, output, seen=seen: seen.add(output.dtype))
        start = {n: p.detach().clone() for n, p in actor.named_parameters()}
        worker.call("actor", "update", exp)
        assert seen == {want}, f"--mixed-precision {mode}: logits in {seen}"
        assert {p.dtype for p in actor.parameters()} == {torch.float32}
        state = worker.roles["actor"].optimizer.state.values()
        assert {t.dtype for s in state for k, t in s.items() if k != "step"} == {torch.float32}
        unchanged = [n for n, p in actor.named_parameters() if torch.equal(p.detach(), start[n])]
        assert not unchanged, f"--mixed-precision {mode}: one update at lr 1e-6 left {unchanged} unchanged"
