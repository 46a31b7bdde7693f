"""Exercise 6.3, wrong: the sync is shifted but the keys stay in rl_step's order (sync last)."""

EXERCISE = "6.3"
ORDER = ("generate", "score", "reference", "advantages", "update", "update_critic")


def driver_cycles(records):
    cycles, previous = [], 0.0
    for r in records:
        if "time/generate" not in r:
            continue
        cycles.append({s: r[f"time/{s}"] for s in ORDER if f"time/{s}" in r} | {"sync": previous})
        previous = r["time/sync"]
    return cycles
