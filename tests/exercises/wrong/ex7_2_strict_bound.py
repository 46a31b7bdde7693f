"""Exercise 7.2, wrong: admits only trajectories strictly fewer than eta versions behind."""

from minirl.asyncrl.queue import FutureVersionError
from minirl.runtime.validate import check_int

EXERCISE = "7.2"


def admit(trainer_version, version, max_staleness):
    check_int("max_staleness", max_staleness, low=0)
    if version > trainer_version:
        raise FutureVersionError(f"version {version} is newer than the trainer's {trainer_version}")
    return trainer_version - version < max_staleness
