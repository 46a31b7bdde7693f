"""Exercise 2.1, wrong: uses epsilon for the upper bound too."""

import torch

EXERCISE = "2.1"


def clip_bounds(old_probs, epsilon=0.2, epsilon_high=None):
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    return old_probs * (1 - epsilon), torch.clamp(old_probs * (1 + epsilon), max=1.0)
