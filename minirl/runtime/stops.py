"""Why a data-parallel job stopped, in one line from one rank: Ctrl-C, a dead rank, a full disk, an error.

Hand-written plumbing for stage 4 (notebook 04 names it; the chapter script uses it).

`rank_processes` records every rank's host and pid at the start; after a failure,
`dead_ranks` finds the ones of this host that have ended. `StopSignals` turns the first
SIGINT and SIGTERM into exceptions and remembers what arrived; `deferred_signals` holds them
off while a checkpoint is promoted. `why_stopped` decides what this rank says (if anything)
and the exit status; `first_to_report` lets only one process say that a rank died;
`relaunch_command` is the torchrun command that continues the run.

Who said it and who left are kept in the job's own key-value store (the TCPStore that
torchrun's agent holds for the job, at MASTER_ADDR:MASTER_PORT): no file, nothing left
behind, and a later job never sees them, whatever its run id (torchrun names every job
with --master_port "none"). A rank that ended after entering `why_stopped` was stopped (by
a signal, a broken collective, its own error it has reported); only one that ended without
it (SIGKILL, a crash) is named as dead.

Simplified vs torchelastic: no restarts and no health checks of other nodes (a rank on
another host is seen dying only as the broken connection, and reported as such).
"""

import contextlib
import os
import shlex
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch.distributed as dist

from minirl.rollout.base import VersionMismatchError
from minirl.runtime.ranks import RankFailed, world_from_env
from minirl.runtime.rundir import RunDirError
from minirl.runtime.training_cli import write_failure
from minirl.runtime.validate import ConfigError


def rank_processes() -> list[tuple[str, int]]:
    """(host, pid) of every rank, in rank order, on every rank (a collective): who to name when one dies."""
    mine = (socket.gethostname(), os.getpid())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def dead_ranks(processes: list[tuple[str, int]]) -> list[int]:
    """The ranks of this host whose process has ended (gone, or a zombie not yet reaped by torchrun).

    processes: `rank_processes()`. A rank on another host cannot be seen from here and is never listed.
    """
    host, dead = socket.gethostname(), []
    for rank, (where, pid) in enumerate(processes):
        if where != host or pid == os.getpid():
            continue
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                dead.append(rank)
        except psutil.NoSuchProcess:
            dead.append(rank)
        except psutil.AccessDenied:
            pass
    return dead


class Terminated(BaseException):
    """SIGTERM, as an exception (BaseException, like KeyboardInterrupt: `agree` does not catch it)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """A context manager: the first SIGINT raises KeyboardInterrupt, the first SIGTERM `Terminated`.

    Later ones (and all of them after `quiet()`) are only recorded in `received`, so that a rank
    reporting why it stops is not interrupted again. torchrun forwards Ctrl-C to every rank as
    SIGINT, and sends SIGTERM to the other ranks when one dies. The handlers are put back on exit.
    """

    def __init__(self):
        self.received: list[int] = []
        self.raising = True

    def __enter__(self):
        self.saved = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)

    def quiet(self) -> None:
        self.raising = False

    def _handle(self, signum, frame):
        first = signum not in self.received
        self.received.append(signum)
        if self.raising and first:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(f"signal {signum}")


@contextlib.contextmanager
def deferred_signals():
    """SIGINT and SIGTERM wait until the block is done (then reach their handlers): for a file's promotion."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    saved = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


_STORES: dict = {}


def _job_store():
    """This job's store (torchrun's agent holds it from the start to the end of the job), or None: not
    under torchrun's agent store, or out of reach (then every rank acts as if it were the first)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    at = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
    if at not in _STORES:
        try:
            _STORES[at] = dist.TCPStore(*at, is_master=False, timeout=timedelta(seconds=5))
        except (RuntimeError, ValueError, OSError):
            _STORES[at] = None
    return _STORES[at]


def _job_key(name: str) -> str:
    return f"minirl/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def first_to_report(key: str) -> bool:
    """True for the first process of this job (under torchrun) to ask with `key`; False after.

    An atomic counter in the job's store: when a rank dies of its own error it says so, and the
    rank that then finds it gone stays quiet. Outside torchrun (or without its store): True.
    """
    store = _job_store()
    if store is None:
        return True
    try:
        return store.add(_job_key(key), 1) == 1
    except RuntimeError:
        return True


def _leaving(rank: int) -> None:
    """Marks this rank as stopping on its own (it did not die): see `died`."""
    store = _job_store()
    if store is not None:
        with contextlib.suppress(RuntimeError):
            store.set(_job_key(f"left/{rank}"), "1")


def ranks_that_died(processes: list[tuple[str, int]]) -> list[int]:
    """`dead_ranks` without the ranks that ended after entering `why_stopped` (stopped, not dead):
    in a job torchrun stops after a rank died, only that rank."""
    dead = dead_ranks(processes)
    store = _job_store() if dead else None
    if store is None:
        return dead
    try:
        return [r for r in dead if not store.check([_job_key(f"left/{r}")])]
    except RuntimeError:
        return dead


def relaunch_command(script, args: list[str]) -> str:
    """The torchrun command line that starts this job's script again with `args`, on as many ranks."""
    _, world, _ = world_from_env()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = f"--nnodes {world // local} " if world > local else ""
    return f"torchrun {nodes}--nproc_per_node {local} {shlex.join([str(script), *map(str, args)])}"


BAD_INPUT = (ConfigError, RunDirError, ValueError, VersionMismatchError)   # found alike on every rank: exit 2


@dataclass
class Stop:
    """What a stopping rank says: `what` happened (None: this rank stays quiet), its exit status, and
    whether the line goes on with the last intact checkpoint and the resume command."""

    what: str | None
    code: int
    resumable: bool = True


def _names(ranks: list[int], processes: list[tuple[str, int]]) -> str:
    """'rank R (pid P on HOST)' for each rank; 'rank R' alone before `rank_processes()` has run."""
    return ", ".join(f"rank {r} (pid {processes[r][1]} on {processes[r][0]})" if r < len(processes)
                     else f"rank {r}" for r in ranks)


def why_stopped(err: BaseException, signals: StopSignals, processes: list[tuple[str, int]], rank: int, out,
                wait: float = 1.0) -> Stop:
    """This rank's `Stop` for `err`, the exception that ended its run.

    In order: Ctrl-C (rank 0 says "interrupted", exit 130); an error every rank met (`agree`, or
    marked `agreed`): rank 0 says it, exit 1 for a file that could not be written (disk full,
    read-only), else 2 (bad input); a rank of this host that died (`ranks_that_died`: it ended without
    coming here; the lowest rank alive says so: exit 1); SIGTERM without a dead rank (rank 0,
    unless a rank has said why: 143); this rank's own error: it says so itself (1). A broken
    collective without a dead rank in sight waits up to `wait` seconds for the death or the
    signal that caused it. out: the run directory (a write failure outside it still names its file).
    """
    _leaving(rank)
    alive = lambda: min(set(range(len(processes))) - set(dead_ranks(processes)))   # noqa: E731
    says = lambda: rank == alive() and first_to_report("stop")    # noqa: E731  (rank 0 may have said it and left)
    if signal.SIGINT in signals.received or isinstance(err, KeyboardInterrupt):
        return Stop("interrupted" if says() else None, 130)
    cause = err.cause if isinstance(err, RankFailed) and err.cause is not None else err
    line = write_failure(cause, out) if isinstance(cause, OSError) else None
    if getattr(err, "agreed", False) or isinstance(err, RankFailed):      # every rank has it: rank 0 says it
        if line is not None:
            return Stop(f"error: {line}" if rank == 0 else None, 1)
        return Stop(f"error: {err}" if rank == 0 else None, 2 if isinstance(err, BAD_INPUT) else 1, resumable=False)
    deadline = time.monotonic() + wait
    while True:
        dead = ranks_that_died(processes)
        if dead:
            return Stop(f"{_names(dead, processes)} died" if says() else None, 1)
        if signal.SIGINT in signals.received:
            return Stop("interrupted" if says() else None, 130)
        if signal.SIGTERM in signals.received or isinstance(err, Terminated):
            return Stop("stopped by SIGTERM" if rank == 0 and first_to_report("stop") else None, 143)
        if not isinstance(err, RuntimeError) or time.monotonic() > deadline:
            break
        time.sleep(0.05)                        # a broken collective: who broke it shows in a moment
    first = first_to_report("stop")
    if line is not None:
        return Stop(f"error on {_names([rank], processes)}: {line}" if first else None, 1)
    text = str(err).strip().splitlines()
    return Stop(f"{_names([rank], processes)} failed with {type(err).__name__}: {text[0] if text else ''}"
                if first else None, 1)
