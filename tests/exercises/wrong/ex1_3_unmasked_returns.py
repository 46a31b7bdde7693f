"""Exercise 1.3, wrong: returns advantages + values without masking: padding gets its value back."""

import torch

EXERCISE = "1.3"


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    mask = mask.to(values.dtype)
    B, C = rewards.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype)
    next_advantage = torch.zeros(B, dtype=values.dtype)
    for t in reversed(range(C)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t] * mask[:, t]
    return advantages, advantages + values
