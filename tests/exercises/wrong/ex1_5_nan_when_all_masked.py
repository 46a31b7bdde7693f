"""Exercise 1.5, wrong: divides by the token count without clamping it: an all-masked batch gives NaN."""

EXERCISE = "1.5"


def aggregate_loss(per_token_loss, mask, loss_type="dapo", max_completion_length=None):
    mask = mask.to(per_token_loss.dtype)
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1)).mean()
    if loss_type == "dr_grpo":
        length = mask.shape[1] if max_completion_length is None else max_completion_length
        return (per_token_loss * mask).sum() / (mask.shape[0] * length)
    return (per_token_loss * mask).sum() / mask.sum()
