"""Exercise 6.2, wrong: a list that does not divide is split anyway, the last rank taking the rest."""

from minirl.data import Batch

EXERCISE = "6.2"


def split_by_rank(n, batch, *args):
    if isinstance(batch, Batch):
        return [(part, *args) for part in batch.split(n)]
    size = len(batch) // n
    return [(batch[r * size:(r + 1) * size if r < n - 1 else len(batch)], *args) for r in range(n)]
