"""A run directory belongs to one run: ownership, a lock while it writes, and a config check on resume.

Hand-written (it teaches nothing, but it keeps work from being lost or mixed). A run
directory holds `run.json` (what the run is: its settings), `metrics.jsonl`,
`checkpoints/`, `final/` and `summary.json`. `open_run_dir` refuses a directory that holds
another run unless asked to resume it or to overwrite it, and holds an exclusive lock
(released when the process ends, even if it is killed) so that two runs never write into
one directory at once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from minirl.runtime.io import atomic_write_json

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
OWNED = (RUN_FILE, "metrics.jsonl", "checkpoints", "final", "summary.json")


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked; the message says what to do instead."""


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in OWNED)


class RunDir:
    """An opened, locked run directory. Use as a context manager, or call close()."""

    def __init__(self, path: Path, lock_handle):
        self.path = path
        self._lock = lock_handle

    def close(self) -> None:
        if self._lock is not None:
            _unlock(self._lock)
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record(self) -> dict | None:
        """What run.json says about the run in this directory (None for a fresh directory)."""
        path = self.path / RUN_FILE
        return json.loads(path.read_text()) if path.exists() else None


def open_run_dir(path, run_info: dict, resume: bool = False, overwrite: bool = False,
                 flag_names: tuple[str, str, str] = ("--resume", "--overwrite", "--out")) -> RunDir:
    """Lock `path` for one run, checking what it already holds.

    fresh directory (missing or empty of run files): run.json is written with `run_info`.
    holds a run: resume=True continues it (run.json is kept; the caller checks the config),
    overwrite=True deletes that run's files first, otherwise RunDirError.
    resume=True on a directory without run.json: RunDirError (nothing to resume).
    The checks run under the lock, so another process cannot start a run there meanwhile.
    flag_names: how the errors name resume, overwrite and path (the chapter scripts' flags by default: the
    training loop opens the directory for them without knowing it).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        check_run_dir(path, resume, overwrite, flag_names)           # raises: not a directory
    path.mkdir(parents=True, exist_ok=True)
    lock = _lock(path / LOCK_FILE)
    if lock is None:
        raise RunDirError(f"{flag_names[2]} {path}: another run is writing into this directory right now (it holds "
                          f"{path / LOCK_FILE}); wait for it, or choose another {flag_names[2]}")
    try:
        check_run_dir(path, resume, overwrite, flag_names)           # under the lock: nobody changes it meanwhile
        existing = holds_run(path)
        if existing and overwrite:
            for name in OWNED:
                target = path / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        if not resume:
            atomic_write_json(path / RUN_FILE, run_info)
    except BaseException:
        _unlock(lock)
        raise
    return RunDir(path, lock)


def _lock(path: Path):
    """An exclusive, non-blocking lock on `path` (None if another process holds it)."""
    handle = open(path, "a+")
    try:
        import fcntl
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return None
    except ImportError:                     # Windows: lock the first byte
        import msvcrt
        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            handle.close()
            return None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _unlock(handle) -> None:
    try:
        handle.close()                      # closing the file releases flock / msvcrt locks
    except OSError:
        pass


def check_run_dir(path, resume: bool = False, overwrite: bool = False,
                  flag_names: tuple[str, str, str] = ("--resume", "--overwrite", "--out")) -> None:
    # flag_names: how the caller names the three settings in errors (a script's flags by default)
    """The checks of `open_run_dir` without touching anything: for scripts, before they load a model."""
    resume_flag, overwrite_flag, out_flag = flag_names
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{out_flag} {path}: exists and is not a directory; choose a directory")
    existing = path.is_dir() and holds_run(path)
    if resume and overwrite:
        raise RunDirError(f"{resume_flag} and {overwrite_flag} contradict each other; pass one")
    if resume and not (path / RUN_FILE).exists():
        raise RunDirError(f"{resume_flag}: {path} holds no run to resume (no {RUN_FILE}); drop {resume_flag} to "
                          "start a new run there")
    if existing and not resume and not overwrite:
        raise RunDirError(f"{out_flag} {path} already holds a run; pass {resume_flag} to continue it, "
                          f"{overwrite_flag} to delete it and start again, or another {out_flag}")


def read_run_record(path) -> dict:
    """What `path/run.json` records about its run: {"config": settings, ...}."""
    return json.loads((Path(path) / RUN_FILE).read_text())
