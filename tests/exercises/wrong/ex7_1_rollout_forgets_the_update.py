"""Exercise 7.1, wrong: a rollout slot's idle time counts only the wait for the slowest, not the update."""

EXERCISE = "7.1"


def sync_step_idle(durations, train_seconds):
    if not durations or min(durations) < 0 or train_seconds < 0:
        raise ValueError("bad times")
    slowest = max(durations)
    total = slowest + train_seconds
    if total == 0:
        return {"trainer": 0.0, "rollout": 0.0}
    return {"trainer": slowest / total, "rollout": sum(slowest - d for d in durations) / (len(durations) * total)}
