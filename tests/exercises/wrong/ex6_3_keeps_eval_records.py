"""Exercise 6.3, wrong: the step-0 evaluation record counts as an iteration (with zeros)."""

EXERCISE = "6.3"
ORDER = ("generate", "score", "reference", "advantages", "update", "update_critic")


def driver_cycles(records):
    cycles, previous = [], 0.0
    for r in records:
        cycles.append({"sync": previous} | {s: r[f"time/{s}"] for s in ORDER if f"time/{s}" in r})
        previous = r.get("time/sync", 0.0)
    return cycles
