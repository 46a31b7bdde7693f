"""Progress bars: only on a terminal (`bars_wanted`), and one for a job in other processes (`step_bar`).

Hand-written (notebook plumbing, it teaches nothing). A chapter script shows bars only when its
stderr is a terminal: in a log file or a pipe they are noise, so `bars_wanted` switches off the
libraries' bars too (transformers' "Loading weights" and "Writing model shards"). A chapter
script launched from a notebook cell (under torchrun, or as a plain subprocess) runs with its
own bar off, because its output is a pipe, not a terminal; the cell shows `step_bar` instead. A thread reads the
run's metrics.jsonl once a second and sets the bar to the step of its last record (and the
reward, when the record has one). A file older than the bar is the previous run's, not yet
replaced: it counts as no steps. A line half written is skipped until the next read.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm


def bars_wanted(no_progress: bool = False, stream=None) -> bool:
    """Whether a chapter shows progress bars: not with --no-progress, nor when `stream` (stderr) is no terminal.

    When not, the bars of transformers and huggingface_hub are switched off as well, in this process
    (HF_HUB_DISABLE_PROGRESS_BARS, read when they are imported, or their switch when they already are)
    and in the processes it starts (torchrun's ranks, a local Ray cluster's workers inherit the variable).
    """
    wanted = not no_progress and (sys.stderr if stream is None else stream).isatty()
    if not wanted:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "huggingface_hub" in sys.modules:
            sys.modules["huggingface_hub"].utils.disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging  # noqa: PLC0415 (already imported)

            logging.disable_progress_bar()
    return wanted


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
