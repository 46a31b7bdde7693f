# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Starting a data-parallel job: one process per device under torchrun, gloo on CPUs, NCCL on GPUs.

`init_distributed` reads what torchrun puts in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR), picks the backend for the device, joins the default process group
and returns a `DistContext`. `ProcessGroup` is the small object the step and the roles use
for the few numbers that must be global (rl_step's `group`). `agree` turns a failure on any
rank into an error on every rank, so that a bad input stops the whole job with its cause
instead of leaving the other ranks waiting in a collective. `torchrun` launches a script
or a function from Python (the notebooks, the tests and the measurement jobs do), and ends
every process of the job on a timeout or Ctrl-C (`stop_job`).

Simplified vs torchrun + accelerate: one node, one flat process group, no elastic restarts
(a failed rank ends the job; it resumes from its last sharded checkpoint).
"""

__all__ = ["BACKENDS", "DistContext", "world_from_env", "pick_backend", "init_distributed",
           "shutdown", "leave", "ProcessGroup", "rank_slice", "RankFailed", "agree", "torchrun",
           "output_ends", "stop_job"]

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch import Tensor

from minirl.utils.validate import ConfigError, check_choice

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


def leave(code: int = 0) -> None:
    """End this rank's process now with exit status `code`, after flushing stdout and stderr.

    A rank whose work is done can still die in the interpreter's teardown: a gloo thread that
    is still joinable gets destroyed, and C++ aborts the process ("terminate called without
    an active exception", SIGABRT). Measured on a two-rank job: 1 run in 29 aborted at exit;
    with os._exit, which skips that teardown, 0 in 87. Call it last, after `shutdown`.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


def torchrun(target, nproc: int, args=(), *, timeout: float = 600, stream: bool = False, threads: int = 1,
             env: dict | None = None, grace: float = 5.0) -> subprocess.CompletedProcess:
    """Run `target` under `torchrun --standalone --nproc-per-node nproc`; returns the finished process.

    target: a script's path, or "package.module:function" (every rank imports the module and
    calls the function, which reads its flags from sys.argv, then `leave(0)`); args: its command-line words.
    The job imports this checkout's minirl (PYTHONPATH) with `threads` torch threads per rank;
    stdout and stderr come back together in `.stdout`. stream=True also prints the output as
    it comes (a notebook cell shows progress). The launcher runs in a session of its own and
    torchrun starts each rank in another; after `timeout` seconds, or on Ctrl-C, `stop_job`
    ends all of them (SIGTERM, then SIGKILL `grace` seconds later), and a timeout raises
    subprocess.TimeoutExpired with the output so far. The only launcher in minirl: the
    notebooks, the tests and the measurement jobs of notebooks 03 and 08 all use it.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: must be an int >= 1")
    repo = str(Path(__file__).resolve().parents[2])
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
                    OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    module, _, function = str(target).partition(":")
    if function and not Path(str(target)).exists():       # an entry point, not a file
        entry = ["--no-python", sys.executable, "-c",     # `leave`: no teardown abort after the work is done
                 f"from {module} import {function}; from minirl.parallel.launch import leave; {function}(); leave(0)"]
    else:
        entry = [str(target)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry,
           *map(str, args)]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    expired = threading.Event()

    def on_timeout():
        expired.set()
        stop_job(proc.pid, grace)

    timer = threading.Timer(timeout, on_timeout)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if stream:
                sys.stdout.write(line)
        proc.wait()
    except BaseException:                                # Ctrl-C in the notebook: stop the job too
        stop_job(proc.pid, grace)
        raise
    finally:
        timer.cancel()
        proc.stdout.close()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout, "".join(lines))
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


def output_ends(text: str, n: int = 2500) -> str:
    """The first and last `n` characters of a job's output, or all of a short one (a rank's own
    error comes before torchrun's long summary of the failure, which ends the output)."""
    return text if len(text) <= 2 * n else f"{text[:n]}\n[...]\n{text[-n:]}"


def stop_job(pid: int, grace: float = 5.0) -> None:
    """End process `pid` and everything under it: SIGTERM to all, SIGKILL to what is left after `grace` s.

    torchrun starts every rank in a session of its own (so that it can signal each rank's
    group), so killing the launcher's process group alone would leave the ranks running:
    the processes are found through their parents (psutil), before any is signalled.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
