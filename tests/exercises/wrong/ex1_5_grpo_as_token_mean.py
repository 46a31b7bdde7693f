"""Exercise 1.5, wrong: "grpo" averages over all tokens (that is bnpo's token_mean), not per row first."""

EXERCISE = "1.5"


def sequence_mean(per_token_loss, mask, max_completion_length=None):
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1)
