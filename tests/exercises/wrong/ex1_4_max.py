"""Exercise 1.4, wrong: takes the max of the two terms: the pessimistic bound turned optimistic."""

import torch

EXERCISE = "1.4"


def clipped_surrogate(ratio, advantages, epsilon_low=0.2, epsilon_high=None):
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.max(ratio * advantages, clipped * advantages)
