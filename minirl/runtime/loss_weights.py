"""How much a part of a batch counts when its loss is computed on its own: micro-batches and ranks.

Hand-written helpers of the loss registry (`minirl.loss_types`). Every aggregation of a
GRPO-family loss is a sum of per-row terms over one normalizer: rows for "grpo" (a mean of
per-row means) and "dr_grpo" (B x max_completion_length), tokens for "bnpo", "dapo" and
"cispo". So a part's weight is its share of that normalizer:

- a micro-batch's (`micro_batch_weight`, notebook 01 section 10.3): `by_rows` or `by_tokens`,
  so that the micro-batches' weighted losses, and gradients, add up to the whole batch's;
- a data-parallel rank's (`rank_weight`, notebook 04): W processes average their gradients,
  so rank r's loss is weighted by W times its share (`ranks_by_rows`, `ranks_by_tokens`), except
  for "bnpo", which TRL normalizes by each process's own tokens (`each_rank_alone`, weight 1:
  there, and only there, "bnpo" and "dapo" part ways).

Plain arithmetic on ints and floats (no torch), like the registry that uses them.
"""


def by_rows(rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """A part's share of a normalizer that counts rows ("grpo", "dr_grpo")."""
    return rows / total_rows


def by_tokens(rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """A part's share of a normalizer that counts tokens, both clamped to 1 as the normalization clamps them."""
    return max(tokens, 1) / max(total_tokens, 1)


def ranks_by_rows(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int, world_size: int) -> float:
    """W * N_r / N: a rank's weight when the batch's loss counts rows (0 for a rank with no rows)."""
    return world_size * by_rows(local_rows, global_rows, local_tokens, global_tokens)


def ranks_by_tokens(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int,
                    world_size: int) -> float:
    """W * T_r / T: a rank's weight when the batch's loss divides by the tokens of all ranks (TRL's
    `num_items_in_batch`)."""
    return world_size * by_tokens(local_rows, global_rows, local_tokens, global_tokens)


def each_rank_alone(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int,
                    world_size: int) -> float:
    """1: each rank normalizes by its own tokens and the batch's loss is the mean of the ranks' ("bnpo")."""
    return 1.0
