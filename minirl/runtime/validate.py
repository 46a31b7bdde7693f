"""Checks at the door: one error type that names the parameter, the value and the fix.

Hand-written (it teaches nothing). A `ConfigError` is a `ValueError` that also carries the
parameter's name, so a command-line script can report it against the flag the user typed
(`--max-completion-length 0: must be >= 1`) instead of a traceback.
"""

from __future__ import annotations

import math
import os
import re
import sys


class ConfigError(ValueError):
    """A bad value for a named parameter: `name=value: why`."""

    def __init__(self, name: str, value, why: str):
        self.name, self.value, self.why = name, value, why
        super().__init__(f"{name}={value!r}: {why}")


def check_choice(name: str, value, allowed) -> None:
    """`value` must be one of `allowed`."""
    if value not in allowed:
        raise ConfigError(name, value, f"use one of {', '.join(map(repr, allowed))}")


def check_int(name: str, value, low: int | None = None, high: int | None = None, why: str = "") -> None:
    """An int (not a bool) in [low, high]; either bound may be None."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "must be an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in {low}..{high}"
        raise ConfigError(name, value, f"must be {bounds}" + (f" ({why})" if why else ""))


def check_float(name: str, value, low: float | None = None, high: float | None = None,
                low_open: bool = False, why: str = "") -> None:
    """A finite number in [low, high] (or (low, high] with low_open); either bound may be None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, value, "must be a number")
    if not math.isfinite(value):
        raise ConfigError(name, value, "must be finite" + (f" ({why})" if why else ""))
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        raise ConfigError(name, value, f"must be {' and '.join(x for x in (lo, hi) if x)}"
                          + (f" ({why})" if why else ""))


NO_CUDA = "this machine has no CUDA device (torch.cuda.is_available() is False): run with --device cpu"
# What a GPU driver puts on a Linux machine: NVIDIA's module and device nodes, ROCm's, WSL2's.
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def check_parts(name: str, value, entry, parts: tuple[str, ...], kind: str) -> None:
    """ConfigError naming setting `name`, its `value` and the part unless every one of `parts` is a function
    of `entry` (a registry entry, e.g. a loss type's `LossType`, whose class is `kind`)."""
    for part in parts:
        if not callable(getattr(entry, part, None)):
            raise ConfigError(name, value, f"its entry's {part} is {getattr(entry, part, None)!r}, not a function: "
                                           f"every {name.replace('_', ' ')} needs all of {', '.join(parts)} (a {kind})")


def gpu_driver_visible() -> bool:
    """Whether a GPU driver shows on this Linux machine (NVIDIA's, ROCm's, WSL's); True elsewhere (unknown)."""
    return not sys.platform.startswith("linux") or any(os.path.exists(path) for path in GPU_DRIVER_FILES)


def device_problem(device: str) -> str | None:
    """Why `device` cannot run here ("cuda" on a machine without CUDA, "cuda:3" with 2 GPUs, a typo), or None.

    Imports torch (a few seconds, more on a busy machine) unless the answer is known without it:
    "cuda..." on a Linux machine where no GPU driver shows (torch could not see a GPU either).
    Call it after parsing the arguments, before any model loads. Every chapter script reports
    the answer as one line against its --device flag.
    """
    if re.fullmatch(r"cuda(:\d+)?", str(device)) and not gpu_driver_visible():
        return NO_CUDA
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return "not a device: use cpu, cuda, cuda:1, ..."
    if parsed.type == "cpu":
        return None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            return NO_CUDA
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            return (f"this machine has {torch.cuda.device_count()} CUDA device(s): use cuda:0 .. "
                    f"cuda:{torch.cuda.device_count() - 1}")
        return None
    if parsed.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "MPS is not available here: run with --device cpu"
    return f"device type {parsed.type!r} is not supported by minirl: use cpu or cuda"
