"""Graded checks of notebook 07's exercises (python -m minirl.grade --only 07)."""

import math

import pytest
import torch


def error_of(fn, *args, **kwargs):
    """The exception fn(*args) raises, or None (checked with an assert: a missing error fails the check)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # any exception is an answer to check
        return err
    return None


@pytest.mark.exercise("7.1")
def test_sync_step_idle_trainer_waits_for_the_slowest(ex):
    out = ex.sync_step_idle([0.1] * 8 + [2.0], train_seconds=0.5)
    assert math.isclose(out["trainer"], 2.0 / 2.5), \
        "the trainer idles until the slowest trajectory ends: max(durations) / (max(durations) + train_seconds)"
    out = ex.sync_step_idle([1.0, 3.0], train_seconds=1.0)
    assert math.isclose(out["trainer"], 0.75), "max 3 s of a 4 s step: 0.75 (not the mean, not the sum)"


@pytest.mark.exercise("7.1")
def test_sync_step_idle_rollout_slots_wait_for_the_slowest_and_the_update(ex):
    out = ex.sync_step_idle([1.0, 2.0, 4.0], train_seconds=1.0)
    assert math.isclose(out["rollout"], (4 + 3 + 1) / 15), \
        "slot i idles T - d_i of the step T = 5 s (waiting for the slowest, then for the update): mean of (T - d_i) / T"
    out = ex.sync_step_idle([2.0, 2.0], train_seconds=0.0)
    assert out == {"trainer": 1.0, "rollout": 0.0}, "equal durations, no update: the slots never wait"


@pytest.mark.exercise("7.1")
def test_sync_step_idle_edge_cases(ex):
    assert ex.sync_step_idle([0.0, 0.0], train_seconds=0.0) == {"trainer": 0.0, "rollout": 0.0}, \
        "a step of zero seconds: both shares 0 (no division by zero)"
    assert isinstance(error_of(ex.sync_step_idle, [], 1.0), ValueError), "no durations: ValueError"
    assert isinstance(error_of(ex.sync_step_idle, [1.0, -0.5], 1.0), ValueError), "a negative duration: ValueError"
    assert isinstance(error_of(ex.sync_step_idle, [1.0], -1.0), ValueError), "a negative update time: ValueError"


@pytest.mark.exercise("7.2")
def test_admit_within_the_bound(ex):
    assert ex.admit(5, 5, 0) is True, "a fresh trajectory is always admitted"
    assert ex.admit(5, 3, 2) is True, "2 versions behind with eta = 2: admitted (the bound is inclusive)"
    assert ex.admit(5, 2, 2) is False, "3 versions behind with eta = 2: too stale"
    assert ex.admit(7, 6, 0) is False, "eta = 0 admits only the trainer's own version (synchronous RL)"


@pytest.mark.exercise("7.2")
def test_admit_refuses_future_versions_and_bad_bounds(ex):
    err = error_of(ex.admit, 3, 4, 2)
    assert isinstance(err, ex.FutureVersionError) and "4" in str(err) and "3" in str(err), \
        "a version newer than the trainer's: FutureVersionError naming both versions (never False: it is a bug)"
    err = error_of(ex.admit, 3, 3, -1)
    assert isinstance(err, ValueError) and "max_staleness" in str(err), "eta < 0: a ValueError naming max_staleness"


@pytest.mark.exercise("7.3")
def test_clipped_token_weight_by_hand(ex):
    current = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.5, -0.5]])
    behaviour = torch.tensor([[-1.5, -1.0, -0.4], [-0.45, -0.6, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = ex.clipped_token_weight(current, behaviour, mask)
    expected = torch.tensor([[1.2, 0.8, 0.0], [math.exp(-0.05), math.exp(0.1), 1.0]])
    assert torch.allclose(w, expected, atol=1e-6), \
        "exp(current - behaviour) clamped to [0.8, 1.2]; 0 on padding (mask 0)"
    w = ex.clipped_token_weight(current, behaviour, mask, low=0.5, high=2.0)
    assert torch.allclose(w[0], torch.tensor([math.exp(0.5), 0.5, 0.0]), atol=1e-6), "low and high are the bounds"


@pytest.mark.exercise("7.3")
def test_clipped_token_weight_masks_garbage_and_has_no_gradient(ex):
    current = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, float("nan")]])
    w = ex.clipped_token_weight(current, behaviour, torch.tensor([[1, 0]]))
    assert torch.equal(w, torch.tensor([[1.0, 0.0]])), "a NaN log-prob under mask 0 must give weight 0, not NaN"
    assert not w.requires_grad, "the weight is data (detached): no gradient flows through it"
    assert w.dtype == torch.float32


@pytest.mark.exercise("7.3")
def test_clipped_token_weight_refuses_an_interval_without_one(ex):
    x = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.long)
    assert isinstance(error_of(ex.clipped_token_weight, x, x, m, low=1.1, high=1.2), ValueError), \
        "low > 1 would push every weight away from 1 (no correction): ValueError"
    assert isinstance(error_of(ex.clipped_token_weight, x, x, m, low=0.0, high=1.2), ValueError), "low must be > 0"
