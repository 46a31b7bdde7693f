# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Starting a data-parallel job: one process per device under torchrun, gloo on CPUs, NCCL on GPUs.

`init_distributed` reads what torchrun puts in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR), picks the backend for the device, joins the default process group
and returns a `DistContext`. `ProcessGroup` is the small object the step and the roles use
for the few numbers that must be global (rl_step's `group`). `agree` turns a failure on any
rank into an error on every rank, so that a bad input stops the whole job with its cause
instead of leaving the other ranks waiting in a collective. Starting a job from Python and
ending it (`torchrun`, `stop_job`, `leave`) is plumbing: `minirl/runtime/launch.py`.

Simplified vs torchrun + accelerate: one node, one flat process group, no elastic restarts
(a failed rank ends the job; it resumes from its last sharded checkpoint).
"""

__all__ = ["BACKENDS", "DistContext", "world_from_env", "pick_backend", "init_distributed",
           "shutdown", "ProcessGroup", "rank_slice", "RankFailed", "agree"]

import contextlib
import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from minirl.runtime.validate import ConfigError, check_choice

BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class DistContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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


def init_distributed(backend: str = "auto", device: str = "cpu", timeout_s: float = 900.0) -> DistContext:
    """Join the job's process group (a group of one in a plain process); returns this rank's context.

    Under torchrun: rank and world size from the environment, one CUDA device per local rank.
    Without it (a notebook, a test): a one-process group through a file store, so the same
    FSDP2 and DTensor code runs. Collectives give up after `timeout_s` seconds instead of
    waiting forever for a rank that died.
    """
    rank, world, local = world_from_env()
    name = pick_backend(backend, device)
    dev = torch.device("cuda", local) if str(device).startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kwargs = dict(backend=name, timeout=timedelta(seconds=timeout_s))
        if "MASTER_ADDR" not in os.environ:           # not under torchrun: a group of one
            store = Path(tempfile.mkdtemp(prefix="minirl-pg-")) / "store"
            kwargs.update(init_method=f"file://{store}", rank=0, world_size=1)
        dist.init_process_group(**kwargs)
    return DistContext(dist.get_rank(), dist.get_world_size(), local, dev, name)


def shutdown(together: bool = True) -> None:
    """Leave the job: with together=True a barrier first (a rank whose peers already closed their gloo
    connections can abort at exit); after an error only this rank met, none (its peers may be inside
    another collective: a barrier there would wait forever)."""
    if dist.is_initialized():
        try:
            if together:
                dist.barrier()
        finally:
            dist.destroy_process_group()


class ProcessGroup:
    """A process group as the step and the roles use it (rl_step's `group`): the default one, or `group`.

    Tensors travel on `device` (NCCL moves only GPU memory) and come back where they were.
    group: a torch.distributed subgroup (`dist.new_group`), e.g. the data-parallel ranks of a
    Ray pool (notebook 06); None: the whole world.
    """

    def __init__(self, device: torch.device | str = "cpu", group=None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)

    def all_gather(self, tensor: Tensor) -> Tensor:
        """[n, ...] on every rank (the same n) -> [world_size * n, ...], rank 0's rows first."""
        local = tensor.detach().contiguous().to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).to(tensor.device)

    def all_sum(self, values) -> Tensor:
        """The elementwise sum over ranks of `values` (numbers or a tensor), as a float64 tensor on the CPU."""
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu()

    def all_max(self, value: int) -> int:
        """The largest of the ranks' integers."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def rank_slice(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s contiguous slice of a global batch: items r*k .. r*k+k-1 with k = len / world_size.

    Raises ConfigError when the batch does not divide evenly: every rank must hold whole
    prompts (a prompt's G completions stay together) and as many as the others.
    """
    if len(items) % world_size:
        raise ConfigError("prompts_per_step", len(items),
                          f"a batch of {len(items)} prompts does not divide over {world_size} ranks; every rank "
                          f"needs the same number of whole prompts: use a multiple of {world_size}")
    k = len(items) // world_size
    return items[rank * k:(rank + 1) * k]


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
