"""Packing workloads and a timing: the lengths, the spread and the clock that notebook 08 section 6 measures with.

Hand-written (a measurement harness; the packers and packed training are taught in notebook 08 and live in
`minirl.parallel.packing`).

- `first_fit_decreasing` is the third packer the notebook compares: longest first, each sequence into the
  first bin with room; `PACKERS` names all three (next fit and best fit are taught in the notebook).
- `long_tail_lengths` draws prompt + completion lengths shaped like reasoning rollouts: uniform prompts,
  log-normal completions truncated at the generation cap (most short, a few at the cap).
- `micro_batch_spread` says how unevenly a split hands out real tokens (largest micro-batch over the mean).
- `pad_sequences`, `padded_loss` and `padded_utilization` are the unpacked reference a pack must match:
  right-padded rows, their causal-LM loss, and the share of real tokens when micro-batches of sequences
  in arrival order are each padded to their longest.
- `time_packed_vs_padded` times one forward + backward over the same sequences, padded in micro-batches or
  best-fit packed, alternating the two so that a busy machine slows both sides alike.
"""
import torch
from torch import Tensor

from minirl.parallel.packing import best_fit_decreasing, next_fit, pack_sequences, packed_loss, utilization
from minirl.runtime.moe_checks import PackingError, check_lengths


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


PACKERS = {"next_fit": next_fit, "first_fit_decreasing": first_fit_decreasing,
           "best_fit_decreasing": best_fit_decreasing}


def padded_utilization(lengths: list[int], batch_size: int) -> float:
    """No packing: micro-batches of `batch_size` sequences in arrival order, each padded to its longest."""
    if batch_size < 1:
        raise PackingError(f"batch_size={batch_size}: must be >= 1")
    batches = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    return sum(lengths) / sum(len(b) * max(b) for b in batches)


def pad_sequences(sequences: list[list[int]], pad_token_id: int) -> dict[str, Tensor]:
    """The unpacked reference: right-padded input_ids, attention_mask, labels (-100 on padding), [B, T]."""
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


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
