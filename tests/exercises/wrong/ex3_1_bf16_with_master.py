"""Exercise 3.1, wrong: keeps an FP32 master copy in pure bf16 too (12 B, not 8)."""

from minirl.runtime.memory_checks import check_precision

EXERCISE = "3.1"


def bytes_per_param(precision="mixed"):
    check_precision(precision)
    table = {"mixed": (2, 2, 4, 4, 4), "fp32": (4, 4, 0, 4, 4), "bf16": (2, 2, 4, 2, 2)}[precision]
    per = dict(zip(("weights", "grads", "master", "adam_m", "adam_v"), table, strict=True))
    per["total"] = sum(table)
    return per
