# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Advantages: group-normalized (GRPO, no critic) and GAE (PPO, with a critic).

GRPO's follow TRL's GRPOTrainer (no NaN-aware means); GAE the classic recursion over a
right-padded completion, as TRL's PPOTrainer and veRL's `compute_gae_advantage_return`.
"""

__all__ = ["group_advantages", "gae", "whiten", "terminal_rewards"]

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.runtime.arg_checks import check_group_rewards


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a std.

    rewards: [N] float, N = B * G in generation order (rows i*G .. i*G+G-1 are the G
    completions of prompt i). Returns advantages [N] float:
      A = r - mean(r over its group)
      scale_rewards="group": A / (std(r over its group) + 1e-4)
      scale_rewards="batch": A / (std(r over all N) + 1e-4)
      scale_rewards="none":  A unchanged.
    std is torch's default unbiased std (divides by n - 1), as TRL. ValueError for bad arguments.
    """
    check_group_rewards(rewards, num_generations, scale_rewards)
    grouped = rewards.view(-1, num_generations)                           # [B, G]
    advantages = grouped - grouped.mean(1, keepdim=True)                  # [B, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.reshape(-1)                                         # [N]


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over completion tokens.

    rewards, values: [B, C] float (per-token reward and critic value V(s_t));
    mask: [B, C], 1 on the completion's tokens, a prefix of each row (right padding).
    With V(s_t) = 0 beyond the last real token of a row:
      delta_t = rewards_t + gamma * V(s_{t+1}) - V(s_t)
      A_t     = delta_t + gamma * lam * A_{t+1}          (A = 0 beyond the row's end)
      R_t     = A_t + V(s_t)
    Returns (advantages [B, C], returns [B, C]), both 0 where mask is 0.
    """
    mask = mask.to(values.dtype)
    B, C = rewards.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(C)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t] * mask[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - masked mean) / masked std over the batch's tokens; 0 where mask is 0.

    values, mask: [B, C]. The variance is the unbiased one (sum of squares over n - 1 for the
    n unmasked tokens), as TRL's and veRL's `masked_whiten` compute it.
    """
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards [B, C]: rewards[b] [B] on row b's last completion token, 0 elsewhere."""
    last = (mask.long().sum(1) - 1).clamp(min=0)                          # [B]
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return out.scatter(1, last[:, None], rewards[:, None]) * mask
