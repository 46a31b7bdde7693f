"""Exercise 6.2, wrong: a Batch is cut by rows, not by whole groups of G completions."""

from minirl.data import Batch

EXERCISE = "6.2"


def split_by_rank(n, batch, *args):
    if len(batch) % n:
        raise ValueError(f"{len(batch)} items into {n}")
    size = len(batch) // n
    if isinstance(batch, Batch):
        return [(batch.rows(r * size, (r + 1) * size), *args) for r in range(n)]
    return [(batch[r * size:(r + 1) * size], *args) for r in range(n)]
