"""Seeds: one call for a script, and a context that seeds without touching the caller's RNG.

Hand-written (it teaches nothing). Library code takes explicit `torch.Generator`s; the one
place it cannot (Hugging Face model construction draws its initial weights from the global
RNG) uses `seeded(seed)`, which forks the global RNG, seeds the fork, and restores the
caller's state on exit.

torch is imported inside the functions, not at the top: the chapter scripts import this module
(through minirl.runtime.cli) to parse their flags, and a typo must be reported before torch loads.
"""

from __future__ import annotations

import contextlib
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch: for scripts, so a CPU run repeats bit for bit."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


@contextlib.contextmanager
def seeded(seed: int):
    """Run the block with torch's global RNG seeded to `seed`, then restore the caller's RNG state."""
    import torch

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def make_generator(seed: int, device="cpu") -> torch.Generator:
    """A fresh `torch.Generator` on `device`, seeded."""
    import torch

    return torch.Generator(device=device).manual_seed(seed)
