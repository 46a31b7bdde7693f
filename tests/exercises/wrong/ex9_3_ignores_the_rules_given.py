"""Exercise 9.3, wrong: always applies the package's RULES, not the rules it is given."""

from minirl.profiling.rules import RULES

EXERCISE = "9.3"


def rules_that_fire(measured, rules=RULES):
    from minirl.profiling.rules import rules_that_fire as reference
    return reference(measured)
