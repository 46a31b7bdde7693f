"""GRPO group advantages and PPO's GAE (minirl.algo.advantages)."""

import pytest
import torch

from minirl.algo.advantages import gae, group_advantages, terminal_rewards, whiten


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()  # unbiased, as TRL
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (std + 1e-4))
    assert adv[4:].abs().max() == 0, "a group with equal rewards carries no signal"
    torch.testing.assert_close(group_advantages(r, 4, "none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    torch.testing.assert_close(group_advantages(r, 4, "batch"), (r - r.view(2, 4).mean(1).repeat_interleave(4))
                               / (r.std() + 1e-4))


def test_group_advantages_zero_mean_per_group():
    r = torch.rand(6 * 5, generator=torch.Generator().manual_seed(0))
    adv = group_advantages(r, 5)
    assert adv.view(6, 5).mean(1).abs().max() < 1e-5


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_generations=1), "num_generations=1"),
    (dict(num_generations=3), "num_generations=3"),
    (dict(num_generations=2, scale_rewards="std"), "scale_rewards"),
])
def test_group_advantages_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(8), **kwargs)


def _gae_reference(rewards, values, mask, gamma, lam):
    B, C = rewards.shape
    adv = torch.zeros(B, C)
    for b in range(B):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * nv - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (1.0, 0.0)])
def test_gae_matches_reference_loop(gamma, lam):
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_gae_lambda_one_gives_monte_carlo_return():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.9]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(ret, torch.ones(1, 3))
    torch.testing.assert_close(adv, 1.0 - values)


def test_terminal_rewards_and_whiten():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = terminal_rewards(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]
    w = whiten(torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]]), mask)
    vals = w[mask.bool()]
    assert vals.mean().abs() < 1e-5 and (vals.var(unbiased=True) - 1).abs() < 1e-3   # unbiased, as TRL/veRL
    assert w[~mask.bool()].abs().max() == 0


def masked_whiten(values, mask, shift_mean=True):
    """TRL's masked_whiten (trl/core.py up to 0.1x; veRL's verl/utils/torch_functional.py), transcribed."""
    mean = (values * mask).sum() / mask.sum()
    variance = ((values - mean) ** 2 * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)                   # masked_var(..., unbiased=True)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def test_whiten_matches_trl_masked_whiten():
    torch.manual_seed(0)
    values, mask = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    ours = whiten(values, mask)
    theirs = masked_whiten(values, mask.float(), shift_mean=True)
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], rtol=1e-5, atol=1e-6)
