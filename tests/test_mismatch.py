"""Measuring and diagnosing the training-inference mismatch (minirl.diagnostics.mismatch)."""

import math

import pytest
import torch

from minirl.diagnostics.mismatch import clip_bounds, diagnose_mismatch, mismatch_stats, ppo_ratio, probability_buckets
from minirl.rollout.hf import HFEngine, fp8_round_trip
from minirl.runtime.logprob_checks import check_logprob_pair
from minirl.runtime.logprob_measure import measure_logprobs
from minirl.runtime.sync_checks import check_synchronization, rounding_tolerance
from minirl.sync.checks import stale_parameters


@pytest.fixture(scope="module")
def policy():
    from minirl.models.policy import load_default_policy
    from minirl.tasks.arithmetic import make_task
    model, tokenizer, _ = load_default_policy(progress=False)
    prompts = [row["prompt"] for row in make_task().rows("train")[:4]]
    return model, tokenizer, prompts


def test_source_clipping_arithmetic():
    r = ppo_ratio(torch.tensor(0.24).log(), torch.tensor(0.20).log())
    assert math.isclose(r.item(), 1.2, rel_tol=1e-6)
    # the new-probability interval inside which the clipped objective still moves: [0.8 p, 1.2 p], capped at 1
    low, high = clip_bounds(torch.tensor([0.20, 0.9]))
    assert torch.allclose(low, torch.tensor([0.16, 0.72])) and torch.allclose(high, torch.tensor([0.24, 1.0]))


def test_stats_on_known_values():
    trainer = torch.log(torch.tensor([[0.29, 0.5, 0.9]]))
    behavior = torch.log(torch.tensor([[0.30, 0.25, 0.9]]))
    mask = torch.tensor([[1, 1, 0]])
    s = mismatch_stats(trainer, behavior, mask)
    assert s["tokens"] == 2
    assert math.isclose(s["max_abs_delta"], math.log(2), rel_tol=1e-5)
    assert math.isclose(s["mean_abs_delta"], (math.log(0.30 / 0.29) + math.log(2)) / 2, rel_tol=1e-5)
    assert s["share_outside"] == 0.5                              # ratio 2 is outside, 0.967 inside
    assert s["kl_k3"] > 0
    empty = mismatch_stats(trainer, behavior, torch.zeros_like(mask))
    assert empty["tokens"] == 0 and empty["mean_abs_delta"] == 0.0


def test_bad_input_names_tensor_and_shape():
    t = torch.full((2, 3), -1.0)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"behavior_logps is missing.*\[B, C\]"):
        check_logprob_pair(t, None, m)
    with pytest.raises(ValueError, match=r"behavior_logps has shape \(2, 2\) but trainer_logps has \(2, 3\)"):
        check_logprob_pair(t, t[:, :2], m)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 2\)"):
        check_logprob_pair(t, t, m.T)
    with pytest.raises(ValueError, match=r"trainer_logps: expected a \[B, C\] tensor"):
        check_logprob_pair(t[0], t, m)
    with pytest.raises(ValueError, match="trainer_logps has values above 0"):
        check_logprob_pair(t + 2, t, m)
    bad = t.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"behavior_logps is missing a log-prob at 1 unmasked.*\[1, 2\]"):
        check_logprob_pair(t, bad, m)
    m[1, 2] = 0
    check_logprob_pair(t, bad, m)                                  # NaN under the mask is fine


def test_buckets_partition_the_tokens():
    g = torch.Generator().manual_seed(1)
    behavior = -torch.rand(8, 4, generator=g) * 8
    trainer = (behavior + 0.1 * torch.randn(8, 4, generator=g)).clamp(max=0)
    mask = (torch.rand(8, 4, generator=g) > 0.2).long()
    rows = probability_buckets(trainer, behavior, mask)
    assert sum(r["tokens"] for r in rows) == int(mask.sum())
    total = mismatch_stats(trainer, behavior, mask)
    assert math.isclose(max(r["max_abs_delta"] for r in rows), total["max_abs_delta"], rel_tol=1e-9)


def test_rounding_tolerance_accepts_casts_and_catches_an_update():
    w = torch.randn(64, 64) * 0.05
    for dtype, cast in (("bfloat16", w.bfloat16()), ("float16", w.half()), ("float8_e4m3fn", fp8_round_trip(w))):
        rel, abs_ = rounding_tolerance(dtype, w.abs().max().item())
        assert stale_parameters({"w": w}, {"w": cast}, rel, abs_) == [], dtype
        assert stale_parameters({"w": w}, {"w": (w + 1e-2).to(cast.dtype)}, rel, abs_) == ["w"], dtype
    with pytest.raises(ValueError, match="dtype='int8'"):
        rounding_tolerance("int8")


def test_fp32_rollout_matches_and_bf16_does_not(policy):
    model, tokenizer, prompts = policy
    fp32 = measure_logprobs(model, tokenizer, prompts, "float32", num_generations=2).stats()
    bf16 = measure_logprobs(model, tokenizer, prompts, "bfloat16", num_generations=2).stats()
    assert fp32["tokens"] > 0 and fp32["max_abs_delta"] < 1e-4, fp32
    assert 1e-4 < bf16["max_abs_delta"] < 1.0, bf16


def test_diagnose_finds_a_planted_stale_rollout(policy):
    model, tokenizer, prompts = policy
    rollout = HFEngine(model, tokenizer, dtype="bfloat16")
    assert check_synchronization(model, rollout, trainer_version=0) == []
    trainer = torch.nn.Module()
    import copy
    trainer = copy.deepcopy(model)
    with torch.no_grad():
        trainer.lm_head.weight.add_(0.01)                          # one "update" the rollout never received
    rollout.version = 1                                            # the label moved, the weights did not
    report = diagnose_mismatch(trainer, tokenizer, prompts, rollout=rollout, trainer_version=1, sweep=("float32",),
                      num_generations=2)
    assert report.sync_problems and "synchronization did not complete" in report.sync_problems[0]
    text = str(report)
    assert "PROBLEMS" in text and "float32" in text and "MoE routes: not a mixture" in text
    assert check_synchronization(trainer, rollout, trainer_version=2)[0].startswith("version: the engine holds 1")
