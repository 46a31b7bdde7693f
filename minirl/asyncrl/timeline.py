# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Who waits when: the idle shares of a synchronous step, from its trajectories' durations."""

__all__ = ["sync_step_idle"]


def sync_step_idle(durations: list[float], train_seconds: float) -> dict[str, float]:
    """Idle shares of one synchronous step: each trajectory on its own slot, then the update.

    durations: seconds each of the step's n trajectories takes (n >= 1, each >= 0), one per
    rollout slot, all started together at time 0. train_seconds: the update's seconds (>= 0),
    which starts when the slowest trajectory ends. The step lasts
    T = max(durations) + train_seconds. Returns
      "trainer": the trainer's idle share, max(durations) / T (it waits for the slowest);
      "rollout": the rollout slots' mean idle share, mean over slots of (T - d_i) / T (a slot
                 waits for the slowest trajectory, then for the update).
    Both are 0 when T is 0. Raises ValueError for no durations or a negative time.
    """
    if not durations:
        raise ValueError("sync_step_idle: durations is empty; pass one duration per trajectory")
    if min(durations) < 0 or train_seconds < 0:
        raise ValueError(f"sync_step_idle: times must be >= 0 (durations min {min(durations)}, "
                         f"train_seconds {train_seconds})")
    slowest = max(durations)
    total = slowest + train_seconds
    if total == 0:
        return {"trainer": 0.0, "rollout": 0.0}
    return {"trainer": slowest / total,
            "rollout": sum(total - d for d in durations) / (len(durations) * total)}
