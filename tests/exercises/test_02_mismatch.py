"""Graded checks of notebook 02's exercises (python -m minirl.grade --only 02)."""

import math

import pytest
import torch


@pytest.mark.exercise("2.1")
def test_clip_bounds_source_example(ex):
    low, high = ex.clip_bounds(torch.tensor(0.20), epsilon=0.2)
    assert math.isclose(high.item(), 0.24, rel_tol=1e-6), "p_old = 0.20 at eps = 0.2: the upper bound is 0.24 (r = 1.2)"
    assert math.isclose(low.item(), 0.16, rel_tol=1e-6), "p_old = 0.20 at eps = 0.2: the lower bound is 0.16 (r = 0.8)"


@pytest.mark.exercise("2.1")
def test_clip_bounds_epsilon_high_cap_and_shape(ex):
    low, high = ex.clip_bounds(torch.tensor([0.5, 0.9]), epsilon=0.2, epsilon_high=0.28)
    assert torch.allclose(high, torch.tensor([0.64, 1.0])), \
        "high = p * (1 + epsilon_high), capped at 1: a probability cannot exceed 1"
    assert torch.allclose(low, torch.tensor([0.4, 0.72])), "low = p * (1 - epsilon); epsilon_high does not change it"
    assert low.shape == high.shape == (2,), "both bounds have the shape of old_probs"


@pytest.mark.exercise("2.2")
def test_probability_buckets_counts_and_values(ex):
    behavior = torch.log(torch.tensor([[0.0005, 0.05, 0.3, 0.95]]))
    trainer = torch.log(torch.tensor([[0.001, 0.05, 0.15, 0.95]]))
    mask = torch.tensor([[1, 1, 1, 1]])
    rows = ex.probability_buckets(trainer, behavior, mask)
    assert [r["tokens"] for r in rows] == [1, 0, 1, 1, 0, 1], \
        "bucket by p = exp(behavior_logps) with edges (0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)"
    assert math.isclose(rows[0]["mean_abs_delta"], math.log(2), rel_tol=1e-5), "|trainer - behavior| in log space"
    assert rows[0]["share_outside"] == 1.0 and rows[3]["share_outside"] == 1.0, "ratios 2 and 0.5 leave [0.8, 1.25]"
    assert rows[2]["share_outside"] == 0.0 and rows[2]["max_abs_delta"] < 1e-6
    assert rows[1] == dict(lo=1e-3, hi=1e-2, tokens=0, mean_abs_delta=0.0, max_abs_delta=0.0, share_outside=0.0), \
        "an empty bucket reports tokens 0 and 0.0 statistics, with its lo/hi edges"


@pytest.mark.exercise("2.2")
def test_probability_buckets_mask_and_edges(ex):
    behavior = torch.log(torch.tensor([[0.2, 0.6, 1.0]]))
    trainer = torch.log(torch.tensor([[0.1, 0.6, 1.0]]))
    rows = ex.probability_buckets(trainer, behavior, torch.tensor([[0, 1, 1]]), edges=(0.0, 0.5, 1.0))
    assert len(rows) == 2, "one row per pair of consecutive edges"
    assert [r["tokens"] for r in rows] == [0, 2], "masked tokens do not count; p == 1.0 belongs to the last bucket"
    assert (rows[1]["lo"], rows[1]["hi"]) == (0.5, 1.0)


@pytest.mark.exercise("2.2")
def test_probability_buckets_boundaries_and_clamp(ex):
    behavior = torch.tensor([[-1.0, 1e-6, -3.0]])     # p = exp(-1) exactly on an edge; p slightly above 1
    trainer = torch.zeros(1, 3)
    rows = ex.probability_buckets(trainer, behavior, torch.ones(1, 3), edges=(0.0, math.exp(-1.0), 1.0))
    assert [r["tokens"] for r in rows] == [1, 2], \
        "edges[i] <= p < edges[i+1]: p on an edge belongs to the bucket above; p is clamped to at most 1"
    assert isinstance(rows[0]["tokens"], int), "tokens is a Python int"
    statistics = ("lo", "hi", "mean_abs_delta", "max_abs_delta", "share_outside")
    assert all(isinstance(rows[0][k], float) for k in statistics), \
        "the edges and statistics are Python floats (call .item() on 0-dim tensors)"


@pytest.mark.exercise("2.2")
def test_probability_buckets_low_and_high(ex):
    behavior = torch.log(torch.tensor([[0.2, 0.2, 0.2]]))
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.08]]))          # exp(delta) = 2.5, 2.5, 0.4
    rows = ex.probability_buckets(trainer, behavior, torch.ones(1, 3), edges=(0.0, 1.0), low=0.5, high=3.0)
    assert math.isclose(rows[0]["share_outside"], 1 / 3, rel_tol=1e-6), \
        "outside: exp(trainer - behavior) < low or > high, with the low and high given; only 0.4 is, of 2.5, 2.5, 0.4"


@pytest.mark.exercise("2.3")
def test_stale_parameters_finds_the_planted_stale_tensor(ex):
    w = {"a": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.25, 0.125])}
    rollout = {"a": w["a"].bfloat16(), "b": (w["b"] + 0.01).bfloat16()}
    assert ex.stale_parameters(w, rollout, rel_tol=2 ** -8) == ["b"], \
        "b moved by 0.01 (4-8 %): beyond bf16 rounding (2^-8 relative); a is only a bf16 cast"
    assert ex.stale_parameters(w, {k: v.clone() for k, v in w.items()}) == [], "identical weights: nothing stale"


@pytest.mark.exercise("2.3")
def test_stale_parameters_missing_shapes_and_abs_tol(ex):
    w = {"x": torch.zeros(3), "y": torch.ones(2), "z": torch.ones(2)}
    rollout = {"x": torch.full((3,), 1e-3), "y": torch.ones(3), "extra": torch.ones(1)}
    assert ex.stale_parameters(w, rollout, abs_tol=1e-2) == ["extra", "y", "z"], \
        "report names missing on either side and shape changes, sorted; x is within abs_tol"
    assert ex.stale_parameters(w, rollout) == ["extra", "x", "y", "z"], "with no tolerance x differs too"


@pytest.mark.exercise("2.3")
def test_stale_parameters_tolerance_edges(ex):
    w = {"a": torch.tensor([1.0]), "b": torch.tensor([1.0])}
    rollout = {"a": torch.tensor([1.5]), "b": torch.tensor([2.0])}
    assert ex.stale_parameters(w, rollout, abs_tol=0.5) == ["b"], \
        "a differs by exactly abs_tol: stale only when |rollout - trainer| > abs_tol + rel_tol * |trainer|"
    assert ex.stale_parameters(w, rollout, rel_tol=0.5) == ["b"], \
        "rel_tol is relative to the trainer's value: b moved by 1.0 > 0.5 * |1.0| (not 0.5 * |2.0|)"
    assert ex.stale_parameters(w, rollout, rel_tol=1.0) == [], "b moved by 1.0, not more than 1.0 * |1.0|"


@pytest.mark.exercise("2.4")
def test_importance_sampling_weights_token_modes(ex):
    old = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    behavior = torch.log(torch.tensor([[0.1, 0.5, 0.4]]))          # ratios 3, 1, 0.5
    mask = torch.tensor([[1, 1, 0]])
    w = ex.importance_sampling_weights(old, behavior, mask, "token_truncate", 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0]])), "truncate: min(ratio, cap), 0 on masked tokens"
    w = ex.importance_sampling_weights(old, behavior, mask, "token_mask", 2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0]])), "mask: ratio if ratio <= cap else 0"
    w = ex.importance_sampling_weights(old.clone().requires_grad_(), behavior, mask)
    assert not w.requires_grad, "the weights must be detached (no gradient flows through them)"


@pytest.mark.exercise("2.4")
def test_importance_sampling_weights_sequence_modes(ex):
    old = torch.log(torch.tensor([[0.3, 0.6, 0.9], [0.5, 0.5, 0.5]]))
    behavior = torch.log(torch.tensor([[0.2, 0.5, 0.1], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    seq = 1.5 * 1.2                                                  # the masked third token does not count
    w = ex.importance_sampling_weights(old, behavior, mask, "sequence_truncate", 5.0)
    assert torch.allclose(w, torch.tensor([[seq, seq, 0.0], [1.0, 1.0, 1.0]]), atol=1e-5), \
        "sequence level: exp(sum of old - behavior over mask==1 tokens), broadcast to the sequence's tokens"
    w = ex.importance_sampling_weights(old, behavior, mask, "sequence_mask", 1.5)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])), \
        "sequence_mask: a sequence whose ratio exceeds the cap gets weight 0 on every token"
    w = ex.importance_sampling_weights(old, behavior, mask, "sequence_truncate", 1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 0.0], [1.0, 1.0, 1.0]])), \
        "sequence_truncate: min(sequence ratio, cap) on every token of the sequence"


@pytest.mark.exercise("2.4")
def test_importance_sampling_weights_ignore_garbage_at_masked_positions(ex):
    nan, inf = float("nan"), float("inf")
    old = torch.tensor([[math.log(0.3), nan, nan], [math.log(0.5), math.log(0.5), inf]])
    behavior = torch.tensor([[math.log(0.2), 0.0, inf], [math.log(0.4), nan, -inf]])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0]])
    for mode, cap in (("token_truncate", 2.0), ("token_mask", 2.0), ("sequence_truncate", 2.0), ("sequence_mask", 2.0)):
        w = ex.importance_sampling_weights(old, behavior, mask, mode, cap)
        assert torch.isfinite(w).all(), \
            f"{mode}: NaN/inf log-probs at masked positions must not leak (x * 0 is NaN for x = NaN or inf: use where)"
        assert torch.allclose(w, torch.tensor([[1.5, 0.0, 0.0], [1.25, 0.0, 0.0]])), f"{mode}: 0 where mask is 0"


@pytest.mark.exercise("2.4")
def test_importance_sampling_weights_cap_is_inclusive_and_dtype_kept(ex):
    old = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]], dtype=torch.float64)
    behavior = old.clone()                                         # every ratio is exactly 1.0
    mask = torch.tensor([[1, 1], [1, 0]])
    for mode in ("token_mask", "sequence_mask"):
        w = ex.importance_sampling_weights(old, behavior, mask, mode, 1.0)
        assert torch.equal(w, mask.double()), f"{mode}: a ratio equal to the cap is kept (ratio <= cap), not zeroed"
        assert w.dtype == torch.float64, f"{mode}: the weights have old_logps' dtype (float64 here), got {w.dtype}"
    w = ex.importance_sampling_weights(old, behavior, mask, "token_truncate", 2.0)
    assert w.dtype == torch.float64, f"token_truncate: the weights have old_logps' dtype, got {w.dtype}"


@pytest.mark.exercise("2.5")
def test_vocabulary_keep_mask_threshold(ex):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert ex.vocabulary_keep_mask(logits, 0.2).tolist() == [[True, True, True, False]], \
        "keep p >= min_p * max p: threshold 0.1 keeps 0.5, 0.3, 0.15"
    assert ex.vocabulary_keep_mask(logits, 0.0).all(), "min_p = 0 keeps the whole vocabulary"
    assert ex.vocabulary_keep_mask(logits * 3, 0.2).dtype == torch.bool


@pytest.mark.exercise("2.5")
def test_vocabulary_keep_mask_batched_and_top_kept(ex):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)) * 4
    keep = ex.vocabulary_keep_mask(logits, 1.0)
    assert keep.shape == logits.shape, "same shape as the logits [..., V]"
    assert torch.equal(keep.sum(-1), torch.ones(2, 3, dtype=torch.long)), "min_p = 1 keeps exactly the top token"
    assert keep.gather(-1, logits.argmax(-1, keepdim=True)).all(), "the most probable token is always kept"


@pytest.mark.exercise("2.5")
def test_vocabulary_keep_mask_ties_at_the_top(ex):
    logits = torch.tensor([[2.0, 2.0, 0.0], [1.0, 3.0, 3.0]])
    assert ex.vocabulary_keep_mask(logits, 1.0).tolist() == [[True, True, False], [False, True, True]], \
        "min_p = 1 keeps the most probable token(s): tied top tokens are all kept (p >= min_p * max p)"
