"""Exercise 7.1, wrong: no guard for a step of zero seconds (and no check of the inputs)."""

EXERCISE = "7.1"


def sync_step_idle(durations, train_seconds):
    slowest = max(durations)
    total = slowest + train_seconds
    return {"trainer": slowest / total, "rollout": sum(total - d for d in durations) / (len(durations) * total)}
