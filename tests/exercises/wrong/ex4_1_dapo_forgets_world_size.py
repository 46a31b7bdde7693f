"""Exercise 4.1, wrong: dapo's weight is local / global tokens, without the world size (DDP averages, so the
gradient comes out W times too small)."""

EXERCISE = "4.1"


def rank_loss_weight(loss_type, local_tokens, global_tokens, local_rows, global_rows, world_size):
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"loss_type={loss_type!r}")
    if loss_type == "dapo":
        return max(local_tokens, 1) / max(global_tokens, 1)
    if loss_type in ("grpo", "dr_grpo"):
        return world_size * local_rows / global_rows
    return 1.0
