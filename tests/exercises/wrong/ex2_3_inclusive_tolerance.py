"""Exercise 2.3, wrong: counts a difference equal to the tolerance as stale (>= instead of >)."""

EXERCISE = "2.3"


def stale_parameters(trainer_state, rollout_state, rel_tol=0.0, abs_tol=0.0):
    stale = []
    for name in sorted(set(trainer_state) | set(rollout_state)):
        if name not in trainer_state or name not in rollout_state:
            stale.append(name)
            continue
        t, r = trainer_state[name].float(), rollout_state[name].float()
        if t.shape != r.shape or ((r - t).abs() >= abs_tol + rel_tol * t.abs()).any():
            stale.append(name)
    return stale
