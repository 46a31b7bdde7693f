"""Exercise 8.2, wrong: measures the span from time 0 instead of from the first event."""

EXERCISE = "8.2"


def bubble_share(events, num_ranks):
    return 1 - sum(e - s for _, s, e in events) / (num_ranks * max(e for _, _, e in events))
