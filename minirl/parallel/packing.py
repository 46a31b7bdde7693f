# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Sequence packing: variable-length sequences into fixed token budgets, and training on the packs.

A packing plan is a list of bins, each a list of sequence indices whose lengths sum to at most
`budget` tokens. `next_fit` fills bins in arrival order; `first_fit_decreasing` and
`best_fit_decreasing` sort the sequences longest first and put each into the first bin where
it fits, or the fullest one (best fit: least space left); `utilization` is the share of the
bins' tokens that are real. Without packing, a micro-batch of sequences is padded to its
longest (`padded_utilization`).

A pack is trained as one row in which every sequence restarts its positions at 0 and attends
only to itself: `pack_sequences` builds the row (input ids, position ids, labels, sequence
ids), `block_diagonal_mask` the explicit [R, 1, T, T] mask; transformers also recognizes
packing from position ids alone (attention_mask=None) and builds the same mask. Either way the
loss and gradients equal those of the padded batch (tests/test_packing.py).

Simplified on purpose: one pass of a classic bin-packing heuristic (Best-fit Packing, Ding
et al. 2024, also splits documents longer than the budget; RL does not split a trajectory,
so a sequence longer than the budget is an error here).
"""

__all__ = ["PackingError", "check_lengths", "next_fit", "first_fit_decreasing",
           "best_fit_decreasing", "PACKERS", "utilization", "padded_utilization", "pack_sequences",
           "block_diagonal_mask", "pad_sequences", "packed_loss", "padded_loss",
           "long_tail_lengths", "micro_batch_spread", "time_packed_vs_padded"]

import torch
from torch import Tensor


class PackingError(ValueError):
    """A sequence that cannot be packed as asked; the message names it and the fix."""


def check_lengths(lengths: list[int], budget: int) -> None:
    """Raise PackingError unless every length is an int in 1..budget."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise PackingError(f"budget={budget!r}: must be an int >= 1 (tokens per pack)")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PackingError(f"lengths[{i}]={n!r}: every sequence needs at least one token")
        if n > budget:
            raise PackingError(f"lengths[{i}]={n} is longer than the pack budget={budget}: raise the budget to at "
                               f"least {max(lengths)}, or cap generation (max_completion_length) below it")


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


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Longest first; each sequence into the first (oldest) bin with room, else a new bin."""
    check_lengths(lengths, budget)
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
        if j is None:
            bins.append([])
            room.append(budget)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lengths[i]
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


PACKERS = {"next_fit": next_fit, "first_fit_decreasing": first_fit_decreasing,
           "best_fit_decreasing": best_fit_decreasing}


def utilization(lengths: list[int], bins: list[list[int]], budget: int) -> float:
    """Real tokens over bin capacity: sum(lengths) / (len(bins) x budget)."""
    return sum(lengths[i] for b in bins for i in b) / (len(bins) * budget)


def padded_utilization(lengths: list[int], batch_size: int) -> float:
    """No packing: micro-batches of `batch_size` sequences in arrival order, each padded to its longest."""
    if batch_size < 1:
        raise PackingError(f"batch_size={batch_size}: must be >= 1")
    batches = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    return sum(lengths) / sum(len(b) * max(b) for b in batches)


def pack_sequences(sequences: list[list[int]], bins: list[list[int]], budget: int,
                   pad_token_id: int) -> dict[str, Tensor]:
    """One row of `budget` tokens per bin: input_ids, position_ids, labels, seq_ids, each [R, budget] long.

    Each sequence's positions restart at 0; its first token's label is -100 (so the previous
    sequence's last token is not trained to predict it: HF shifts labels by one inside the
    loss), as is every padding label. seq_ids numbers the sequences of a row 0, 1, ... and
    marks the padding tail -1; the tail gets positions of its own, so it is a separate block.
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
                raise PackingError(f"bin {r} holds {t + n} tokens > budget={budget}: the plan does not fit")
            ids[r, t:t + n] = torch.tensor(sequences[i])
            pos[r, t:t + n] = torch.arange(n)
            labels[r, t + 1:t + n] = ids[r, t + 1:t + n]
            seq[r, t:t + n] = k
            t += n
        pos[r, t:] = torch.arange(budget - t)
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "seq_ids": seq}


def block_diagonal_mask(seq_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive attention mask [R, 1, T, T] from seq_ids [R, T]: 0 where query t may attend to key s
    (s <= t, same sequence, or both in the padding tail), the dtype's minimum elsewhere."""
    T = seq_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()                          # [T, T]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]                          # [R, T, T]
    allowed = (same & causal)[:, None]                                          # [R, 1, T, T]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def pad_sequences(sequences: list[list[int]], pad_token_id: int) -> dict[str, Tensor]:
    """The unpacked reference: right-padded input_ids, attention_mask, labels (-100 on padding), [B, T]."""
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_loss(model, pack: dict[str, Tensor], how: str = "position_ids") -> Tensor:
    """The causal-LM loss of packed rows: `how` = "position_ids" (transformers detects the packing from
    the position resets, attention_mask=None) or "mask" (our explicit block-diagonal mask)."""
    if how == "position_ids":
        return model(input_ids=pack["input_ids"], position_ids=pack["position_ids"], labels=pack["labels"]).loss
    if how == "mask":
        mask = block_diagonal_mask(pack["seq_ids"], next(model.parameters()).dtype)
        return model(input_ids=pack["input_ids"], position_ids=pack["position_ids"], attention_mask=mask,
                     labels=pack["labels"]).loss
    raise ValueError(f"how={how!r}: use 'position_ids' or 'mask'")


def padded_loss(model, batch: dict[str, Tensor]) -> Tensor:
    """The causal-LM loss of a right-padded batch (the reference packing must match)."""
    return model(**batch).loss


def long_tail_lengths(n: int, median: int = 600, sigma: float = 1.0, cap: int = 4096,
                      prompt: tuple[int, int] = (100, 400), seed: int = 0) -> list[int]:
    """Prompt + completion lengths of `n` RL samples: prompts uniform in `prompt`, completions log-normal
    (median `median`, log-std `sigma`: most are short, a few run to the cap) truncated at `cap` tokens
    (max_completion_length), as reasoning rollouts look."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.exp(torch.randn(n, generator=g) * sigma + torch.log(torch.tensor(float(median))))
    prompts = torch.randint(prompt[0], prompt[1], (n,), generator=g)
    return (completion.clamp(1, cap).long() + prompts).tolist()


def micro_batch_spread(lengths: list[int], groups: list[list[int]]) -> float:
    """Largest over mean real tokens per micro-batch: how unevenly the work is split (1.0 = even)."""
    tokens = [sum(lengths[i] for i in g) for g in groups]
    return max(tokens) / (sum(tokens) / len(tokens))


def time_packed_vs_padded(model, sequences: list[list[int]], budget: int, batch_size: int, pad_token_id: int,
                          repeats: int = 5, progress: bool = False) -> dict[str, float]:
    """One forward + backward over all `sequences`, padded in micro-batches of `batch_size` (arrival
    order) or packed best-fit into rows of `budget` tokens, interleaved `repeats` times in this process.
    Returns the median seconds of each and the median of the per-repeat ratios padded / packed
    (progress=True prints a line per repeat)."""
    import time

    lengths = [len(s) for s in sequences]
    bins = best_fit_decreasing(lengths, budget)
    packs = [pack_sequences(sequences, [b], budget, pad_token_id) for b in bins]
    padded = [pad_sequences(sequences[i:i + batch_size], pad_token_id) for i in range(0, len(sequences), batch_size)]

    def epoch(run, batches):
        start = time.perf_counter()
        for batch in batches:
            model.zero_grad(set_to_none=True)
            run(batch).backward()
        return time.perf_counter() - start

    times = {"padded": [], "packed": []}
    for _ in range(repeats):
        times["padded"].append(epoch(lambda b: padded_loss(model, b), padded))
        times["packed"].append(epoch(lambda b: packed_loss(model, b), packs))
        if progress:
            print(f"repeat {len(times['packed'])}/{repeats}: padded {times['padded'][-1]:.2f} s, "
                  f"packed {times['packed'][-1]:.2f} s", flush=True)
    model.zero_grad(set_to_none=True)
    ratios = [a / b for a, b in zip(times["padded"], times["packed"], strict=True)]
    median = lambda values: sorted(values)[len(values) // 2]                    # noqa: E731
    return {"padded_seconds": median(times["padded"]), "packed_seconds": median(times["packed"]),
            "speedup": median(ratios), "padded_utilization": padded_utilization(lengths, batch_size),
            "packed_utilization": utilization(lengths, bins, budget),
            "rows_padded": sum(len(b["input_ids"]) for b in padded), "rows_packed": len(bins)}
