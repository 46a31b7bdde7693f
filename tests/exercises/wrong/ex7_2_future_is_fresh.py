"""Exercise 7.2, wrong: a version newer than the trainer's is admitted (its negative staleness is "fresh")."""

from minirl.runtime.validate import check_int

EXERCISE = "7.2"


def admit(trainer_version, version, max_staleness):
    check_int("max_staleness", max_staleness, low=0)
    return trainer_version - version <= max_staleness
