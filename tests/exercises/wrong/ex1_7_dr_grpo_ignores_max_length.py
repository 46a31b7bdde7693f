"""Exercise 1.7, wrong: always divides by B * C, ignoring max_completion_length."""

EXERCISE = "1.7"


def max_length_mean(per_token_loss, mask, max_completion_length=None):
    return (per_token_loss * mask).sum() / mask.numel()
