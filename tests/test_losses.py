"""The clipped objective, loss aggregation, GSPO, KL and value loss (minirl.algo.losses), and the loss registry
(minirl.loss_types): every entry complete, CISPO added through it alone."""

import dataclasses

import pytest
import torch

from minirl.algo.losses import kl_k3, policy_loss, value_loss
from minirl.config import RLConfig
from minirl.loss_types import (
    LOSS_TYPES,
    LossType,
    aggregate_loss,
    clipped_surrogate,
    loss_type_entry,
    register_loss_type,
    token_mean,
)
from minirl.runtime.validate import ConfigError


def test_clipped_surrogate_values_and_gradients():
    ratio = torch.tensor([[0.5, 1.0, 1.1, 1.5]], requires_grad=True)
    adv = torch.tensor([[1.0]])
    loss = clipped_surrogate(ratio, adv, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.1, -1.2]]))
    loss.sum().backward()
    assert ratio.grad.tolist() == [[-1.0, -1.0, -1.0, 0.0]], "above 1 + eps with A > 0 the gradient stops"


def test_clipped_surrogate_negative_advantage_and_clip_higher():
    ratio = torch.tensor([[0.5, 1.3]])
    torch.testing.assert_close(clipped_surrogate(ratio, torch.tensor([[-1.0]]), 0.2), torch.tensor([[0.8, 1.3]]))
    torch.testing.assert_close(clipped_surrogate(ratio, torch.tensor([[1.0]]), 0.2, epsilon_high=0.28),
                               torch.tensor([[-0.5, -1.28]]))


def test_aggregate_loss_four_types():
    per_tok = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate_loss(per_tok, mask, "grpo").item() == pytest.approx((1.0 + 2.0) / 2)
    assert aggregate_loss(per_tok, mask, "bnpo").item() == pytest.approx(6.0 / 5)
    assert aggregate_loss(per_tok, mask, "dapo").item() == pytest.approx(6.0 / 5)
    assert aggregate_loss(per_tok, mask, "dr_grpo").item() == pytest.approx(6.0 / 8)
    assert aggregate_loss(per_tok, mask, "dr_grpo", max_completion_length=6).item() == pytest.approx(6.0 / 12)
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        aggregate_loss(per_tok, mask, "ppo")


def test_kl_k3_nonnegative_zero_at_equality():
    a = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    b = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    assert (kl_k3(a, b) >= 0).all()
    assert kl_k3(a, a).abs().max() == 0


def test_on_policy_gradient_is_reinforce():
    """With old = logps.detach() the ratio is 1 and the gradient is -A * grad(logp) / tokens."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = policy_loss(logps, logps.detach(), adv, mask, loss_type="bnpo")
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0], [2.0, 0.0]]) / 3)
    assert metrics["clip_ratio/region_mean"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)


def test_sequence_level_ratio_is_geometric_mean():
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.1, -1.9, -3.3]])
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([1.0])
    loss_seq, _ = policy_loss(logps, old, adv, mask, importance_sampling_level="sequence", epsilon=10)
    ratio = torch.exp(torch.tensor((0.1 - 0.1) / 2))
    assert loss_seq.item() == pytest.approx(-ratio.item())
    loss_tok, _ = policy_loss(logps, old, adv, mask, epsilon=10)
    assert loss_tok.item() == pytest.approx(-(torch.exp(torch.tensor(0.1)) + torch.exp(torch.tensor(-0.1))).item() / 2)


def test_beta_adds_k3_kl_and_metrics():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    base, _ = policy_loss(logps, logps, torch.tensor([0.0]), mask)
    with_kl, m = policy_loss(logps, logps, torch.tensor([0.0]), mask, beta=0.1, ref_logps=ref)
    kl = kl_k3(logps, ref)
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * kl.mean().item())
    assert m["kl"] == pytest.approx(kl.mean().item())
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logps"):
        policy_loss(logps, logps, torch.tensor([0.0]), mask, beta=0.1)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(logps, logps, torch.tensor([0.0]), mask, importance_sampling_level="seq")


def test_bias_corrected_kl_is_weighted_by_the_importance_ratio():
    """use_bias_correction_kl (TRL 1.16's default): k3 KL times pi/pi_old, token or sequence level, with gradient."""
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.2]])
    mask = torch.tensor([[1, 1, 0]])
    zero = torch.tensor([0.0])                                   # no policy term: the loss is beta * KL
    kl = kl_k3(logps.detach(), ref)
    ratio = torch.exp(logps.detach() - old)
    loss, m = policy_loss(logps, old, zero, mask, beta=0.1, ref_logps=ref, use_bias_correction_kl=True)
    expected = (kl * ratio)[:, :2].mean()
    assert loss.item() == pytest.approx(0.1 * expected.item())
    assert m["kl"] == pytest.approx(expected.item()), "the logged KL is the term that was added, as in TRL"
    plain, _ = policy_loss(logps, old, zero, mask, beta=0.1, ref_logps=ref)
    assert abs(plain.item() - loss.item()) > 1e-4, "off-policy, the correction must change the loss"
    seq, _ = policy_loss(logps, old, zero, mask, beta=0.1, ref_logps=ref, importance_sampling_level="sequence",
                         use_bias_correction_kl=True)
    seq_ratio = torch.exp(((logps.detach() - old) * mask).sum() / 2)
    assert seq.item() == pytest.approx(0.1 * (kl[:, :2] * seq_ratio).mean().item())
    # on-policy the ratio is 1: same value, but the gradient gains KL * grad(log pi)
    on = logps.detach().clone().requires_grad_(True)
    corrected, _ = policy_loss(on, on.detach(), zero, mask, loss_type="bnpo", beta=0.1, ref_logps=ref,
                               use_bias_correction_kl=True)
    uncorrected, _ = policy_loss(on, on.detach(), zero, mask, loss_type="bnpo", beta=0.1, ref_logps=ref)
    assert corrected.item() == pytest.approx(uncorrected.item())
    g_corr, = torch.autograd.grad(corrected, on)
    g_plain, = torch.autograd.grad(uncorrected, on)
    torch.testing.assert_close(g_corr - g_plain, 0.1 * kl * mask / 2)


def test_clip_metrics_and_is_weights():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.5]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    _, m = policy_loss(logps, old, torch.tensor([[1.0, -1.0, 1.0, 1.0]]), mask)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    w = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    base, _ = policy_loss(logps, old, torch.tensor([1.0]), mask)
    weighted, _ = policy_loss(logps, old, torch.tensor([1.0]), mask, is_weights=w)
    assert weighted.item() == pytest.approx(0.5 * base.item())


def test_value_loss_clips():
    returns = torch.tensor([[1.0]])
    old = torch.tensor([[0.0]])
    values = torch.tensor([[0.9]], requires_grad=True)
    loss = value_loss(values, old, returns, torch.ones(1, 1), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * max(0.1 ** 2, 0.8 ** 2))
    loss.backward()
    assert values.grad.item() == 0.0, "the clipped term dominates: no gradient"


# ---- the registry --------------------------------------------------------------------------------------------

def test_every_loss_type_is_one_complete_entry():
    assert list(LOSS_TYPES) == ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
    for name, entry in LOSS_TYPES.items():
        assert loss_type_entry(name) is entry
        assert all(callable(getattr(entry, f.name)) for f in dataclasses.fields(LossType)), name


def test_an_entry_that_lacks_a_part_is_refused_when_registered_and_when_the_config_is_built(monkeypatch):
    dapo = LOSS_TYPES["dapo"]
    with pytest.raises(TypeError):
        LossType(objective=dapo.objective, normalise=token_mean, micro_batch_weight=dapo.micro_batch_weight)
    with pytest.raises(ConfigError, match=r"loss_type='half': its entry's rank_weight is None, not a function"):
        register_loss_type("half", dataclasses.replace(dapo, rank_weight=None))
    assert "half" not in LOSS_TYPES
    monkeypatch.setitem(LOSS_TYPES, "half", dataclasses.replace(dapo, micro_batch_weight=None))   # bypassing it
    with pytest.raises(ConfigError, match=r"loss_type='half': its entry's micro_batch_weight is None"):
        RLConfig.from_flat(loss_type="half")
    monkeypatch.setitem(LOSS_TYPES, "tuple", (dapo.objective, token_mean))
    with pytest.raises(ConfigError, match=r"loss_type='tuple': its entry's objective is None, not a function"):
        RLConfig.from_flat(loss_type="tuple")
    with pytest.raises(ConfigError, match=r"loss_type='sapo': use one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"):
        RLConfig.from_flat(loss_type="sapo")


def test_a_registered_loss_type_is_accepted_everywhere(monkeypatch):
    """The seam: a new entry is the only change; the config, the loss and its weights take it by name."""
    monkeypatch.setitem(LOSS_TYPES, "dapo_copy", LOSS_TYPES["dapo"])
    assert RLConfig.from_flat(loss_type="dapo_copy").algorithm.loss_type == "dapo_copy"
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    old = logps + torch.tensor([[0.3, -0.2], [0.1, 0.4]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -2.0])
    assert policy_loss(logps, old, adv, mask, loss_type="dapo_copy") == policy_loss(logps, old, adv, mask)


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    """CISPO (TRL 1.16): -min(ratio, epsilon_high).detach() * A * logp per token, normalized by the tokens."""
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.9, -0.5]])                   # ratios e^0.5 = 1.65, e^-0.1 = 0.90, 1
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = policy_loss(logps, old, adv, mask, loss_type="cispo", epsilon_high=1.2)
    ratio = torch.exp(logps.detach() - old)
    weight = ratio.clamp(max=1.2)
    assert loss.item() == pytest.approx((-(weight * 2.0 * logps.detach())[:, :2]).sum().item() / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, -weight * 2.0 * mask / 2, msg="the gradient flows through logp alone")
    assert logps.grad[0, 0] != 0, "a token whose ratio is clipped keeps its gradient (PPO's would be 0)"
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 2) and m["clip_ratio/low_mean"] == 0.0
    assert m["clip_ratio/region_mean"] == pytest.approx(1 / 2)
    unset, _ = policy_loss(logps, old, adv, mask, loss_type="cispo")      # epsilon_high unset: epsilon, 0.2 (TRL)
    assert unset.item() == pytest.approx((-(0.2 * 2.0 * logps.detach())[:, :2]).sum().item() / 2)
