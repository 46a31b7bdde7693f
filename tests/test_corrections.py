"""Truncated / masked importance sampling and vocabulary pruning (minirl.algo.corrections)."""

import math

import pytest
import torch

from minirl.algo.corrections import IS_MODES, importance_sampling_weights, pruned_log_softmax, vocabulary_keep_mask


def trl_reference(old, behavior, mask, mode, cap):
    """TRL 1.16 GRPOTrainer's vllm_importance_sampling_ratio, transcribed (clip_min=None)."""
    diff = (old - behavior) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap).expand_as(old)
    return ratio.masked_fill(ratio > cap, 0.0).expand_as(old)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    behavior = -torch.rand(6, 5, generator=g) * 3                    # [B, C] log-probs
    old = (behavior + torch.randn(6, 5, generator=g) * 0.6).clamp(max=0)
    mask = torch.ones(6, 5)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return old, behavior, mask


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("cap", [0.9, 1.5, 2.0])
def test_matches_trl_on_unmasked_tokens_and_is_zero_elsewhere(batch, mode, cap):
    old, behavior, mask = batch
    w = importance_sampling_weights(old, behavior, mask, mode, cap)
    ref = trl_reference(old, behavior, mask, mode, cap)
    assert w.shape == old.shape
    assert torch.allclose(w[mask.bool()], ref[mask.bool()], atol=1e-6)
    assert (w[~mask.bool()] == 0).all()


def test_truncate_caps_and_mask_drops():
    old = torch.log(torch.tensor([[0.3, 0.5]]))
    behavior = torch.log(torch.tensor([[0.1, 0.5]]))                # ratios 3 and 1
    mask = torch.ones(1, 2)
    assert importance_sampling_weights(old, behavior, mask, "token_truncate", 2.0).tolist() == [[2.0, 1.0]]
    assert torch.allclose(importance_sampling_weights(old, behavior, mask, "token_mask", 2.0),
                          torch.tensor([[0.0, 1.0]]))
    seq = importance_sampling_weights(old, behavior, mask, "sequence_truncate", 5.0)
    assert torch.allclose(seq, torch.full((1, 2), 3.0))
    assert (importance_sampling_weights(old, behavior, mask, "sequence_mask", 2.0) == 0).all()


def test_weights_are_detached_and_ignore_garbage_under_the_mask(batch):
    old, behavior, mask = batch
    old = old.clone().requires_grad_(True)
    behavior = behavior.clone()
    behavior[~mask.bool()] = float("nan")
    for mode in IS_MODES:
        w = importance_sampling_weights(old, behavior, mask, mode, 2.0)
        assert not w.requires_grad
        assert torch.isfinite(w).all()


def test_sequence_overflow_is_capped_not_nan():
    old, behavior = torch.zeros(1, 400), torch.full((1, 400), -5.0)  # exp(2000) overflows
    mask = torch.ones(1, 400)
    assert (importance_sampling_weights(old, behavior, mask, "sequence_truncate", 2.0) == 2.0).all()
    assert (importance_sampling_weights(old, behavior, mask, "sequence_mask", 2.0) == 0.0).all()


def test_bad_input_names_the_problem(batch):
    old, behavior, mask = batch
    with pytest.raises(ValueError, match="mode='tokens'"):
        importance_sampling_weights(old, behavior, mask, "tokens")
    with pytest.raises(ValueError, match="cap=0"):
        importance_sampling_weights(old, behavior, mask, cap=0)
    with pytest.raises(ValueError, match=r"behavior_logps has shape \(6, 4\).*\[B, C\]"):
        importance_sampling_weights(old, behavior[:, :4], mask)
    with pytest.raises(ValueError, match=r"mask has shape"):
        importance_sampling_weights(old, behavior, mask[:3])
    with pytest.raises(ValueError, match="behavior_logps is missing"):
        importance_sampling_weights(old, None, mask)
    with pytest.raises(ValueError, match="behavior_logps has values above 0"):
        importance_sampling_weights(old, behavior.exp(), mask)
    nan = behavior.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"behavior_logps is missing a log-prob .*\[0, 0\]"):
        importance_sampling_weights(old, nan, mask)


def test_loop_calls_it_positionally(batch):
    """The stage-1 loop calls importance_sampling_weights(old, behavior, mask, mode, cap)."""
    old, behavior, mask = batch
    w = importance_sampling_weights(old, behavior, mask, "token_truncate", 2.0)
    assert w.max() <= 2.0


def test_keep_mask_min_p_and_pruned_renormalization():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]]))
    assert vocabulary_keep_mask(logits, 0.0).all()
    keep = vocabulary_keep_mask(logits, 0.2)                        # threshold 0.1 and 0.194
    assert keep.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert vocabulary_keep_mask(logits, 1.0).sum(-1).tolist() == [1, 1]
    lp = pruned_log_softmax(logits, keep)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(2))
    assert torch.isinf(lp[0, 3]) and lp[0, 3] < 0
    assert math.isclose(lp[0, 0].exp().item(), 0.5 / 0.95, rel_tol=1e-5)
    with pytest.raises(ValueError, match="min_p=1.5"):
        vocabulary_keep_mask(logits, 1.5)
    with pytest.raises(ValueError, match="keep has shape"):
        pruned_log_softmax(logits, keep[:, :2])
