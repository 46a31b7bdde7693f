"""argparse types that check a flag's range at the door, before anything is loaded.

Hand-written (it teaches nothing). `parser.add_argument("--gpus", type=int_in(1))` turns
`--gpus 0` into argparse's own one-line error, naming the flag, the value and the valid
range, with exit status 2:

    03_memory.py: error: argument --gpus: 0: must be >= 1

The ranges are checked by `minirl.runtime.validate`, so a flag and the config field it feeds
fail with the same words.
"""

from __future__ import annotations

import argparse

from minirl.runtime.validate import ConfigError, check_float, check_int


def _typed(kind, check, **bounds):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        try:
            check("value", value, **bounds)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{text}: {err.why}") from None
        return value
    parse.__name__ = kind.__name__                 # argparse names the type in its own messages
    return parse


def int_in(low: int | None = None, high: int | None = None):
    """An argparse type: an int in [low, high] (either bound may be None)."""
    return _typed(int, check_int, low=low, high=high)


def float_in(low: float | None = None, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite float in [low, high], or (low, high] with `low_open`."""
    return _typed(float, check_float, low=low, high=high, low_open=low_open)


def int_list(low: int | None = None, high: int | None = None):
    """An argparse type: comma-separated ints, each in [low, high]: "1,2,4" -> [1, 2, 4]."""
    one = int_in(low, high)

    def parse(text: str) -> list[int]:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 1,2,4")
        return [one(item) for item in items]
    parse.__name__ = "list of int"
    return parse
