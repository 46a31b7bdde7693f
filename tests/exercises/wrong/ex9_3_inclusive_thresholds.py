"""Exercise 9.3, wrong: fires at the threshold itself (the source says "more than" and "below")."""

import math

from minirl.profiling.rules import RULES

EXERCISE = "9.3"


def rules_that_fire(measured, rules=RULES):
    out = []
    for r in rules:
        v = measured.get(r.name)
        if v is not None and not math.isnan(v) and ((v >= r.threshold) if r.above else (v <= r.threshold)):
            out.append(r.name)
    return out
