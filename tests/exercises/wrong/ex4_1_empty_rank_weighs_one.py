"""Exercise 4.1, wrong: a rank that holds no rows keeps its loss as it is (w = 1) instead of counting for nothing."""

EXERCISE = "4.1"


def rank_loss_weight(loss_type, local_tokens, global_tokens, local_rows, global_rows, world_size):
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"loss_type={loss_type!r}")
    if loss_type == "dapo":
        return world_size * max(local_tokens, 1) / max(global_tokens, 1)
    if loss_type in ("grpo", "dr_grpo"):
        if local_rows == 0:                   # "nothing to scale": leave the weight neutral
            return 1.0
        return world_size * local_rows / global_rows
    return 1.0
