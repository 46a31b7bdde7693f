"""Exercise 6.2, wrong: rank r takes every n-th prompt (r, r + n, ...): concatenating gives another order."""

from minirl.data import Batch

EXERCISE = "6.2"


def split_by_rank(n, batch, *args):
    if isinstance(batch, Batch):
        return [(part, *args) for part in batch.split(n)]
    if len(batch) % n:
        raise ValueError(f"{len(batch)} items into {n}")
    return [(batch[r::n], *args) for r in range(n)]
