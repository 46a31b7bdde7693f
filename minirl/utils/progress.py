"""A progress bar for a job in other processes: `with step_bar(run_dir / "metrics.jsonl", steps, "job"): ...`.

Hand-written (notebook plumbing, it teaches nothing). A chapter script launched from a
notebook cell (under torchrun, or as a plain subprocess) runs with its own bar off, because
its output is a pipe, not a terminal; the cell shows this bar instead. A thread reads the
run's metrics.jsonl once a second and sets the bar to the step of its last record (and the
reward, when the record has one). A file older than the bar is the previous run's, not yet
replaced: it counts as no steps. A line half written is skipped until the next read.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm


@contextlib.contextmanager
def step_bar(metrics: Path, total: int | None, desc: str, every: float = 1.0) -> Iterator[tqdm]:
    """A tqdm bar over the steps that a job in other processes appends to `metrics` (its metrics.jsonl).

    total: the job's number of steps (None: a bar without an end). every: seconds between two
    reads of the file. The bar is read a last time, and closed, when the `with` block ends.
    """
    metrics, since, done = Path(metrics), time.time(), threading.Event()
    bar = tqdm(total=total, desc=desc)

    def look():
        try:
            lines = metrics.read_text().splitlines() if metrics.stat().st_mtime >= since else []
            last = json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):                  # not written yet, or a line half written
            return
        if last is not None:
            bar.n = last["step"]
            bar.set_postfix_str(f"reward {last['reward']:.2f}" if "reward" in last else "", refresh=False)
        bar.refresh()

    def follow():
        while not done.is_set():
            done.wait(every)
            look()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        done.set()
        thread.join()
        bar.close()
