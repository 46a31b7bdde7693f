"""Exercise 9.3, wrong: reads a value that was not measured as 0, so low MFU fires without an MFU."""

import math

from minirl.profiling.rules import RULES

EXERCISE = "9.3"


def rules_that_fire(measured, rules=RULES):
    out = []
    for r in rules:
        v = measured.get(r.name)
        v = 0.0 if v is None or math.isnan(v) else v
        if (v > r.threshold) if r.above else (v < r.threshold):
            out.append(r.name)
    return out
