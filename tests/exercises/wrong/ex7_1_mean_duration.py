"""Exercise 7.1, wrong: the trainer waits for the mean trajectory, not the slowest."""

EXERCISE = "7.1"


def sync_step_idle(durations, train_seconds):
    if not durations or min(durations) < 0 or train_seconds < 0:
        raise ValueError("bad times")
    wait = sum(durations) / len(durations)
    total = wait + train_seconds
    if total == 0:
        return {"trainer": 0.0, "rollout": 0.0}
    return {"trainer": wait / total, "rollout": sum(total - d for d in durations) / (len(durations) * total)}
