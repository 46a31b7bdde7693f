"""Shared by the wrong versions of exercise 8.4 (not a wrong version itself)."""

from minirl.runtime.moe_checks import check_lengths


def fit(lengths, budget, choose, order=None):
    """Greedy packing: each sequence goes to the bin `choose(fitting bins, room)` picks, or a new one."""
    check_lengths(lengths, budget)
    bins, room = [], []
    for i in order if order is not None else sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [j for j, r in enumerate(room) if r >= lengths[i]]
        if fits:
            j = choose(fits, room)
        else:
            bins.append([])
            room.append(budget)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins
