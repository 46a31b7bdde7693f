"""Every rank reaching the same verdict: where a process sits in a torchrun job, its backend, and `agree`.

Hand-written plumbing for stage 4 (notebook 04 uses it; it teaches nothing about RL).
`world_from_env` reads what torchrun puts in the environment; `pick_backend` chooses gloo on
CPUs and NCCL on GPUs, refusing NCCL without CUDA with the flag and the fix; `agree` runs a
piece of work on every rank and, when it raised on any rank, raises on every rank (the rank
that failed re-raises its own error, the others `RankFailed` naming it), so that a bad input
stops the whole job with its cause instead of leaving the other ranks waiting in a collective.
"""

import contextlib
import os

import torch
import torch.distributed as dist

from minirl.runtime.validate import ConfigError, check_choice

BACKENDS = ("auto", "gloo", "nccl")


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun sets them; (0, 1, 0) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def pick_backend(backend: str, device: str) -> str:
    """The process-group backend for `device`: "auto" is nccl on CUDA and gloo on CPU.

    Raises ConfigError for NCCL without a CUDA device (NCCL only moves GPU memory) and for
    a CUDA device on a machine that has none, naming the flag and the fix.
    """
    check_choice("backend", backend, BACKENDS)
    cuda = str(device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine; use --device cpu")
    if backend == "nccl" and not cuda:
        where = "this machine has no CUDA device" if not torch.cuda.is_available() else f"--device is {device}"
        raise ConfigError("backend", backend, f"NCCL communicates between CUDA GPUs and {where}; use --backend gloo "
                                              "(or auto) on CPUs, or --device cuda on a GPU machine")
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    return backend
    return backend


class RankFailed(RuntimeError):
    """Another rank failed; the message names the rank and its error. rank: that rank; cause: its error
    when it is an OSError (a disk that filled names its file on every rank), else None."""

    def __init__(self, message: str, rank: int | None = None, cause: OSError | None = None):
        super().__init__(message)
        self.rank, self.cause = rank, cause


def agree(what: str, fn):
    """fn() on every rank; if it raised anywhere, raise on every rank (none is left waiting).

    The rank that failed re-raises its own error, marked `agreed = True` (every rank knows:
    one of them reports it); the others raise RankFailed naming the rank and the error. Use it
    around work whose collectives every rank either reaches or skips alike (setup, checks,
    writing a checkpoint): a rank stuck inside a collective cannot report.
    """
    error, result = None, None
    try:
        result = fn()
    except Exception as err:                 # reported to the other ranks, then re-raised
        error = err
    report = None if error is None else (f"{type(error).__name__}: {error}",
                                         error if isinstance(error, OSError) else None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    else:
        reports = [report]
    if error is not None:
        with contextlib.suppress(AttributeError):
            error.agreed = True
        raise error
    failed = [(r, got) for r, got in enumerate(reports) if got]
    if failed:
        rank, (msg, cause) = failed[0]
        raise RankFailed(f"{what}: rank {rank} failed with {msg}", rank, cause)
    return result
