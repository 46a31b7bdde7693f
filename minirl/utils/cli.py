"""Plumbing shared by the chapter scripts: common flags, seeding, the summary file.

Hand-written (it teaches nothing): every chapter script takes `--out DIR` and writes
`DIR/summary.json` with its key figures, besides what it prints for people.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path


def common_parser(description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the flags every chapter script shares."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs") / "latest",
                        help="directory for summary.json, metrics and plots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--model", default=None,
                        help="any HF causal LM id or local path (default: the embedded policy)")
    return parser


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch, so a CPU run repeats bit for bit."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_summary(out: Path, summary: dict) -> Path:
    """Write `out/summary.json` atomically and return its path."""
    path = Path(out) / "summary.json"
    atomic_write_text(path, json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path
