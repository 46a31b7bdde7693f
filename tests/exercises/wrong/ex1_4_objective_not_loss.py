"""Exercise 1.4, wrong: returns the objective to maximize, not the loss (no minus sign)."""

import torch

EXERCISE = "1.4"


def clipped_surrogate(ratio, advantages, epsilon_low=0.2, epsilon_high=None):
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return torch.min(ratio * advantages, clipped * advantages)
