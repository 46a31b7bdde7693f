"""Helpers for the chapter tests: run a script as a user would, and see which modules it imported before it stopped;
waits that scale with the machine's load.

`python -X importtime` writes one stderr line per imported module; a refusal that comes before
torch is imported (a mistyped flag, a bad value argparse checks) shows no `torch` line.
"""

import os
import signal
import subprocess
import sys
import time
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


def default_sigint() -> None:
    """A child's SIGINT as a terminal gives it (a Popen preexec_fn): a suite started in the background
    (`cmd &` in a script) inherits SIGINT ignored, and so would every chapter it starts, which would then
    never see the Ctrl-C a test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def load_factor() -> float:
    """How much slower than idle this machine runs now (1 on an idle one): a test's waits scale with it."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def wait_for(ready, proc, seconds: float, what: str) -> None:
    """Poll `ready()` until it holds; fail naming `what` if `proc` ends first or `seconds` x load pass."""
    deadline = time.time() + seconds * load_factor()
    while not ready():
        if proc.poll() is not None:
            tail = proc.stderr.read()[-2000:] if proc.stderr else ""
            raise AssertionError(f"the process ended (rc {proc.returncode}) before {what}: {tail}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {seconds:.0f} s x load factor {load_factor():.1f}")
        time.sleep(0.2)


def last_line(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
