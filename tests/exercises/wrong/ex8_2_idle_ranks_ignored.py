"""Exercise 8.2, wrong: divides by the ranks that appear in the events, ignoring ranks that never worked."""

EXERCISE = "8.2"


def bubble_share(events, num_ranks):
    ranks = len({r for r, _, _ in events})
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    return 1 - sum(e - s for _, s, e in events) / (ranks * span)
