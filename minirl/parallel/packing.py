# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Sequence packing: variable-length sequences into fixed token budgets (a plan: bins of sequence
indices), and training on the packs with the padded batch's loss. RL does not split a trajectory,
so a sequence longer than the budget is an error."""

__all__ = ["next_fit", "best_fit_decreasing", "utilization", "pack_sequences",
           "block_diagonal_mask", "packed_loss"]

import torch
from torch import Tensor

from minirl.runtime.moe_checks import PackingError, check_lengths


def next_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Arrival order; a new bin whenever the next sequence does not fit in the current one."""
    check_lengths(lengths, budget)
    bins, room = [], 0
    for i, n in enumerate(lengths):
        if n > room:
            bins.append([])
            room = budget
        bins[-1].append(i)
        room -= n
    return bins


def best_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """A packing plan: sequences longest first, each into the bin it fills best.

    lengths: token count of each sequence (ints in 1..budget). budget: tokens per bin.
    Visit the sequences by decreasing length (ties: lower index first); put each into the
    open bin with the least room left among those it fits in (ties: the earliest opened);
    open a new bin when none fits. Returns a list of bins in the order they were opened, each
    a list of sequence indices in the order they were added. Every index appears exactly
    once and no bin's lengths sum above budget. Raises PackingError (via check_lengths)
    for a length above the budget.
    """
    check_lengths(lengths, budget)
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [j for j, r in enumerate(room) if r >= lengths[i]]
        if fits:
            j = min(fits, key=lambda j: (room[j], j))
        else:
            bins.append([])
            room.append(budget)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


def utilization(lengths: list[int], bins: list[list[int]], budget: int) -> float:
    """Real tokens over bin capacity: sum(lengths) / (len(bins) x budget)."""
    return sum(lengths[i] for b in bins for i in b) / (len(bins) * budget)


def pack_sequences(sequences: list[list[int]], bins: list[list[int]], budget: int,
                   pad_token_id: int) -> dict[str, Tensor]:
    """One row of `budget` tokens per bin: input_ids, position_ids, labels, seq_ids, [R, budget].

    Each sequence's positions restart at 0; its first token's label is -100, as is every padding
    label. seq_ids numbers the sequences of a row 0, 1, ... and marks the padding tail -1; the
    tail gets positions of its own, so it is a separate block.
    """
    check_lengths([len(s) for s in sequences], budget)
    R = len(bins)
    ids = torch.full((R, budget), pad_token_id, dtype=torch.long)
    pos = torch.zeros((R, budget), dtype=torch.long)
    labels = torch.full((R, budget), -100, dtype=torch.long)
    seq = torch.full((R, budget), -1, dtype=torch.long)
    for r, members in enumerate(bins):
        t = 0
        for k, i in enumerate(members):
            n = len(sequences[i])
            if t + n > budget:
                raise PackingError(f"bin {r} holds {t + n} tokens > budget={budget}: "
                                   "the plan does not fit")
            ids[r, t:t + n] = torch.tensor(sequences[i])
            pos[r, t:t + n] = torch.arange(n)
            labels[r, t + 1:t + n] = ids[r, t + 1:t + n]
            seq[r, t:t + n] = k
            t += n
        pos[r, t:] = torch.arange(budget - t)
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "seq_ids": seq}


def block_diagonal_mask(seq_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive attention mask [R, 1, T, T] from seq_ids [R, T]: 0 where query t may attend to key
    s (s <= t, same sequence, or both in the padding tail), the dtype's minimum elsewhere."""
    T = seq_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()                     # [T, T]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]                     # [R, T, T]
    allowed = (same & causal)[:, None]                                     # [R, 1, T, T]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_loss(model, pack: dict[str, Tensor], how: str = "position_ids") -> Tensor:
    """The causal-LM loss of packed rows: `how` = "position_ids" (transformers detects the packing
    from the position resets, attention_mask=None) or "mask" (our block-diagonal mask)."""
    if how not in ("position_ids", "mask"):
        raise ValueError(f"how={how!r}: use 'position_ids' or 'mask'")
    mask = None
    if how == "mask":
        mask = block_diagonal_mask(pack["seq_ids"], next(model.parameters()).dtype)
    return model(input_ids=pack["input_ids"], position_ids=pack["position_ids"],
                 attention_mask=mask, labels=pack["labels"]).loss
