"""Exercise 9.1, wrong: divides by the stages' sum instead of the steps' wall-clock time, so "other" is always 0."""

EXERCISE = "9.1"


def stage_shares(records):
    seconds = {}
    for r in records:
        if "time/step" not in r:
            continue
        for k, v in r.items():
            if k.startswith("time/") and k not in ("time/step", "time/eval"):
                seconds[k[5:]] = seconds.get(k[5:], 0.0) + v
    total = sum(seconds.values())
    return ({k: v / total for k, v in seconds.items()} | {"other": 0.0}) if total else {}
