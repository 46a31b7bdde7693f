"""The clipped objective, loss aggregation, GSPO, KL and value loss (minirl.algo.losses)."""

import pytest
import torch

from minirl.algo.losses import aggregate_loss, clipped_surrogate, kl_k3, policy_loss, value_loss


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
