"""Exercise 9.1, wrong: counts time/eval (which runs between steps) as a stage of the steps."""

EXERCISE = "9.1"


def stage_shares(records):
    steps = [r for r in records if "time/step" in r]
    total = sum(r["time/step"] for r in steps)
    if not total:
        return {}
    seconds = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("time/") and k != "time/step":
                seconds[k[5:]] = seconds.get(k[5:], 0.0) + v
    shares = {k: v / total for k, v in seconds.items()}
    return shares | {"other": max(0.0, 1 - sum(shares.values()))}
