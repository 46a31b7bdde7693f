"""Exercise 1.5, wrong: "grpo" averages over all tokens (that is bnpo), not per row first."""

from minirl.algo.logprobs import masked_mean

EXERCISE = "1.5"


def aggregate_loss(per_token_loss, mask, loss_type="dapo", max_completion_length=None):
    mask = mask.to(per_token_loss.dtype)
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type == "dr_grpo":
        length = mask.shape[1] if max_completion_length is None else max_completion_length
        return (per_token_loss * mask).sum() / (mask.shape[0] * length)
    return masked_mean(per_token_loss, mask)
