"""Graded checks of notebook 01's exercises (python -m minirl.grade --only 01)."""

import pytest
import torch


@pytest.mark.exercise("1.1")
def test_selective_log_softmax_matches_log_softmax(ex):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    index = torch.randint(7, (2, 3), generator=g)
    out = ex.selective_log_softmax(logits, index)
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    assert out.shape == (2, 3), f"expected shape [B, T] = (2, 3), got {tuple(out.shape)}"
    assert torch.allclose(out, expected, atol=1e-5), "out[b, t] must be log softmax(logits[b, t])[index[b, t]]"


@pytest.mark.exercise("1.1")
def test_selective_log_softmax_is_stable_for_large_logits(ex):
    logits = torch.tensor([[[1000.0, 0.0, -1000.0]]])
    out = ex.selective_log_softmax(logits, torch.tensor([[0]]))
    assert torch.isfinite(out).all(), "use logsumexp: exp(1000) overflows float32"
    assert abs(out.item()) < 1e-5, "the dominant token has log-probability ~0"
    out = ex.selective_log_softmax(logits, torch.tensor([[2]]))
    assert torch.isfinite(out).all() and abs(out.item() + 2000) < 1e-2, \
        "an unlikely token keeps its exact log-probability (-2000 here): log(softmax) underflows to -inf"


@pytest.mark.exercise("1.1")
def test_selective_log_softmax_keeps_the_dtype(ex):
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    index = torch.tensor([[0, 4, 2], [1, 1, 3]])
    out = ex.selective_log_softmax(logits, index)
    assert out.dtype == torch.float64, f"the result has the dtype of the logits (float64 here), got {out.dtype}"
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0), "computed in float64 too, not in float32"


@pytest.mark.exercise("1.1")
def test_selective_log_softmax_probabilities_sum_to_one(ex):
    logits = torch.randn(1, 1, 5, generator=torch.Generator().manual_seed(1))
    total = sum(ex.selective_log_softmax(logits, torch.tensor([[i]])).exp().item() for i in range(5))
    assert abs(total - 1) < 1e-5, f"exp of the log-probs over all tokens must sum to 1, got {total:.6f}"


@pytest.mark.exercise("1.2")
def test_group_advantages_group_scaling(ex):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = ex.group_advantages(r, 4)
    g = r.view(2, 4)
    expected = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
    assert adv.shape == (8,), f"return a flat [B*G] tensor, got shape {tuple(adv.shape)}"
    assert torch.allclose(adv, expected, atol=1e-5), \
        "subtract each group's mean, divide by its unbiased std (torch default) + 1e-4"


@pytest.mark.exercise("1.2")
def test_group_advantages_equal_rewards_give_zero(ex):
    adv = ex.group_advantages(torch.ones(6), 3)
    assert torch.allclose(adv, torch.zeros(6)), "a group whose rewards are all equal has advantage 0 everywhere"


@pytest.mark.exercise("1.2")
def test_group_advantages_batch_and_none(ex):
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    none = ex.group_advantages(r, 2, "none")
    assert torch.allclose(none, torch.tensor([0.5, -0.5, 0.0, 0.0])), "scale_rewards='none': only subtract the mean"
    batch = ex.group_advantages(r, 2, "batch")
    assert torch.allclose(batch, none / (r.std() + 1e-4), atol=1e-5), \
        "scale_rewards='batch': divide by the std of all N rewards + 1e-4"


def _gae_loop(rewards, values, mask, gamma, lam):
    B, C = rewards.shape
    adv = torch.zeros(B, C)
    for b in range(B):
        n, last = int(mask[b].sum()), 0.0
        for t in reversed(range(n)):
            nv = values[b, t + 1] if t + 1 < n else 0.0
            last = rewards[b, t] + gamma * nv - values[b, t] + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


@pytest.mark.exercise("1.3")
def test_gae_matches_the_recursion(ex):
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv, ret = ex.gae(rewards, values, mask, 0.9, 0.8)
    ref_adv, ref_ret = _gae_loop(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(adv, ref_adv, atol=1e-5), "A_t = delta_t + gamma*lam*A_{t+1}, with V = 0 past the row's end"
    assert torch.allclose(ret, ref_ret, atol=1e-5), "returns = advantages + values, 0 where mask is 0"


@pytest.mark.exercise("1.3")
def test_gae_monte_carlo_limit_and_padding(ex):
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.2, 0.4, 0.9, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = ex.gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(ret[:, :3], torch.ones(1, 3)), "gamma = lam = 1: the return is the final reward"
    assert adv[0, 3] == 0 and ret[0, 3] == 0, "positions where mask is 0 must be 0 (ignore their rewards)"


@pytest.mark.exercise("1.4")
def test_clipped_surrogate_values(ex):
    ratio = torch.tensor([[0.5, 1.0, 1.5]])
    pos = ex.clipped_surrogate(ratio, torch.tensor([[2.0]]), 0.2)
    assert torch.allclose(pos, torch.tensor([[-1.0, -2.0, -2.4]])), \
        "A > 0: -min(r*A, clip(r, 0.8, 1.2)*A); a large ratio is capped at 1.2"
    neg = ex.clipped_surrogate(ratio, torch.tensor([[-1.0]]), 0.2)
    assert torch.allclose(neg, torch.tensor([[0.8, 1.0, 1.5]])), \
        "A < 0: the min picks the clipped 0.8 for small ratios, the unclipped r for large ones"


@pytest.mark.exercise("1.4")
def test_clipped_surrogate_gradient_and_clip_higher(ex):
    ratio = torch.tensor([[1.1, 1.25, 1.35]], requires_grad=True)
    loss = ex.clipped_surrogate(ratio, torch.tensor([[1.0]]), 0.2, epsilon_high=0.28)
    assert torch.allclose(loss.detach(), torch.tensor([[-1.1, -1.25, -1.28]])), \
        "epsilon_high sets the upper clip 1 + epsilon_high"
    loss.sum().backward()
    assert torch.allclose(ratio.grad, torch.tensor([[-1.0, -1.0, 0.0]])), \
        "no gradient once the ratio is clipped (use torch.min/torch.clamp, not .item())"


@pytest.mark.exercise("1.4")
def test_clipped_surrogate_sequence_level_ratio_broadcasts(ex):
    ratio = torch.tensor([[1.5], [0.5]])                            # [B, 1]: one ratio per sequence
    advantages = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])  # [B, T]
    loss = ex.clipped_surrogate(ratio, advantages, 0.2)
    assert loss.shape == (2, 3), f"ratio [B, 1] and advantages [B, T] broadcast to [B, T], got {tuple(loss.shape)}"
    assert torch.allclose(loss, torch.tensor([[-1.2, 1.5, -2.4], [-0.5, 0.8, -1.0]]))


PER_TOKEN = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.exercise("1.5")
def test_sequence_mean_averages_rows_first(ex):
    got = ex.sequence_mean(PER_TOKEN, MASK).item()
    assert abs(got - 1.5) < 1e-6, f"grpo: the mean of the rows' means, (1 + 2) / 2 = 1.5, got {got:.4f}"
    got = ex.sequence_mean(torch.ones(2, 3), torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])).item()
    assert abs(got - 0.5) < 1e-6, "an empty row contributes 0 (clamp its token count to 1), then average over rows"


@pytest.mark.exercise("1.6")
def test_token_mean_over_the_batch(ex):
    got = ex.token_mean(PER_TOKEN, MASK).item()
    assert abs(got - 1.2) < 1e-6, f"bnpo/dapo: the masked sum over the batch's tokens, 6 / 5, got {got:.4f}"
    assert ex.token_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0, "an all-masked batch gives 0, not NaN"


@pytest.mark.exercise("1.7")
def test_max_length_mean_divides_by_a_constant(ex):
    got = ex.max_length_mean(PER_TOKEN, MASK).item()
    assert abs(got - 0.75) < 1e-6, f"dr_grpo: the masked sum over B * C = 8 by default, 6 / 8, got {got:.4f}"
    got = ex.max_length_mean(torch.ones(2, 3), torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]), 4).item()
    assert abs(got - 2 / 8) < 1e-6, "dr_grpo: divide by B * max_completion_length when it is given"
