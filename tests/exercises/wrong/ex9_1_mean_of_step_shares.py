"""Exercise 9.1, wrong: averages each step's shares, so a slow step weighs no more than a fast one."""

EXERCISE = "9.1"


def stage_shares(records):
    steps = [r for r in records if "time/step" in r]
    if not steps:
        return {}
    per_step = []
    for r in steps:
        shares = {k[5:]: v / r["time/step"] for k, v in r.items()
                  if k.startswith("time/") and k not in ("time/step", "time/eval")}
        per_step.append(shares | {"other": max(0.0, 1 - sum(shares.values()))})
    keys = {k for s in per_step for k in s}
    return {k: sum(s.get(k, 0.0) for s in per_step) / len(per_step) for k in keys}
