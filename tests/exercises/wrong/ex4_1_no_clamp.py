"""Exercise 4.1, wrong: divides by the raw token counts, so an empty batch divides by zero."""

EXERCISE = "4.1"


def rank_loss_weight(loss_type, local_tokens, global_tokens, local_rows, global_rows, world_size):
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"loss_type={loss_type!r}")
    if loss_type == "dapo":
        return world_size * local_tokens / global_tokens
    if loss_type in ("grpo", "dr_grpo"):
        return world_size * local_rows / global_rows
    return 1.0
