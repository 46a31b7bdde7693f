"""The argument checks of notebook 03's memory calculator: a bad number is a ValueError naming it.

Hand-written (argument checks). A count of parameters, GPUs or tokens must be a finite number
above zero; a precision and a ZeRO stage must be ones the calculator knows
(`minirl.memory.calculator.PRECISIONS` and `ZERO_LEVELS`).
"""

import math


def check_positive(name: str, value) -> None:
    """Raise ValueError naming `name` unless `value` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive number")


def check_precision(precision: str) -> None:
    """Raise ValueError unless `precision` is one of the calculator's PRECISIONS."""
    from minirl.memory.calculator import PRECISIONS  # noqa: PLC0415 (the calculator imports this module)

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(map(repr, PRECISIONS))} "
                         "('mixed' = BF16 weights/grads + FP32 master and Adam, the source's 16 B)")


def check_stage(stage) -> None:
    """Raise ValueError unless `stage` is a ZeRO stage 0..3."""
    from minirl.memory.calculator import ZERO_LEVELS  # noqa: PLC0415 (the calculator imports this module)

    if isinstance(stage, bool) or stage not in ZERO_LEVELS:
        raise ValueError(f"stage={stage!r}: use a ZeRO stage in {', '.join(map(str, ZERO_LEVELS))} "
                         "(0 = plain data parallel, 3 = everything sharded)")


def check_model_sizes(sizes: dict) -> None:
    """Raise ValueError naming the first size of a model config that is not a positive int."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model config: {name}={value!r}: must be a positive integer "
                             f"(is this a decoder-only causal LM config?)")
