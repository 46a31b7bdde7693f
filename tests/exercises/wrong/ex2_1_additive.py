"""Exercise 2.1, wrong: adds epsilon to the probability instead of scaling it (a ratio bound, not a
probability bound).
"""

import torch

EXERCISE = "2.1"


def clip_bounds(old_probs, epsilon=0.2, epsilon_high=None):
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    return old_probs - epsilon, torch.clamp(old_probs + epsilon_high, max=1.0)
