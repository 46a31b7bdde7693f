"""Helpers for the chapter tests: run a script as a user would, and see which modules it imported before it stopped.

`python -X importtime` writes one stderr line per imported module; a refusal that comes before
torch is imported (a mistyped flag, a bad value argparse checks) shows no `torch` line.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script, *args, env=None, timeout=300):
    """(completed process, set of imported top-level modules) of `python -X importtime script args`."""
    proc = subprocess.run([sys.executable, "-X", "importtime", str(script), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", **(env or {})})
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc, imported


def last_line(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
