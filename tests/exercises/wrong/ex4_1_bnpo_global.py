"""Exercise 4.1, wrong: treats bnpo like dapo (TRL's bnpo divides by each process's own tokens)."""

EXERCISE = "4.1"


def rank_loss_weight(loss_type, local_tokens, global_tokens, local_rows, global_rows, world_size):
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"loss_type={loss_type!r}")
    if loss_type in ("dapo", "bnpo"):
        return world_size * max(local_tokens, 1) / max(global_tokens, 1)
    return world_size * local_rows / global_rows
