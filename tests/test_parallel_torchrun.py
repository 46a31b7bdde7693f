"""Stage 4 on two ranks (gloo on CPU): the same losses and weights as the one-process loop, errors on every rank.

One torchrun job (tests/spmd_worker.py) runs every case; the tests read what rank 0 saved.
The one-process reference is notebook 01's loop (`setup` + `stage1_step`) on the same global
batch: both sides sample each prompt from its own seed (`SeedPerPrompt`), so the batch does
not depend on how it is split.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from minirl.config import RLConfig
from minirl.memory.wrap import apply_lora
from minirl.parallel.config import ParallelConfig
from minirl.runtime.launch import torchrun
from minirl.runtime.prompt_seeds import SeedPerPrompt
from minirl.tasks.arithmetic import make_task
from minirl.train.run import run, setup, stage1_step

WORKER = Path(__file__).resolve().parent / "spmd_worker.py"


def _worker():
    spec = importlib.util.spec_from_file_location("minirl_spmd_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_tiny_policy, low_digits = _worker().build_tiny_policy, _worker().low_digits
SMALL = {"steps": 3, "prompts_per_step": 4, "num_generations": 4, "eval_every": 0, "learning_rate": 0.01}
TRAIN = {   # loss_type dapo and grpo, with and without LoRA; every wrapper once; batch std and a KL term;
    "dapo_full_zero3": {"rl": {"loss_type": "dapo"}, "parallel": {"zero": 3}},
    "grpo_full_ddp_batchstd_kl": {"rl": {"loss_type": "grpo", "scale_rewards": "batch", "beta": 0.04},
                                  "parallel": {"zero": 0}},
    "dapo_lora_zero2_merged": {"rl": {"loss_type": "dapo"}, "parallel": {"zero": 2, "lora_rank": 4}},
    "grpo_lora_zero1_adapter": {"rl": {"loss_type": "grpo"},
                                "parallel": {"zero": 1, "lora_rank": 4, "sync_mode": "adapter"}},
    # the update in micro-batches (notebook 01, 11.4): the prompt cache's extra backward under DDP and FSDP2,
    # ranks whose plans may hold different numbers of micro-batches (split_micro_batches evens them)
    "dapo_micro_batches_ddp": {"rl": {"loss_type": "dapo", "max_tokens_per_microbatch": 6}, "parallel": {"zero": 0}},
    "grpo_micro_batches_zero3": {"rl": {"loss_type": "grpo", "max_tokens_per_microbatch": 6},
                                 "parallel": {"zero": 3}},
}
ERRORS = {
    "lora_targets": {"kind": "setup_error", "parallel": {"lora_rank": 4, "lora_target_modules": "q_proj,wq"}},
    "misnamed_tensor": {"kind": "push_error", "sabotage": "rename"},
    "missing_tensor": {"kind": "push_error", "sabotage": "drop"},
    "older_version": {"kind": "push_error", "sabotage": "older"},
}


def cases() -> dict:
    out = {}
    for name, case in TRAIN.items():
        out[name] = {"rl": SMALL | case["rl"], "parallel": {"seed_per_prompt": True} | case["parallel"],
                     "steps": SMALL["steps"]}
    out |= ERRORS
    out["sync_peak"] = {"kind": "sync_peak", "layers": 6, "parallel": {"zero": 3}}
    out["packed_gather"] = {"kind": "packed_gather", "layers": 2, "parallel": {"zero": 3, "lora_rank": 3}}
    out["sync_every"] = {"kind": "sync_every", "steps": 3, "rl": SMALL | {"checkpoint_every": 0},
                         "parallel": {"zero": 3, "sync_every": 2, "colocate": False}}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd")
    (out / "cases.json").write_text(json.dumps(cases()))
    try:
        job = torchrun(WORKER, 2, [out / "cases.json", out], timeout=420)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the two-rank job hung (killed after {err.timeout} s):\n{(err.output or '')[-3000:]}")
    assert job.returncode == 0, job.stdout[-4000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in cases()}


def one_process(case: dict):
    """Notebook 01's loop on the whole batch: records and the final weights."""
    model, tokenizer = build_tiny_policy(seed=1, num_layers=2)
    config, pconfig = RLConfig.from_flat(**case["rl"]), ParallelConfig(**case["parallel"])
    if pconfig.lora_rank:
        model = apply_lora(model, pconfig.lora_rank, pconfig.alpha, pconfig.targets)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    state = setup(config, model, tokenizer, make_task().rows("train"), [low_digits])
    state.engine = SeedPerPrompt(state.engine)
    return run(state, stage1_step, [], case["steps"]), model.state_dict(), initial


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TRAIN))
def test_two_ranks_follow_the_one_process_loop(results, name):
    case = cases()[name]
    records, weights, initial = one_process(case)
    got = results[name]
    assert len(got["records"]) == len(records) == case["steps"]
    for step, (one, two) in enumerate(zip(records, got["records"], strict=True), 1):
        assert two["completion_length"] == one["completion_length"], f"step {step}: another batch was sampled"
        assert two["reward"] == pytest.approx(one["reward"], abs=1e-6), f"step {step}: reward"
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6), f"step {step}: loss"
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), f"step {step}: gradient norm"
    assert sorted(got["weights"]) == sorted(weights)
    moved = max((weights[k] - initial[k]).abs().max().item() for k in weights)
    worst = max((got["weights"][k] - weights[k]).abs().max().item() for k in weights)
    assert worst < 2e-5, f"weights differ by {worst} (the update moved them by up to {moved})"
    assert moved > 100 * worst, "the steps must move the weights, or equality proves nothing"


@pytest.mark.distributed
def test_dapo_ranks_held_unequal_token_counts(results):
    """The dapo case exercises the weight W * T_r / T: some step gave rank 0 a weight other than 1."""
    weights = [r["loss_weight"] for r in results["dapo_full_zero3"]["records"]]
    assert any(abs(w - 1) > 1e-3 for w in weights), weights


@pytest.mark.distributed
@pytest.mark.parametrize("name, match", [
    ("lora_targets", r"ConfigError: lora_target_modules='q_proj,wq': \['wq'\] matches no linear layer"),
    ("misnamed_tensor", r"ValueError: load_weights\(version=1\): unexpected tensor 'model.layers.0.mlp.up.weight'"),
    ("missing_tensor", r"ValueError: load_weights\(version=1\): 1 of \d+ tensors were never pushed"),
    ("older_version", r"VersionMismatchError: load_weights\(version=0\) but .* holds version 3"),
])
def test_bad_input_is_a_named_error_on_every_rank(results, name, match):
    import re

    errors = results[name]["errors"]
    assert len(errors) == 2 and all(e is not None and re.search(match, e) for e in errors), errors


@pytest.mark.distributed
def test_gathering_layer_by_layer_bounds_the_extra_memory(results):
    peak = results["sync_peak"]
    assert 0 < peak["streaming"] <= 1.05 * peak["layer"], peak
    assert peak["dict"] >= 0.9 * peak["whole"] > 2 * peak["streaming"], peak
    # packed: the gathered buffer lives while its whole tensors are cut out of it
    assert peak["layer"] < peak["packed_layer"] <= 2.1 * peak["layer"] < 0.5 * peak["whole"], peak
    assert peak["packed_bucket"] >= 0.9 * peak["whole"], "one bucket for the whole model: a model's memory"


@pytest.mark.distributed
def test_packed_gathering_is_full_tensor_with_one_collective_per_bucket(results):
    got = results["packed_gather"]
    assert got["uneven"], "the case must shard some tensor unevenly (vocabulary 19, LoRA rank 3 on 2 ranks)"
    for way in ("per_layer", "one_bucket"):
        assert got[way]["equal"] and got[way]["shapes"], f"{way}: packed != full_tensor"
    assert got["per_layer"]["calls"] == got["layers"] < got["tensors"], got
    assert got["one_bucket"]["calls"] == 1, got


@pytest.mark.distributed
def test_sync_every_k_generates_with_the_version_the_engine_holds(results):
    got = results["sync_every"]
    assert got["trained_after_one"] and got["stale_after_one"], "step 1 updated the trainer, not the engine"
    assert got["fresh_at_end"], "the last step always pushes"
    records = got["records"]
    assert [r["sync/pushed"] for r in records] == [0, 1, 1]
    assert [r["staleness"] for r in records] == [0, 1, 0], "updates between the generating policy and the trainer"
    assert [r["generated_version"] for r in records] == [0, 0, 1], "the batch's version is the engine's"
    assert [r["version"] for r in records] == [0, 1, 2] and records[0]["sync/bytes"] == 0
