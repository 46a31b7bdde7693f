"""Exercise 7.2, wrong: uses |trainer - version|, so a future version within eta passes silently."""

from minirl.runtime.validate import check_int

EXERCISE = "7.2"


def admit(trainer_version, version, max_staleness):
    check_int("max_staleness", max_staleness, low=0)
    return abs(trainer_version - version) <= max_staleness
