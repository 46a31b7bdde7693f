"""Exercise 9.3, wrong: ignores `above`, so low MFU fires for a high MFU and not for a low one."""

import math

from minirl.profiling.rules import RULES

EXERCISE = "9.3"


def rules_that_fire(measured, rules=RULES):
    return [r.name for r in rules if measured.get(r.name) is not None and not math.isnan(measured[r.name])
            and measured[r.name] > r.threshold]
