"""Exercise 3.1, wrong: writes the bytes as floats (2.0, ...); the docstring promises ints."""

from minirl.runtime.memory_checks import check_precision

EXERCISE = "3.1"


def bytes_per_param(precision="mixed"):
    check_precision(precision)
    table = {"mixed": (2.0, 2.0, 4.0, 4.0, 4.0), "fp32": (4.0, 4.0, 0.0, 4.0, 4.0),
             "bf16": (2.0, 2.0, 0.0, 2.0, 2.0)}[precision]
    per = dict(zip(("weights", "grads", "master", "adam_m", "adam_v"), table, strict=True))
    per["total"] = sum(table)
    return per
