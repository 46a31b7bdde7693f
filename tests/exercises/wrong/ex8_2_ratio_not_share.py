"""Exercise 8.2, wrong: returns idle over busy time (the (P-1)/M ratio) instead of idle over the whole."""

EXERCISE = "8.2"


def bubble_share(events, num_ranks):
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    busy = sum(e - s for _, s, e in events)
    return (num_ranks * span - busy) / busy
