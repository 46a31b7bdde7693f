"""Exercise 1.5, wrong: "dr_grpo" always divides by B * C, ignoring max_completion_length."""

from minirl.algo.logprobs import masked_mean

EXERCISE = "1.5"


def aggregate_loss(per_token_loss, mask, loss_type="dapo", max_completion_length=None):
    mask = mask.to(per_token_loss.dtype)
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type == "grpo":
        return masked_mean(per_token_loss, mask, dim=-1).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / mask.numel()
    return masked_mean(per_token_loss, mask)
