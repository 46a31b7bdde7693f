"""Exercise 2.1, wrong: does not cap the upper bound at 1: 0.9 * 1.28 = 1.152 is no probability."""

EXERCISE = "2.1"


def clip_bounds(old_probs, epsilon=0.2, epsilon_high=None):
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    return old_probs * (1 - epsilon), old_probs * (1 + epsilon_high)
