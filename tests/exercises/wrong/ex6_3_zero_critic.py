"""Exercise 6.3, wrong: every stage of the source's list is present, 0.0 when the run has none (no critic in GRPO)."""

EXERCISE = "6.3"
ORDER = ("generate", "score", "reference", "advantages", "update", "update_critic")


def driver_cycles(records):
    cycles, previous = [], 0.0
    for r in records:
        if "time/generate" not in r:
            continue
        cycles.append({"sync": previous} | {s: r.get(f"time/{s}", 0.0) for s in ORDER})
        previous = r["time/sync"]
    return cycles
