# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · LoRA + FSDP: the same loop on every rank, and weights that must reach the engine
#
# **By the end of this notebook you can** run notebook 01's RL step on several processes at
# once under `torchrun`, each holding a shard of the trainer (DDP, ZeRO-1, or FSDP2 as
# ZeRO-2/3), with or without LoRA; say exactly which numbers must be reduced across the ranks
# for the result to equal the single-process one; get the sharded weights into a rollout
# engine layer by layer (whole, LoRA-merged, or adapter only) and check that they arrived;
# let the engine give its memory back while the trainer updates (colocation); checkpoint and
# resume a sharded run exactly; and read the vLLM engine that does the same on GPUs.
#
# The source's question: *a model too large for one GPU is trained sharded, and the rollout
# engine needs whole weights after every update. How do they get there, what does it cost,
# and when does the synchronization itself become the bottleneck?* Its symptom table flags
# weight synchronization above **5 %** of the step and proposes syncing only the LoRA
# adapters, packing the transfers or syncing less often; its memory table pairs ZeRO-3 with
# LoRA for a 70 B model. We measure both here, small: per-rank memory at each ZeRO level
# against notebook 03's calculator, and the sync's seconds, bytes and share of the step for
# full fine-tuning, LoRA merged and adapter only, one collective per tensor or packed, every
# step or every K-th.

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from minirl.runtime.notebook import add_to_class

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()   # the repository
RUNS = ROOT / "runs"                                                          # every run lands here
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny policy's matrices are too small to gain from more threads
MiB = 2**20


def show(rows, header):
    """Print a small aligned table (a list of tuples under a header tuple)."""
    rows = [tuple(str(c) for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for j, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("-+-".join("-" * w for w in widths))


# %% [markdown]
# ## 0. The whole stage, first
#
# Before opening the pieces, the stage-4 job running on the package: the chapter script
# under `torchrun` on two CPU processes, each rank holding half of a ZeRO-3-sharded trainer
# with LoRA adapters and an engine of its own, 4 GRPO steps on 4 prompts. It prints what each
# rank held, where a step's time went, what one sync costs in each mode against the
# source's 5 %, and held-out accuracy (4 steps are far too few to learn: section 7 runs the
# long jobs in full mode). The rest of the notebook builds each piece this job ran.

# %%
from minirl.runtime.launch import torchrun  # noqa: E402
from minirl.runtime.progress import step_bar  # noqa: E402

CHAPTER = ROOT / "chapters" / "04_fsdp_lora.py"
LORA_LR = "0.002"   # LoRA's small matrices need a larger step than full fine-tuning's 3e-4


def run_chapter(name: str, *flags, nproc: int = 2) -> tuple[dict, list[dict]]:
    """Run chapters/04_fsdp_lora.py under torchrun into RUNS/name (replacing an earlier run there), with a bar."""
    out = RUNS / name
    steps = int(flags[flags.index("--steps") + 1]) if "--steps" in flags else None
    with step_bar(out / "metrics.jsonl", steps, f"{name} ({nproc} ranks)"):
        job = torchrun(CHAPTER, nproc, ["--out", out, "--overwrite", "--no-progress", *flags], timeout=3600)
    if job.returncode:
        raise RuntimeError(f"{name} failed (exit {job.returncode}):\n{job.stdout[-3000:]}")
    report = job.stdout[job.stdout.find("per-rank memory"):] if "per-rank memory" in job.stdout else ""
    print(f"--- {name} ({nproc} ranks)\n{report.strip()}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), metrics


QUICK = ("--zero", "3", "--lora-rank", "8", "--learning-rate", LORA_LR, "--steps", "4", "--eval-every", "2",
         "--checkpoint-every", "2", "--prompts-per-step", "4", "--num-generations", "4")   # section 7 resumes it
first = run_chapter("04_first", *QUICK)

# %% [markdown]
# ## 1. Many controllers: every rank runs the loop
#
# Stage 1 was one process: it generated, scored, updated and synchronized, in that order.
# Stage 4 starts N copies of that same process with `torchrun`, one per device. Each copy (a
# **rank**) draws the same global batch of prompts from a generator seeded alike on every
# rank, keeps its own share of the prompts (a prompt's G completions stay together, because
# GRPO normalizes within the group), generates them with its own engine, scores them, and
# updates its shard of the trainer. Nobody tells the ranks what to do: each runs the whole
# loop, and they meet only inside collectives (an all-gather of weights in FSDP's forward, an
# all-reduce of gradients, a handful of numbers the step must make global). This is **SPMD**,
# single program multiple data, and it is how NeMo-Aligner runs RLHF on Megatron, where
# every rank executes the same driver loop; the source's framework table calls it *multiple
# controllers*. Notebook 06 builds the opposite: one driver that tells worker groups what to
# run.
#
# | | stage 1 (TRL style) | stage 4 (NeMo-Aligner style, SPMD) |
# |---|---|---|
# | processes | one | N under `torchrun`, identical code |
# | who decides the next stage | the one loop | every rank's own copy of the loop, in lockstep |
# | the batch | all B prompts | B / N prompts per rank, whole groups |
# | trainer state | whole | sharded (ZeRO-1/2/3) or replicated (DDP) |
# | the engine | one copy | one copy per rank, beside that rank's trainer shard |
# | what is communicated | nothing | gradients (and weights under FSDP), a few global numbers, the gathered weights for the engine |
#
# The loop itself does not change: each rank calls notebook 01's `rl_step`. Three of its
# numbers are properties of the *whole* batch, though, and a rank sees only its part: the
# reward standard deviation when `scale_rewards="batch"`, the token count that `dapo`
# divides by, and the batch statistics in the record (mean reward, its std, completion
# length). So `rl_step` gained one optional argument, `group`, the process group: with it,
# those numbers are gathered over the ranks; without it (stage 1, every earlier notebook)
# the step is exactly what it was (no collective, nothing gathered: the `group=None` branch
# is the old code). The dapo token count is the actor's business (section 3).
#
# First, the plumbing: a process group. Under `torchrun` each process finds its rank and the
# world size in its environment. On CPUs the backend is gloo, on GPUs NCCL; asking for NCCL
# on a machine without CUDA is an error that says so, raised before anything is loaded.

# %%
# | export minirl/parallel/launch.py
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


# %% [markdown]
# Joining the job: each process reads its rank from the environment torchrun set, picks gloo
# or NCCL for its device, and joins the default process group. Outside torchrun the same call
# makes a group of one, so the sharded code also runs in this kernel.

# %%
# | export minirl/parallel/launch.py
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


# %% [markdown]
# Leaving a job takes two steps. `shutdown` closes the process group (all ranks together,
# unless one rank alone met an error), and `minirl.runtime.launch.leave` ends the process
# without the interpreter's teardown, where a gloo thread can still abort a rank whose work is
# done:

# %%
# | export minirl/parallel/launch.py
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


# %% [markdown]
# Next, what the step and the roles use for the few global numbers, a rank's slice of the
# batch, and `agree`, which turns one rank's failure into an error on every rank:

# %%
# | export minirl/parallel/launch.py
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


# %% [markdown]
# A bad input on one rank must not leave the others blocked in a collective. `agree` runs a
# piece of work on every rank and, when it raised anywhere, raises on every rank, naming the
# rank that failed and its error.

# %%
# | export minirl/parallel/launch.py
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


# %% [markdown]
# The launcher that starts such a job from Python is plumbing, hand-written in
# `minirl/runtime/launch.py`: `torchrun(target, nproc, args)` runs a script (or a function)
# under `torch.distributed.run` on N local processes and returns its output, and on a timeout
# or Ctrl-C ends every rank it started (`stop_job`). The notebooks, the tests and the
# measurement jobs of notebooks 03 and 08 use it, and so does the chapter's `--nproc-per-node`.

# %% [markdown]
# A stage-4 run needs a few settings beyond notebook 01's `RLConfig`: how the trainer is
# sharded, LoRA, how the weights travel to the engine, which engine. They live in their own
# dataclass, checked when built like every config here; the chapter script turns each field
# into a flag (`--zero`, `--lora-rank`, `--sync-mode`, ...). `check_parallel` adds the checks
# that need the world size or span both configs, so that every rank refuses a bad job in its
# first second, before it loads a model.

# %%
# | export minirl/sync/modes.py
"""The ways a weight sync can hand a policy to the engine: all of its weights, LoRA merged in, or the adapter alone.

`SYNC_MODES` names them once for `minirl.sync.sharded.ShardedSync`, which implements them
(section 4), and for stage 4's `--sync-mode` flag, which lists them before torch loads (this
module imports nothing).
"""
SYNC_MODES = ("full", "merged", "adapter")   # every tensor; W + (alpha / r) B A under the base names; A and B only


# %%
# | export minirl/parallel/config.py
"""Stage 4's settings: how the trainer is sharded, LoRA, how weights reach the engine, how vLLM is sized.

The algorithm, sampling, optimizer and run settings stay in RLConfig (notebook 01), the
engine too (`rollout_engine`, a name of notebook 01's engine registry, vLLM included); a
stage-4 run adds these. Every value is checked when the dataclass is built, and
`check_parallel` adds the checks that need the world size or the RLConfig, so that every
rank of a job refuses a bad one before it loads anything.

Importing it is light (no torch): a chapter builds its flags from these fields and refuses a
bad command line before the heavy imports.
"""

from dataclasses import dataclass

from minirl.config import RLConfig
from minirl.memory.calculator import LORA_TARGETS, ZERO_LEVELS
from minirl.rollout.registry import check_engine
from minirl.runtime.validate import ConfigError, check_choice, check_float, check_int
from minirl.sync.modes import SYNC_MODES

MIXED_PRECISION = ("none", "bf16")


# %% [markdown]
# The dataclass: one field per flag of the chapter, each value checked in `__post_init__`
# when the config is built, so that a bad flag fails before anything heavy is imported.

# %%
# | export minirl/parallel/config.py
@dataclass
class ParallelConfig:
    """How a data-parallel GRPO run shards, adapts and synchronizes (chapters/04_fsdp_lora.py's flags)."""

    zero: int = 3                      # 0: DDP; 1: + sharded Adam (ZeRO-1); 2, 3: FSDP2 (ZeRO-2 / ZeRO-3)
    lora_rank: int = 0                 # LoRA rank r (peft); 0: full fine-tuning
    lora_alpha: float = 0.0            # LoRA's alpha: the update is (alpha / r) B A; 0: 2 * lora_rank
    lora_target_modules: str = ",".join(LORA_TARGETS)  # comma-separated names of the adapted linear layers
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    mixed_precision: str = "none"      # bf16: FSDP2 computes in bfloat16, reduces in float32 (zero 2, 3)
    cpu_offload: bool = False          # FSDP2 keeps shards, gradients and Adam in CPU memory (CUDA, zero 2, 3)
    sync_mode: str = "auto"            # full, merged (LoRA folded in), adapter (A and B only); auto: by LoRA
    packed_sync: bool = True           # whole layers packed into one all-gather per bucket; off: one per tensor
    sync_bucket_mb: float = 256.0      # packed: layers share one all-gather up to this many MiB; 0: one layer
    sync_every: int = 1                # push the weights every K steps: batches up to K-1 updates stale
    colocate: bool = True              # the engine releases its weights during the update, refilled at the sync
    backend: str = "auto"              # process-group backend: auto picks nccl on CUDA, gloo on CPU
    verify_sync: bool = False          # after every push, compare every engine tensor with the trainer's (slow)
    seed_per_prompt: bool = False      # a seed per prompt: the batch does not depend on the world size (slower)
    vllm_gpu_memory_utilization: float = 0.3  # vllm engine: the share of the GPU it may take (the trainer's: the rest)
    vllm_max_num_batched_tokens: int = 4096   # vllm engine: tokens per scheduler step (TRL's colocate value)

    choices = {"zero": ZERO_LEVELS, "sync_mode": ("auto", *SYNC_MODES),
               "mixed_precision": MIXED_PRECISION, "backend": ("auto", "gloo", "nccl")}

    def __post_init__(self):
        for name, allowed in self.choices.items():
            check_choice(name, getattr(self, name), allowed)
        check_int("lora_rank", self.lora_rank, low=0, why="0 is full fine-tuning")
        check_float("lora_alpha", self.lora_alpha, low=0.0, why="0: twice the rank")
        check_float("sync_bucket_mb", self.sync_bucket_mb, low=0.0, why="0: one decoder layer per all-gather")
        check_float("vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, low=0.0, high=1.0,
                    low_open=True)
        check_int("vllm_max_num_batched_tokens", self.vllm_max_num_batched_tokens, low=1)
        check_int("sync_every", self.sync_every, low=1, why="1: push after every update; K: after every K-th, "
                                                          "the rollout up to K-1 updates behind")
        if self.sync_every > 1 and self.colocate:
            raise ConfigError("sync_every", self.sync_every, "a colocated engine discards its weights after every "
                                                             "generate, so every step must refill them: pass "
                                                             "--no-colocate (the engine keeps its copy), or "
                                                             "--sync-every 1")
        if self.lora_rank and not self.targets:
            raise ConfigError("lora_target_modules", self.lora_target_modules, "name at least one linear layer")
        mode = self.resolved_sync_mode
        if mode in ("merged", "adapter") and not self.lora_rank:
            raise ConfigError("sync_mode", self.sync_mode, "merging or shipping an adapter needs LoRA: pass "
                                                           "--lora-rank R, or --sync-mode full")
        if mode == "full" and self.lora_rank:
            raise ConfigError("sync_mode", self.sync_mode, "with LoRA the engine needs the adapter merged "
                                                           "(--sync-mode merged) or applied (--sync-mode adapter)")
        if self.zero < 2 and (self.mixed_precision != "none" or self.cpu_offload):
            flag = "mixed_precision" if self.mixed_precision != "none" else "cpu_offload"
            raise ConfigError(flag, getattr(self, flag), f"is FSDP2's (MixedPrecisionPolicy / CPUOffloadPolicy) and "
                                                         f"--zero {self.zero} is DDP; use --zero 2 or 3")


# %% [markdown]
# Three values derived from the fields: the LoRA target modules as a tuple, alpha (twice the
# rank unless set), and the sync mode "auto" resolves to (merged with LoRA, full without).

# %%
# | export minirl/parallel/config.py
@add_to_class(ParallelConfig)
@property
def targets(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.lora_target_modules.split(",") if t.strip())


@add_to_class(ParallelConfig)
@property
def alpha(self) -> float:
    return self.lora_alpha or 2.0 * self.lora_rank


@add_to_class(ParallelConfig)
@property
def resolved_sync_mode(self) -> str:
    if self.sync_mode != "auto":
        return self.sync_mode
    return "merged" if self.lora_rank else "full"


# %% [markdown]
# The checks that need the world size, or the two configs together:

# %%
# | export minirl/parallel/config.py
def check_parallel(pconfig: ParallelConfig, config: RLConfig, world_size: int) -> None:
    """The checks that need the world size or both configs; ConfigError naming the flag and the fix.

    Run on every rank before anything is loaded: each rank reaches the same verdict on its
    own, so the job stops everywhere with the cause and no rank waits for another.
    """
    B = config.run.prompts_per_step
    if B % world_size:
        raise ConfigError("prompts_per_step", B, f"{B} prompts do not divide over {world_size} ranks; every rank "
                                                 f"needs the same number of whole prompts: use a multiple of "
                                                 f"{world_size}, e.g. {world_size * max(1, B // world_size)}")
    if config.algorithm.algo != "grpo":
        raise ConfigError("algo", config.algorithm.algo, "stage 4 trains GRPO (the critic is not sharded here); "
                                                         "use --algo grpo, or chapters/01_single_process.py for PPO")
    cuda = config.run.device.startswith("cuda")
    if pconfig.cpu_offload and not cuda:
        raise ConfigError("cpu_offload", True, "moves FSDP2's shards from the GPU to CPU memory, and this run is "
                                               "already on the CPU; drop --cpu-offload")
    check_engine(config)                     # a name of the registry, and one this machine can run (vLLM: CUDA)
    if config.rollout.rollout_engine == "vllm":
        if pconfig.verify_sync:
            raise ConfigError("verify_sync", True, "vLLM keeps its weights fused inside its workers and cannot "
                                                   "hand them back by name; drop --verify-sync with "
                                                   "--rollout-engine vllm")
        if pconfig.resolved_sync_mode == "adapter":
            raise ConfigError("sync_mode", "adapter", "minirl's vLLM engine takes whole (merged) weights; vLLM "
                                                      "serves adapters through LoRA requests, not wired here: "
                                                      "use --sync-mode merged with --rollout-engine vllm")

# %% [markdown]
# The notebook itself joins a process group of one (through a file store, no `torchrun`), so
# that FSDP2, DTensors and the sync below run here exactly as on every rank of a real job.
# And the checks: each names the flag and the fix, before anything is loaded.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.parallel.config import ParallelConfig, check_parallel  # noqa: E402
from minirl.parallel.launch import ProcessGroup, init_distributed, pick_backend  # noqa: E402

ctx = init_distributed()
group = ProcessGroup(ctx.device)
print(f"rank {ctx.rank} of {ctx.world_size}, backend {ctx.backend}, device {ctx.device}")
for bad in (lambda: check_parallel(ParallelConfig(), RLConfig.from_flat(prompts_per_step=6), 4),
            lambda: check_parallel(ParallelConfig(), RLConfig.from_flat(rollout_engine="vllm"), 2),
            lambda: check_parallel(ParallelConfig(), RLConfig.from_flat(rollout_engine="tgi"), 2),
            lambda: pick_backend("nccl", "cpu"),
            lambda: ParallelConfig(zero=1, mixed_precision="bf16"),
            lambda: ParallelConfig(sync_every=0),
            lambda: ParallelConfig(sync_every=4)):
    try:
        bad()
        print("accepted (vLLM / CUDA are present here)")
    except ValueError as err:
        print(f"{type(err).__name__}: {err}")

# %% [markdown]
# ## 2. Wrapping the trainer: DDP, ZeRO-1, FSDP2, LoRA
#
# Notebook 03 measured what each ZeRO stage keeps per GPU with the wrappers it built,
# `minirl/memory/wrap.py` (its appendix); here the same wrappers train, so the bytes measured
# there are the bytes of the trainer here.
#
# | `--zero` | wrapper | each rank holds |
# |---|---|---|
# | 0 | `DistributedDataParallel` | everything; gradients are all-reduced |
# | 1 | DDP + `ZeroRedundancyOptimizer` | everything but Adam's state, which is split by whole tensors |
# | 2 | FSDP2 `fully_shard(reshard_after_forward=False)` per decoder layer | shards; a layer's full weights from its forward to its backward |
# | 3 | FSDP2 `fully_shard(reshard_after_forward=True)` | shards; each layer gathered for its forward, freed, gathered again for backward |
#
# FSDP2 shards each decoder layer as one unit (the layer classes a Hugging Face model lists in
# `_no_split_modules`, as accelerate and TRL do) and the rest of the model as the root unit.
# Options: a `MixedPrecisionPolicy` (compute in BF16, reduce gradients in FP32: the source's
# 2 + 2 + 12 bytes), a `CPUOffloadPolicy` (shards, gradients and Adam state in host memory),
# and per-layer gradient checkpointing.
#
# LoRA goes *inside* FSDP: peft first replaces each targeted linear layer by one that holds
# the frozen base weight and two small trainable matrices A (r × in) and B (out × r), then
# FSDP2 shards the result. Frozen and trainable tensors share one FSDP unit, which FSDP2
# allows (FSDP1 needed `use_orig_params=True` for it). The optimizer only sees the trainable
# tensors. A target that matches no layer of the model is an error, naming the layers there
# are: peft would otherwise adapt the ones that do match and leave you to find out.

# %% [markdown]
# What FSDP2 leaves in the model: every parameter becomes a `DTensor`, a view of the whole
# tensor of which this rank holds a shard (here, in a group of one, the whole of it). And
# what LoRA leaves trainable, here and on the source's 70 B model: r (d_in + d_out) per
# adapted d_in × d_out matrix is a large share of a 128-wide layer and a small one of an
# 8192-wide layer, and it is also what an adapter-only sync ships (section 4):

# %%
import copy  # noqa: E402

from minirl.memory.wrap import apply_lora, decoder_layers, wrap_model  # noqa: E402
from minirl.models.policy import load_default_policy  # noqa: E402

model, tokenizer, policy_path = load_default_policy()
sharded = wrap_model(copy.deepcopy(model), zero=3, device="cpu")
weight = sharded.module.get_parameter("model.layers.0.mlp.up_proj.weight")
print(f"{len(decoder_layers(model))} decoder layers, each its own FSDP2 unit")
print(f"up_proj.weight: {type(weight).__name__}, placement {weight.placements}, whole {tuple(weight.shape)}, "
      f"this rank's shard {tuple(weight.to_local().shape)}")
from minirl.memory.calculator import LLAMA2_70B, lora_params  # noqa: E402

total = sum(p.numel() for p in model.parameters())
rows = []
for rank in (4, 8, 16):
    adapted = apply_lora(copy.deepcopy(model), rank)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    big = lora_params(LLAMA2_70B, rank) / LLAMA2_70B.param_count()     # the same 7 targets, notebook 03's count
    rows.append((rank, f"{trainable:,}", f"{trainable / total:.1%}", f"{big:.2%}"))
print(f"the policy: {total:,} parameters")
show(rows, ("LoRA rank", "trainable parameters", "of the base", "of a 70 B base (Llama-2-70B)"))

# %% [markdown]
# ## 3. The actor on every rank: a rank's share of the loss
#
# DDP and FSDP *average* the ranks' gradients. That average is the single-process gradient
# only if each rank's loss is the right share of the whole batch's loss. Take `dapo`, TRL's
# default: the sum of the per-token losses over the **whole generation batch**, divided by
# that batch's token count T. Rank r computes notebook 01's loss over its own rows,
# sum_r / T_r. Averaging W such gradients gives (1/W) Σ_r ∇sum_r / T_r, which is not
# ∇(Σ_r sum_r / T) unless every rank happens to hold as many tokens. The fix TRL uses is to
# divide by T / W instead, the global count gathered from all processes, i.e. to weight rank
# r's own loss by
#
#   w_r = W · T_r / T.
#
# Then (1/W) Σ_r w_r ∇loss_r = ∇(Σ_r sum_r / T): the whole batch's gradient, whatever the
# split. The other loss types differ:
#
# | `loss_type` | the batch's loss | w_r | why |
# |---|---|---|---|
# | `dapo` | Σ tokens / T (global count) | W · T_r / T | TRL gathers `num_items_in_batch` over processes |
# | `grpo` | mean over sequences of per-sequence means | W · N_r / N | 1 when every rank holds N / W rows |
# | `dr_grpo` | Σ tokens / (N · L) | W · N_r / N | a constant denominator |
# | `bnpo` | Σ tokens / T_r *per process* | 1 | TRL normalizes by each process's own tokens: the batch's loss is the mean of the ranks' |
#
# So `bnpo` and `dapo`, equal in one process (notebook 01 said so), part ways here: that is
# the difference between them. `cispo` normalizes as `dapo` does, and weighs as it does. Each
# loss type's entry in notebook 01's registry holds its w_r (`rank_weight`, section 4.1 there),
# beside its normalization and its micro-batch weight: a loss type added there is complete
# here too, and nothing below names one.
#
# How does the weight get into the loss without rewriting `Actor.update`? Every term of the
# GRPO loss (the clipped surrogate, the KL, the bias-corrected KL) depends on the
# parameters only through the log-probs. So scaling the gradient that flows back through
# the log-probs by w_r scales the gradient of the whole loss by w_r, while every value
# (ratios, clip fractions, the loss printed) stays the rank's own. `DistributedActor`
# overrides only `_micro_logprobs` (the log-probs of one micro-batch of notebook 01's update)
# to do that, and `update` to compute w_r first and to reduce the
# metrics afterwards into one record, the same on every rank: token-weighted means of the
# ranks' values, global minima and maxima, and the batch's loss (1/W) Σ_r w_r loss_r. The
# critic's value loss depends on its parameters only through the values, so
# `DistributedCritic` (used by notebook 06's PPO on a pool of several ranks) scales the
# gradient there; what both share lives once, in `DataParallelRole`.
#
# Two more rules. Every rank must make the same forward passes, because under FSDP each
# pass all-gathers weights with the other ranks (and DDP broadcasts its buffers in every
# forward). Notebook 01's update runs in micro-batches of similar length (its section 11.4),
# and a rank with longer completions makes more of them; so every rank splits its largest
# micro-batches in two until it has as many as the rank with the most (`split_micro_batches`:
# real work, never an empty pass). Its forward also makes one pass when the completions are
# one token long and two otherwise, and the longest completion differs from rank to rank; so
# the role first pads its batch, with masked columns, to the longest completion of *any* rank. And a
# rank whose loss is not finite skips its optimizer step (notebook 01), but under DDP or
# FSDP a rank that skips its backward leaves the others waiting in the gradient all-reduce
# until the job's timeout. So the ranks agree first: whether any of them holds a non-finite
# batch (an advantage, a log-prob, a value that is NaN or infinite), and after the training
# forward whether any of them got a non-finite output. If one did, every rank skips.

# %%
# | export minirl/parallel/roles.py
"""The roles on every rank of a data-parallel job: notebook 01's Actor and Critic, with a rank's share of the loss.

`DistributedActor` and `DistributedCritic` take a model prepared by `minirl.memory.wrap`
(DDP, ZeRO-1, FSDP2, with or without LoRA) and a `ProcessGroup`: torchrun's world (stage
4) or the data-parallel ranks of a Ray pool (stage 6). Each rank updates on its share of
the global batch and the wrapper averages the gradients; for that average to be the
gradient of the whole batch, each rank's loss is weighted by its share of the global
normalization (its loss type's `rank_weight`), applied as a gradient scale on the output of the
training forward (the actor's log-probs, the critic's values), so notebook 01's `update`
runs unchanged. `DataParallelRole` holds what both roles share: the weighting, one metric
record for all ranks (`reduce_metrics`), and the rule that a non-finite batch or forward
on any rank makes every rank skip the step together (none waits in a collective).

Simplified: with beta > 0 the reference is a full, unsharded copy on every rank; the critic
is wrapped by DDP only (its value model names no decoder layers for FSDP2; stage 4 trains
GRPO); a loss that overflows on one rank from finite inputs and log-probs (an exp inside
the loss) is not caught before the backward, and leaves the others waiting until the timeout.
"""

import torch
from torch import Tensor


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    """`x` unchanged in value; the gradient flowing back through it is multiplied by `scale`."""
    return _ScaleGradient.apply(x, scale)


# %% [markdown]
# The rest: the metrics reduced over the ranks, the padding to the widest completion, what
# both roles share, and the two roles. Every rank updates on its own rows, so every rank
# has its own record of the update (its loss, its clip ratios, its gradient norm), and the
# run must log one record, the same on every rank. How each number combines depends on what
# it is: a per-token mean is the token-weighted mean of the ranks', a minimum the smallest,
# the loss the weighted sum that defines the batch's loss. This is exercise 4.1.

# %%
# | export minirl/parallel/roles.py
import dataclasses
import math

from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Batch, Experience, Rollout
from minirl.loss_types import loss_type_entry
from minirl.memory.wrap import Wrapped, make_optimizer
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic

LOSSES = ("loss", "value_loss")       # the metrics that are a role's loss: the batch's is (1/W) sum_r w_r loss_r


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def reduce_metrics(records: list[dict], tokens: list[float], loss_weights: list[float] | None = None) -> dict:
    """The ranks' update metrics as one record; every rank that reduces the same lists gets the same record.

    records[r], tokens[r]: rank r's metrics and its completion tokens; loss_weights[r]: its
    w_r (its loss type's `rank_weight`), or None. Keys ending in "/min" take the global min; "/max" and
    "skipped" the global max (a step that one rank skipped, every rank skipped); "grad_norm"
    is rank 0's (the norm of the averaged gradients: already global); a loss (`LOSSES`) is
    the batch's, (1 / W) sum_r w_r loss_r, when the weights are given; every other number is
    the token-weighted mean of the ranks' values (exact for per-token means; for "ratio/std"
    the mean of the ranks' stds). Anything else, and a key some rank lacks, is rank 0's.
    One rank: its record unchanged.
    """
    if len(records) == 1:
        return dict(records[0])
    # BEGIN SOLUTION
    total = sum(tokens) or 1.0
    out = {}
    for key, value in records[0].items():
        values = [r.get(key) for r in records]
        if not all(_number(v) for v in values):
            out[key] = value
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith(("/max", "skipped")):
            out[key] = max(values)
        elif key.endswith("grad_norm"):
            out[key] = value
        elif key in LOSSES and loss_weights is not None:
            out[key] = sum(w * v for w, v in zip(loss_weights, values, strict=True)) / len(records)
        else:
            out[key] = sum(v * t for v, t in zip(values, tokens, strict=True)) / total
    return out
    # END SOLUTION


# %% [markdown]
# Ranks must run the same number of forward and backward passes (FSDP gathers weights inside
# each one). These helpers pad completions to a common width, split micro-batches until every
# rank has as many, and check that an update's inputs are finite.

# %%
# | export minirl/parallel/roles.py
def pad_completions(batch: Batch, width: int) -> Batch:
    """A copy of a Rollout or Experience whose [N, C] tensors are right-padded to `width` columns.

    The new columns are padding (pad id in `*_ids`, 0 elsewhere, mask 0), so no loss or
    metric sees them; earlier positions do not attend to later ones, so no value changes.
    """
    values = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Batch):
            value = pad_completions(value, width)
        elif (isinstance(value, Tensor) and value.dim() == 2 and f.name not in batch.LEFT_PADDED
              and value.shape[1] < width):
            filler = value.new_full((value.shape[0], width - value.shape[1]), batch.pad_value(f.name))
            value = torch.cat([value, filler], 1)
        values[f.name] = value
    return dataclasses.replace(batch, **values)


def split_micro_batches(plan: list[list[int]], count: int) -> list[list[int]]:
    """`plan` (lists of rows) with its largest micro-batches halved until it holds `count` of them.

    Every rank then makes as many forward and backward passes as the rank with the most,
    all of them on real rows. Raises ValueError when there are fewer rows than `count` (ranks
    with very different numbers of rows).
    """
    plan = [list(rows) for rows in plan]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda i: len(plan[i]))
        if len(plan[k]) < 2:
            raise ValueError(f"split_micro_batches: {sum(map(len, plan))} rows cannot make {count} micro-batches; "
                             "give every rank as many rows (Batch.split)")
        rows = plan.pop(k)
        plan[k:k] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return plan


def finite_batch(exp: Experience) -> bool:
    """Whether every number computed for the update (rewards, advantages, log-probs, values, returns, IS weights)
    is finite."""
    tensors = [exp.rewards] + [getattr(exp, name) for name in exp.OPTIONAL]
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


# %% [markdown]
# What both trained roles share (`DataParallelRole`): joining the group, padding to the
# widest completion, agreeing on a skip, the rank's weight and the reduced record:

# %%
# | export minirl/parallel/roles.py
class DataParallelRole:
    """What makes one of notebook 01's trained roles data-parallel; mixed in before `Actor` or `Critic`.

    A role sets `self.module` (the plain model underneath: names, state_dict), `self.zero`
    and `self.group` (a ProcessGroup) with `_join`, and passes the output of its training
    forward through `_weighted`. `update` pads the batch to the widest completion of any
    rank, agrees on the rank's weight and on whether any rank's batch is not finite (then
    `skip_field` becomes NaN on every rank, so that notebook 01's update skips its step
    everywhere), runs the role's own update, and returns `reduce_metrics` of every rank's
    metrics, plus "<loss_key>_weight": rank 0's w. Every rank must call `update` together.
    """

    skip_field = "advantages"           # the Experience field the role's loss reads, made NaN to skip
    loss_key = "loss"

    def _join(self, wrapped: Wrapped, group) -> None:
        self.module, self.zero, self.group = wrapped.module, wrapped.zero, group
        self.grad_scale, self.skipping = 1.0, False

    def _weighted(self, output: Tensor) -> Tensor:
        """The training forward's output: NaN on every rank if it is not finite on one; its gradient scaled by w_r.

        Forwards without gradient (log-probs and values before the update) pass untouched.
        """
        if not output.requires_grad:
            return output
        if not self.skipping and self.group.all_sum([float(not torch.isfinite(output).all())]).item():
            output = output * math.nan                       # some rank's forward is not finite: every rank skips
        if self.grad_scale != 1.0:
            output = scale_gradient(output, self.grad_scale)
        return output

    def update(self, exp: Experience) -> dict:
        """The role's update on this rank's rows, its loss weighted by its `rank_weight`; the ranks' one record.

        The batch is first padded to the widest completion of any rank: notebook 01's forward
        makes one pass when C is 1 and two otherwise, and under FSDP (and DDP, which
        broadcasts buffers in every forward) all ranks must make the same passes (the actor
        also agrees on its number of micro-batches: `DistributedActor.micro_batches`).
        """
        exp = pad_completions(exp, self.group.all_max(exp.rollout.num_completion_tokens))
        mask = exp.rollout.completion_mask
        tokens, rows = float(mask.sum()), len(exp.rollout)
        total_tokens, total_rows, bad = self.group.all_sum([tokens, rows, float(not finite_batch(exp))]).tolist()
        if bad:                                  # a NaN on any rank: every rank skips, none waits in a collective
            setattr(exp, self.skip_field, torch.full_like(getattr(exp, self.skip_field), math.nan))
        weight = loss_type_entry(self.algorithm.loss_type).rank_weight(tokens, total_tokens, rows, total_rows,
                                                                       self.group.world_size)
        self.grad_scale, self.skipping = weight, bool(bad)
        try:
            metrics = super().update(exp)
        finally:
            self.grad_scale, self.skipping = 1.0, False
        records, rank_tokens, weights = (list(column) for column in zip(*self.group.gather_objects(
            (metrics, tokens, weight)), strict=True))
        return reduce_metrics(records, rank_tokens, weights) | {f"{self.loss_key}_weight": weights[0]}

    def _replicated(self, what: str) -> None:
        if self.zero:
            raise NotImplementedError(f"{what}: a sharded role (zero={self.zero}) is checkpointed with "
                                      "minirl.parallel.checkpoint (DCP)")


# %% [markdown]
# And the two roles: the actor scales the gradient through its log-probs, the critic
# through its values:

# %%
# | export minirl/parallel/roles.py
class DistributedActor(DataParallelRole, Actor):
    """Notebook 01's Actor on one rank of a data-parallel job.

    wrapped: from `minirl.memory.wrap.wrap_model`; `self.model` is what gets called (the
    DDP wrapper or the FSDP2 model), `self.module` the model underneath (names, config).
    group: a `minirl.parallel.launch.ProcessGroup` (all_sum, all_max, gather_objects, world_size).
    checkpointing: the model recomputes its layers in backward (`set_checkpointing`);
    transformers then turns the KV cache off in training, so the log-probs take one pass over
    every row instead of sharing each group's prompt (same values, more compute).
    Every rank makes as many micro-batches as the rank with the most (`micro_batches`).
    """

    def __init__(self, wrapped: Wrapped, algorithm: AlgorithmConfig, optimizer: OptimizerConfig,
                 sampling: SamplingConfig, group, checkpointing: bool = False):
        super().__init__(wrapped.wrapper, algorithm, optimizer, sampling)
        self._join(wrapped, group)
        self.checkpointing = checkpointing
        self.optimizer = make_optimizer(wrapped, torch.optim.AdamW, lr=optimizer.learning_rate,
                                        weight_decay=optimizer.weight_decay)

    def micro_batches(self, rollout: Rollout) -> list[list[int]]:
        """This rank's micro-batches, split until there are as many as on the rank with the most."""
        plan = super().micro_batches(rollout)
        return split_micro_batches(plan, self.group.all_max(len(plan)))

    def _shares_prompt(self) -> bool:
        return not (self.checkpointing and self.model.training)   # no KV cache: no shared prompt pass

    def _micro_logprobs(self, scorer, k: int, with_entropy: bool = False):
        logps, entropy = super()._micro_logprobs(scorer, k, with_entropy)
        return self._weighted(logps), entropy

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """[N, C] log-probs, computed at the step's widest completion (every rank runs the same passes)."""
        C = rollout.num_completion_tokens
        return super().logprobs(pad_completions(rollout, self.group.all_max(C)))[:, :C]

    def named_weights(self):
        """(name, tensor) of the model underneath: DTensor shards under FSDP2, whole tensors under DDP."""
        return self.module.state_dict().items()

    def state_dict(self) -> dict:
        """The optimizer's state, when every rank holds all of it (zero 0: DDP replicas)."""
        self._replicated("state_dict")
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._replicated("load_state_dict")
        super().load_state_dict(state)


# %% [markdown]
# The critic gets the same treatment for PPO (notebook 06 runs it on a pool of ranks): a
# forward hook passes the values of its training forward through `_weighted`.

# %%
# | export minirl/parallel/roles.py
class DistributedCritic(DataParallelRole, Critic):
    """Notebook 01's Critic on one rank of a data-parallel job (notebook 06's PPO on a pool of several ranks).

    wrapped: the value model from `wrap_model` (zero 0 or 1); a forward hook passes the
    values of the training forward through `_weighted`. A skip makes the returns NaN.
    """

    skip_field, loss_key = "returns", "value_loss"

    def __init__(self, wrapped: Wrapped, algorithm: AlgorithmConfig, optimizer: OptimizerConfig, group):
        super().__init__(wrapped.wrapper, algorithm, optimizer)
        self._join(wrapped, group)
        self.optimizer = make_optimizer(wrapped, torch.optim.AdamW, lr=optimizer.value_learning_rate,
                                        weight_decay=optimizer.weight_decay)
        self.model.register_forward_hook(lambda module, args, values: self._weighted(values))

    def state_dict(self) -> dict:
        """The value model's weights (plain names) and the optimizer's state (zero 0)."""
        self._replicated("state_dict")
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._replicated("load_state_dict")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

# %% [markdown]
# Check the claim on numbers. Split a batch of per-token losses over three "ranks" with
# unequal token counts, compute each rank's gradient of its own loss, weight it, average,
# and compare with the gradient of the whole batch's loss. Without the weights, `dapo`'s
# average is off; with them, every loss type is exact (`bnpo` is its own, per-rank, loss).

# %%
from minirl.loss_types import LOSS_TYPES, aggregate_loss  # noqa: E402

g = torch.Generator().manual_seed(0)
per_token = torch.randn(6, 5, generator=g)
mask = (torch.rand(6, 5, generator=g) < 0.6).long()
mask[:, 0] = 1
parts, T, W = [slice(0, 2), slice(2, 4), slice(4, 6)], int(mask.sum()), 3
rows = []
for loss_type in ("dapo", "grpo", "dr_grpo", "cispo"):
    rank_weight = LOSS_TYPES[loss_type].rank_weight
    x = per_token.clone().requires_grad_(True)
    aggregate_loss(x, mask, loss_type, 5).backward()
    whole = x.grad.clone()
    errors = []
    for weighted in (False, True):
        x.grad = None
        for part in parts:
            w = rank_weight(int(mask[part].sum()), T, 2, 6, W) if weighted else 1.0
            (w / W * aggregate_loss(x[part], mask[part], loss_type, 5)).backward()
        errors.append((x.grad - whole).abs().max().item() / whole.abs().max().item())
    rows.append((loss_type, [int(mask[p].sum()) for p in parts],
                 [round(rank_weight(int(mask[p].sum()), T, 2, 6, W), 3) for p in parts],
                 f"{errors[0]:.1%}", f"{errors[1]:.1e}"))
show(rows, ("loss_type", "tokens per rank", "w_r", "error, plain average", "error, weighted"))
assert all(float(r[4]) < 1e-5 for r in rows)

# %% [markdown]
# ## 4. Getting sharded weights into the engine
#
# After the update, every rank's engine must hold the new policy. Under FSDP2 no rank has
# it: each holds a 1/W shard of every tensor (a `DTensor`), and the engine wants whole tensors
# under its own names. The naive sync gathers the full state dict on every rank and hands it
# over: that costs a full extra copy of the model at the worst moment, when the trainer's
# shards, its gradients, Adam's state and the engine all sit on the same device. The sync
# here walks the state **one decoder layer at a time**: gather that layer's tensors (an
# all-gather every rank joins, in the same order), turn them into what the engine loads, hand
# them over, drop them, then the next layer. The extra memory is about one layer, and the sync
# measures it (`peak_bytes`: the bytes of gathered tensors alive at once, counted as they
# are created and freed). This is what TRL does for FSDP2 (`full_tensor()` per parameter)
# and veRL does with per-layer summoning.
#
# With LoRA there are three ways to ship the policy:
#
# | mode | what travels | the engine holds | cost |
# |---|---|---|---|
# | `full` | every tensor (full fine-tuning) | the policy | the model's bytes |
# | `merged` | W + (α/r) B A for each adapted layer, under the base names | the merged policy | the model's bytes, plus a matmul per layer |
# | `adapter` | only A and B | the frozen base + the adapter, applied at generation | A and B's bytes: r (d_in + d_out) per d_in × d_out matrix, section 2's share (large on this 128-wide policy, a fraction of a percent on a 70 B one); the engine computes B A x at every token |
#
# `merged` is what TRL and OpenRLHF do; `adapter` is the source's advice for a slow sync
# (vLLM serves LoRA adapters natively; veRL can ship adapters only). Exercise 4.2 is
# `gather_by_layer`, exercise 4.3 is `merge_lora`.

# %%
# | export minirl/sync/sharded.py
"""Weight sync from a sharded trainer: gather layer by layer, merge LoRA or ship only the adapter.

Under FSDP2 each rank holds 1/W of every tensor (a DTensor shard); the engine needs whole
tensors under its own names. `ShardedSync.push` walks the trainer's state one decoder layer
at a time: gathers that layer's full tensors (an all-gather every rank joins, in the same
order), turns them into what the engine loads, and streams them into the engine before it
gathers the next layer, so the gathered copy stays about one layer (`peak_bytes`, measured).
Packed (the default), whole layers travel together: one flat buffer per rank and one
all-gather per bucket of layers (`gather_buckets`, `gather_packed`), instead of one per
tensor (`gather_by_layer`); the gathered copy is then about two buckets.
Three modes:
  full:    every tensor, under the engine's (Hugging Face) names;
  merged:  LoRA folded into the base weights, W + (alpha / r) B A, under the base names;
  adapter: only LoRA's A and B (the engine keeps the frozen base and applies the adapter).
It ends with the version check every sync makes (`check_pushed`) and, on request, the
stale-parameter check of notebook 02, within the engine dtype's rounding.

Simplified vs TRL / veRL: buckets are decoder layers (no byte-sized buckets spanning layers,
no CUDA IPC handles); one LoRA adapter ("default"); no DoRA, no modules_to_save.
"""

import re
from typing import Iterable, Iterator

from torch import Tensor

from minirl.sync.modes import SYNC_MODES

PEFT_PREFIX = "base_model.model."
LAYER = re.compile(r"\.layers\.\d+\.")
LORA = re.compile(r"^(?P<stem>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


def engine_name(name: str) -> str:
    """A trainer tensor's Hugging Face name: peft's "base_model.model." prefix and ".base_layer" removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def layer_key(name: str) -> str:
    """The decoder layer a tensor belongs to ("...layers.3."), or the name itself outside the layers."""
    match = LAYER.search(name)
    return name[:match.end()] if match else name


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (an all-gather: every rank must call it), else the tensor."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# %% [markdown]
# Gathering layer by layer: the consumer asks for one layer, every rank gathers that layer's
# shards, and the memory of whole tensors never exceeds about one layer.

# %%
# | export minirl/sync/sharded.py
def gather_by_layer(named_weights: Iterable[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainer's tensors, whole, one layer at a time.

    named_weights: (name, tensor) pairs in state_dict order; a tensor is a DTensor (an FSDP2
    shard) or a plain tensor. Yields lists of (name, whole tensor), names unchanged:
    consecutive names with the same `layer_key` form one list (a decoder layer's tensors),
    any other tensor is a list of its own. Shards are gathered with `full_tensor` (a
    collective: every rank gathers the same tensors in the same order); plain tensors are
    passed on detached. A layer is gathered only when the consumer asks for it, and this
    generator keeps no reference to a layer once it has yielded it: a consumer that drops
    each list before asking for the next holds at most one layer.
    """
    # BEGIN SOLUTION
    layer, key = [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, full_tensor(tensor)))
    if layer:
        yield layer
    # END SOLUTION


# %% [markdown]
# What the engine is sent from a gathered layer: the tensors as they are, a LoRA layer's
# `W + scaling * B @ A` merged into one weight, or the adapters alone.

# %%
# | export minirl/sync/sharded.py
def merge_lora(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """The weight an adapted linear layer computes with: W + scaling * B @ A.

    weight: [out, in] (the frozen base); lora_A: [r, in]; lora_B: [out, r]; scaling: peft's
    `scaling`, alpha / r. The product is computed in float32 and the result returned in
    weight's dtype, [out, in], a new tensor (weight is not modified). Raises ValueError when
    the shapes do not fit together.
    """
    if lora_A.shape[1] != weight.shape[1] or lora_B.shape[0] != weight.shape[0] or lora_B.shape[1] != lora_A.shape[0]:
        raise ValueError(f"merge_lora: weight {tuple(weight.shape)}, A {tuple(lora_A.shape)} and B "
                         f"{tuple(lora_B.shape)} do not fit: need A [r, in], B [out, r] for weight [out, in]")
    # BEGIN SOLUTION
    merged = torch.addmm(weight.float(), lora_B.float(), lora_A.float(), alpha=scaling)   # W + s B A, one op
    return merged.to(weight.dtype)
    # END SOLUTION


def engine_tensors(layer: list[tuple[str, Tensor]], mode: str, scaling: float | None = None
                   ) -> list[tuple[str, Tensor]]:
    """What the engine loads from one gathered layer: see the module docstring for the three modes.

    full and merged give Hugging Face names (`engine_name`); adapter keeps peft's names (the
    engine holds a peft copy). merged needs `scaling` (alpha / r).
    """
    if mode == "adapter":
        return [(name, t) for name, t in layer if LORA.match(name)]
    lora = {(m["stem"], m["which"]): t for name, t in layer if (m := LORA.match(name))}
    out = []
    for name, tensor in layer:
        if LORA.match(name):
            continue
        stem = name.removesuffix(".base_layer.weight")
        if mode == "merged" and stem != name and (stem, "A") in lora:
            if scaling is None:
                raise ValueError("engine_tensors(mode='merged') needs the LoRA scaling alpha / r")
            tensor = merge_lora(tensor, lora[(stem, "A")], lora[(stem, "B")], scaling)
        out.append((engine_name(name), tensor))
    return out


# %% [markdown]
# ### Packed transfers: one collective per bucket, not per tensor
#
# `gather_by_layer` gathers tensor by tensor: `full_tensor()` is one all-gather per tensor,
# 51 of them for the embedded policy (a decoder layer has 12 tensors, biases and norms
# included), each paying the collective's fixed cost (a round trip between the ranks, and
# DTensor's bookkeeping around it) however few bytes it carries. On CPUs with gloo, for a
# model of a few MiB, that fixed cost can be most of the sync (section 7 times a push per
# tensor, per layer and in buckets on two ranks, and prints how much packing saved). The remedy the source names, packing, is what FSDP2 itself
# does for its forward pass (`unshard()`: one all-gather per unit): each rank copies its
# shards of a layer, flat, into one buffer, the buffers are all-gathered in a single
# collective, and every whole tensor is cut out of the result. FSDP2 splits dim 0 as
# `torch.chunk` does, so every rank knows every rank's share of every tensor from the
# global shape alone, and only the data travels.
#
# How much goes into one collective is the bucket size, and it trades round trips for
# memory: the gathered buffer is alive while its whole tensors are cut out of it, so one
# layer per bucket costs about two layers of extra memory (instead of one), and a bucket of
# B bytes about 2 B. slime ships weights to SGLang in buckets of 256 MiB and veRL in 512 MiB;
# minirl's default is 256 MiB of whole layers (a layer is never split). For a 0.5 B model
# in FP32 that is a few layers per collective; for the embedded policy (3.8 MiB) it is the
# whole model in one, which is exactly the trade a latency-bound link wants.

# %%
# | export minirl/sync/sharded.py
import functools
import math

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


@functools.lru_cache(maxsize=4096)
def shard_numels(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    """Elements of every rank's local shard of a tensor of `shape` sharded on dim 0 over `world` ranks.

    FSDP2 and DTensor split dim 0 as `torch.chunk` does: ceil(n / W) rows per rank, the last
    ranks fewer or none. Computed from the global shape alone, so every rank knows every
    rank's share without asking (and once per shape: the answer is cached).
    """
    rows = [len(chunk) for chunk in torch.empty(shape[0], device="meta").chunk(world)]
    rows += [0] * (world - len(rows))
    per_row = math.prod(shape[1:])
    return tuple(r * per_row for r in rows)


def packable(tensor: Tensor) -> bool:
    """A DTensor sharded on dim 0 over a one-dimensional mesh: what FSDP2 holds, and what packing handles."""
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.dim() > 0
            and tuple(tensor.placements) == (Shard(0),))


# %% [markdown]
# Packing: one all-gather per dtype for a whole layer, instead of one per tensor. Each rank
# copies its flat shards into one padded buffer, the buffers are gathered once, and the whole
# tensors are cut out of the result, bit for bit what `full_tensor` gives.

# %%
# | export minirl/sync/sharded.py
def gather_packed(layer: list[tuple[str, Tensor]], meter=None) -> list[tuple[str, Tensor]]:
    """One layer's tensors, whole, with one all-gather per dtype instead of one per tensor.

    layer: (name, tensor) pairs, one decoder layer's (as `gather_by_layer` groups them); a
    tensor is a DTensor shard on dim 0 (FSDP2's), another DTensor, or a plain tensor.
    Returns (name, whole tensor) in the same order, names unchanged: bit for bit what
    `full_tensor` gives. Every rank copies its local shards of the layer's dim-0 DTensors,
    flat, into one buffer padded to the largest rank's size, all-gathers the buffers in one
    collective (every rank must call it, for the same layer), and cuts each whole tensor out:
    rank r's rows of a tensor sit in row r of the result, at that tensor's offset on rank r.
    Other DTensors are gathered one by one (`full_tensor`); plain tensors pass through,
    detached. `meter` (a LiveBytes) counts the gathered buffer, freed once the layer is cut out,
    and each whole tensor from the moment it is cut: at the end both are alive.
    """
    out = [(name, full_tensor(t)) if not packable(t) else None for name, t in layer]
    by_dtype = {}
    for i, (_, t) in enumerate(layer):
        if packable(t):
            by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, items in by_dtype.items():
        mesh = layer[items[0]][1].device_mesh
        rank, world = mesh.get_local_rank(), mesh.size()
        numels = [shard_numels(tuple(layer[i][1].shape), world) for i in items]   # [tensors][ranks]
        width = max(sum(n[r] for n in numels) for r in range(world))
        device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        pad = torch.zeros(width - sum(n[rank] for n in numels), dtype=dtype, device=device)
        mine = torch.cat([layer[i][1].to_local().reshape(-1).to(device) for i in items] + [pad])   # [width]
        rows = torch.empty(world * width, dtype=dtype, device=device)
        dist.all_gather_single(rows, mine, group=mesh.get_group())
        rows = rows.view(world, width)                                           # [W, width]
        if meter is not None:
            meter.track(rows)
        offsets = [0] * world
        for i, n in zip(items, numels, strict=True):
            parts = [rows[r, offsets[r]:offsets[r] + n[r]] for r in range(world)]
            out[i] = (layer[i][0], torch.cat(parts).view(layer[i][1].shape))
            offsets = [o + k for o, k in zip(offsets, n, strict=True)]
            if meter is not None:
                meter.track(out[i][1])                                           # alive beside the buffer
        del rows, mine
    return out


# %% [markdown]
# Buckets: several consecutive layers in one collective (fewer round trips, more memory),
# never splitting a layer, so that a LoRA layer's W, A and B arrive together.

# %%
# | export minirl/sync/sharded.py
def split_by_layer(named_weights: Iterable[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
    """`gather_by_layer`'s lists, ungathered: consecutive names with the same `layer_key` form one list."""
    layer, key = [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, tensor))
    if layer:
        yield layer


def layer_buckets(named_weights: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainer's (name, tensor) pairs, ungathered, in buckets of whole layers of at most `bucket_bytes`.

    Consecutive layers (`split_by_layer`) share a bucket while its whole tensors (global
    sizes: a DTensor's numel is the whole tensor's) stay within `bucket_bytes`. A layer is
    never split: one larger than the cap, or any layer when bucket_bytes is 0, is a bucket alone.
    """
    bucket, size = [], 0
    for layer in split_by_layer(named_weights):
        nbytes = sum(t.numel() * t.element_size() for _, t in layer)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket, size = bucket + layer, size + nbytes
    if bucket:
        yield bucket


def gather_buckets(named_weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = 0,
                   meter=None) -> Iterator[list[tuple[str, Tensor]]]:
    """`gather_by_layer`, packed: lists of whole tensors, one all-gather per bucket of layers (`gather_packed`).

    bucket_bytes=0 gathers one layer per collective (the extra memory stays about two
    layers); a larger cap puts several layers in one collective (fewer round trips, more
    memory: the buffer and the whole tensors of a bucket). Each list holds whole layers, so
    a LoRA layer's W, A and B always arrive together (what `engine_tensors` needs to merge).
    """
    for bucket in layer_buckets(named_weights, bucket_bytes):
        yield gather_packed(bucket, meter)


# %% [markdown]
# The sync itself: stream the engine's tensors into `load_weights` one layer (or one bucket)
# at a time, count the gathered bytes alive at once (each tensor counted from its creation
# until it is freed), check the version, and on request compare every tensor with notebook
# 02's stale-parameter check.

# %%
# | export minirl/sync/sharded.py
import time
import weakref
from dataclasses import dataclass

import torch

from minirl.sync.base import SyncReport, check_pushed
from minirl.sync.checks import dtype_name, rounding_tolerance, stale_parameters


class LiveBytes:
    """Bytes of the tracked tensors still alive, and their peak (each tensor counted until it is freed).

    A storage is counted once: tracking a tensor whose storage is already counted (it was
    tracked where it was made, and is tracked again where it is handed on) adds nothing.
    """

    def __init__(self):
        self.live = self.peak = 0
        self.alive = set()                     # data pointers of the storages counted now

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.alive.discard(key)

    def track(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.alive:
            return
        self.alive.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, key, storage.nbytes())


@dataclass
class ShardedSyncReport(SyncReport):
    """A SyncReport with the peak of gathered bytes alive at once and the mode."""

    peak_bytes: int = 0
    mode: str = "full"


# %% [markdown]
# Above, the byte counter and the report; now `ShardedSync`, which uses them: a push walks
# the layers (or buckets of layers), turns each into what the engine loads, streams it in,
# and checks the version (and, on request, every tensor):

# %%
# | export minirl/sync/sharded.py
class ShardedSync:
    """Stage 4's weight sync: gathered layer by layer from a sharded trainer, in one of three modes.

    mode: "full", "merged" or "adapter" (module docstring); lora_scaling: alpha / r for
    "merged". packed=True gathers whole layers in one all-gather per bucket of at most
    `bucket_bytes` (`gather_buckets`; 0: one layer per all-gather), packed=False one per
    tensor (`gather_by_layer`). verify=True compares every tensor the engine holds with a
    second gathering of the trainer's, within the engine dtype's rounding (notebook 02's
    check; twice the traffic). The last report is kept in `last_report`.
    """

    def __init__(self, mode: str = "full", lora_scaling: float | None = None, verify: bool = False,
                 packed: bool = True, bucket_bytes: int = 0):
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode {mode!r}: use one of {SYNC_MODES}")
        if mode == "merged" and lora_scaling is None:
            raise ValueError("sync mode 'merged' needs lora_scaling (alpha / r)")
        self.mode, self.lora_scaling, self.verify = mode, lora_scaling, verify
        self.packed, self.bucket_bytes = packed, bucket_bytes
        self.last_report = None

    def _source(self, named_weights) -> list[tuple[str, Tensor]]:
        named = list(named_weights)                       # references to shards: nothing is gathered yet
        if self.mode == "adapter":
            named = [(n, t) for n, t in named if LORA.match(n)]
            if not named:
                raise ValueError("sync mode 'adapter': the trainer holds no LoRA tensors (lora_A / lora_B); "
                                 "train with LoRA, or use mode 'full'")
        elif self.mode == "full":                         # a LoRA model's base weights, unmerged: no adapter
            named = [(n, t) for n, t in named if not LORA.match(n)]
        return named

    def push(self, named_weights, engine, version: int) -> ShardedSyncReport:
        """Stream the trainer's weights into `engine` as `version`; check the version (and the weights)."""
        start = time.perf_counter()
        named = self._source(named_weights)
        meter, counts = LiveBytes(), [0, 0]

        def counted():
            for name, tensor in self.stream(named, meter):
                counts[0] += 1
                counts[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        pairs = counted()
        engine.load_weights(pairs, version)
        left = sum(1 for _ in pairs)                      # every rank must join every gather, even now
        if left:
            raise RuntimeError(f"{type(engine).__name__}.load_weights stopped {left} tensors early: an engine must "
                               "consume every tensor it is handed")
        check_pushed(engine, version)
        if self.verify:
            stale = self.stale_tensors(named, engine)
            if stale:
                raise RuntimeError(f"weight sync left the engine stale: {len(stale)} tensors differ beyond "
                                   f"{dtype_name(engine)} rounding (first: {stale[0]})")
        self.last_report = ShardedSyncReport(version, counts[0], counts[1], time.perf_counter() - start,
                                             peak_bytes=meter.peak, mode=self.mode)
        return self.last_report


# %% [markdown]
# The stream `push` hands to the engine: one layer (or bucket) gathered at a time and turned
# into the engine's tensors, the bytes gathered here tracked by the meter. `stale_tensors` is
# `verify=True`'s check: it gathers everything a second time and compares it with the
# engine's copy.

# %%
# | export minirl/sync/sharded.py
@add_to_class(ShardedSync)
def stream(self, named: list[tuple[str, Tensor]], meter: LiveBytes | None = None) -> Iterator[tuple[str, Tensor]]:
    """(engine name, whole tensor) pairs, one layer (or bucket) gathered at a time; new ones tracked by `meter`."""
    own = {full_tensor_storage(t) for _, t in named}
    layers = gather_buckets(named, self.bucket_bytes, meter) if self.packed else gather_by_layer(named)
    for layer in layers:
        for name, tensor in engine_tensors(layer, self.mode, self.lora_scaling):
            if meter is not None and tensor.untyped_storage().data_ptr() not in own:
                meter.track(tensor)                    # gathered or merged here, not the trainer's own
            yield name, tensor
        del layer


@add_to_class(ShardedSync)
def stale_tensors(self, named: list[tuple[str, Tensor]], engine) -> list[str]:
    """Names whose engine copy differs from the trainer's beyond the engine dtype's rounding (gathers again)."""
    held = dict(engine.named_weights())
    dtype, stale = dtype_name(engine), []
    for name, tensor in self.stream(named):
        amax = tensor.abs().max().item() if tensor.numel() else 1.0
        stale += stale_parameters({name: tensor}, {name: held[name]} if name in held else {},
                                  *rounding_tolerance(dtype, amax))
    return stale


# %% [markdown]
# Two helpers: an engine that only copies into buffers, to time a sync alone (section 7's
# table), and the storage a rank holds for a tensor:

# %%
# | export minirl/sync/sharded.py
class SinkEngine:
    """A stand-in engine for timing a sync: copies each tensor it is handed into a buffer of its own.

    Takes any names (allocating a buffer the first time it sees one), so one sync can be timed
    in every mode; what an engine does with the weights afterwards is not part of the sync.
    """

    def __init__(self):
        self.version, self.buffers, self.dtype = 0, {}, "float32"

    def load_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape:
                buffer = self.buffers[name] = torch.empty_like(tensor)
            buffer.copy_(tensor)
        self.version = version

    def named_weights(self):
        return self.buffers.items()


def full_tensor_storage(tensor: Tensor) -> int:
    """The data pointer of the storage a rank holds for `tensor` (its local shard for a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()

# %% [markdown]
# `merge_lora` against peft's own `merge_and_unload`, on a LoRA layer whose B is not zero:

# %%
from minirl.sync.sharded import merge_lora  # noqa: E402

adapted = apply_lora(copy.deepcopy(model), 8)
with torch.no_grad():
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            p.normal_(std=0.02)
state = adapted.state_dict()
stem = "base_model.model.model.layers.0.self_attn.q_proj"
by_hand = merge_lora(state[f"{stem}.base_layer.weight"], state[f"{stem}.lora_A.default.weight"],
                     state[f"{stem}.lora_B.default.weight"], scaling=16 / 8)
by_peft = copy.deepcopy(adapted).merge_and_unload().state_dict()["model.layers.0.self_attn.q_proj.weight"]
print(f"max |merge_lora - peft| = {(by_hand - by_peft).abs().max().item():.2e}")

# %% [markdown]
# The receiving side must stream too. Notebook 01's `HFEngine.load_weights` first builds a
# dict of everything it is handed (so that it can refuse a partial set before copying
# anything), which holds a whole extra copy of the model no matter how carefully the sender
# gathers. `ColocatedEngine` wraps an in-process engine and loads one tensor at a time,
# copying each into place as it arrives. Refusing bad input still works, differently: a name
# the engine does not know, a wrong shape, a version older than the one it holds, or a
# missing tensor at the end is an error, and until a complete push succeeds the engine
# refuses to generate (vLLM's `load_weights` streams the same way).
#
# The same wrapper does **colocation**. The trainer and the engine share the device, and they
# are never busy at the same time: the engine generates while the trainer waits, and the
# trainer updates while the engine waits. So after `generate` the engine goes to sleep,
# releasing the storage of its weights (and of its KV cache, where an engine keeps one
# between calls; the HF engines here build theirs per call), and the next push wakes it up
# by allocating the storage again just before filling it. This is vLLM's sleep mode at level
# 2 (discard, then reload from the trainer), which TRL's colocate mode and veRL's hybrid
# engine use. In `adapter` mode the frozen base must survive the sleep, so only the adapter is
# released: on a GPU vLLM's level 1 would move the base to host memory; on a CPU there is no
# other memory to move it to.
#
# Nothing in the loop calls `sleep` or `wake_up`: the engine sleeps at the end of its own
# `generate` and wakes at the start of the next push, so `rl_step` reads the same colocated
# or not. Notebook 06 puts the same wrapper around the engine of a Ray worker that also hosts
# the actor, with `stream=False`: there the push goes to the engine's own `load_weights`,
# which every engine accepts (the paged engine of notebook 05 also empties its prefix cache
# there), and that worker's in-process sync hands over a whole list anyway.

# %%
# | export minirl/rollout/colocated.py
"""An in-process engine that shares the trainer's device: weights streamed in, released while it waits.

`ColocatedEngine` wraps an engine that holds its policy copy as an nn.Module (`HFEngine`,
`SharedPrefixEngine`, the paged engine of notebook 05). With stream=True, `load_weights`
copies each tensor into place as it arrives, so a sender that gathers layer by layer never
needs a second whole copy; bad input (an unknown name, a wrong shape, an older version, a
tensor missing at the end) is an error, and until a complete push succeeds the engine
refuses to generate. With stream=False the push goes to the engine's own `load_weights`
(its checks, and whatever it derives from the weights: the paged engine empties its prefix
cache). With colocate=True the engine sleeps after every `generate`: the storage of its
weights is released (resized to 0) until the next push wakes it up. Only the tensors every
push brings are released: all of them, or with adapter_only=True just LoRA's A and B (the
frozen base must survive the sleep).

This is the one colocation mechanism of minirl: stage 4 wraps every rank's engine in it,
and stage 6 the engine of a Ray worker that also hosts the actor. The loop never calls
`sleep` or `wake_up`: the engine sleeps at the end of its own `generate` and wakes at the
start of the next `load_weights`, so the step reads the same colocated or not.

Simplified vs vLLM's sleep mode: no KV cache released (the HF engines build it per call;
the paged engine keeps its pool allocated), and level 2 only (released, then refilled by the
next push); level 1 (offload to host memory) has nowhere to go on a CPU.
"""

import contextlib
import hashlib
import time
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Batch, Rollout
from minirl.rollout.base import VersionMismatchError, draw_seed
from minirl.rollout.hf import fp8_round_trip


class EngineNotReady(RuntimeError):
    """The engine is asleep, or its last push did not complete: it holds no usable weights."""


# %% [markdown]
# Three operations on the engine's own tensors: copy a push into them (checking every name
# and shape), give their storage back while the trainer updates, and allocate it again before
# the next push.

# %%
# | export minirl/rollout/colocated.py
def copy_pushed(own: dict[str, Tensor], named_tensors: Iterable[tuple[str, Tensor]], version: int,
                fp8: bool = False) -> None:
    """Copy each pushed (name, tensor) into `own[name]` as it arrives; ValueError for an unknown name, a wrong
    shape, or names of `own` never pushed. fp8: round 2-D tensors through FP8 first (notebook 02's rollout)."""
    seen = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in own:
                raise ValueError(f"load_weights(version={version}): unexpected tensor {name!r}; the engine takes "
                                 f"{len(own)} tensors named like {next(iter(own))!r}: push them under the engine's "
                                 "names (the policy's state_dict names)")
            if own[name].shape != tensor.shape:
                raise ValueError(f"load_weights(version={version}): {name} has shape {tuple(tensor.shape)}, the "
                                 f"engine's has {tuple(own[name].shape)}: is this the engine's model?")
            if fp8 and tensor.dim() >= 2:
                tensor = fp8_round_trip(tensor)              # notebook 02's simulated FP8 rollout
            own[name].copy_(tensor)
            seen.add(name)
    missing = [n for n in own if n not in seen]
    if missing:
        raise ValueError(f"load_weights(version={version}): {len(missing)} of {len(own)} tensors were "
                         f"never pushed (first: {missing[0]}); push all of them: the engine keeps none from "
                         "the last version")


def release_storage(tensors: Iterable[Tensor]) -> int:
    """Resize the storage behind each tensor to 0 (shared storages once), keeping the shapes; returns the bytes."""
    released, seen = 0, set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        released += storage.nbytes()
        storage.resize_(0)
    return released


def restore_storage(tensors: Iterable[Tensor]) -> None:
    """Allocate each released storage again, as large as its tensor needs (contents undefined until refilled)."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
        if storage.nbytes() < needed:
            storage.resize_(needed)

# %% [markdown]
# The engine itself: it refuses to generate while asleep or half-loaded, wakes at the start
# of a push, streams the push in (or hands it to the inner engine), and sleeps after
# generating when colocated:

# %%
# | export minirl/rollout/colocated.py
class ColocatedEngine:
    """Loads pushes into an engine (streamed, or by its own load_weights); with colocate=True, sleeps between them.

    engine: an in-process engine with `.model` (an nn.Module), `.version`, `generate` and
    `load_weights`. adapter_only: pushes bring only the LoRA tensors (names containing
    "lora_"), the base stays resident (needs stream=True). stream: copy each pushed tensor
    into `engine.model` under its state_dict name (for engines that keep nothing derived from
    the weights, such as the HF engines); False: hand the push to `engine.load_weights`.
    record(what): a context manager around every "sleep" and "wake_up" (a Ray worker's
    timeline); `stats` holds the last sleep's and wake-up's seconds and the bytes released.
    """

    def __init__(self, engine, colocate: bool = True, adapter_only: bool = False, stream: bool = True,
                 record=None):
        if adapter_only and not stream:
            raise ValueError("ColocatedEngine(adapter_only=True, stream=False): the engine's own load_weights "
                             "takes every tensor, not only the adapter; pass stream=True")
        self.engine, self.colocate, self.adapter_only, self.stream = engine, colocate, adapter_only, stream
        self.record = record or (lambda what: contextlib.nullcontext())
        state = engine.model.state_dict(keep_vars=True)
        self.names = [n for n in state if not adapter_only or "lora_" in n]
        if not self.names:
            raise ValueError("ColocatedEngine(adapter_only=True): the engine's model holds no LoRA tensors; build "
                             "it from the peft model")
        self.asleep, self.ready = False, True
        self.stats = {"sleep_seconds": 0.0, "wake_seconds": 0.0, "released_bytes": 0}

    @property
    def model(self):
        return self.engine.model

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """The inner engine's `generate`; then, when colocated, sleep until the next push."""
        if self.asleep or not self.ready:
            raise EngineNotReady(f"{type(self.engine).__name__} is {'asleep' if self.asleep else 'half-loaded'}: "
                                 "push the trainer's weights (sync.push / load_weights) before generating")
        rollout = self.engine.generate(prompts, sampling, expected_version, generator)
        if self.colocate:
            self.sleep()
        return rollout

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load the push (streamed, or by the engine's own load_weights); then the engine holds `version`.

        Wakes the engine first if it sleeps. Raises VersionMismatchError for a version older
        than the one held; streamed, ValueError naming an unknown name, a wrong shape, or the
        names missing at the end (the engine's own load_weights raises its own errors). After
        an error the engine refuses to generate until a complete push.
        """
        if version < self.engine.version:
            raise VersionMismatchError(f"load_weights(version={version}) but {type(self.engine).__name__} holds "
                                       f"version {self.engine.version}: refusing to go back to older weights")
        if self.asleep:
            self.wake_up()
        self.ready = False
        if self.stream:
            self._stream(named_tensors, version)
            self.engine.version = version
        else:
            self.engine.load_weights(named_tensors, version)     # it sets its version
        self.ready = True


# %% [markdown]
# The inner engine's version and dtype, passed through, and the engine's own tensors by the
# trainer's names: the streamed load copies each pushed tensor into them as it arrives, and
# `named_weights` is the copy the stale-parameter check compares.

# %%
# | export minirl/rollout/colocated.py
@add_to_class(ColocatedEngine)
@property
def version(self) -> int:
    return self.engine.version


@add_to_class(ColocatedEngine)
@property
def dtype(self):
    return self.engine.dtype


@add_to_class(ColocatedEngine)
def _tensors(self) -> dict[str, Tensor]:
    state = self.engine.model.state_dict(keep_vars=True)
    return {n: state[n].data for n in self.names}


@add_to_class(ColocatedEngine)
def _stream(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
    """Copy each (name, tensor) into place as it arrives (cast to the engine's dtype)."""
    copy_pushed(self._tensors(), named_tensors, version, fp8=self.engine.dtype == "float8_e4m3fn")


@add_to_class(ColocatedEngine)
def named_weights(self):
    """The engine's copy of the weights by the trainer's names (what the stale-parameter check compares)."""
    return self.engine.named_weights()


# %% [markdown]
# Colocation itself: `sleep` resizes the storage of every tensor a push refills to zero
# bytes, keeping the shapes, and `wake_up` allocates it again just before the next push fills
# it.

# %%
# | export minirl/rollout/colocated.py
@add_to_class(ColocatedEngine)
def sleep(self) -> None:
    """Release the storage of every tensor a push refills (shared storages once); keep their shapes."""
    if self.asleep:
        return
    with self.record("sleep"):
        start = time.perf_counter()
        released = release_storage(self._tensors().values())
        self.asleep = True
        self.stats.update(sleep_seconds=time.perf_counter() - start, released_bytes=released)


@add_to_class(ColocatedEngine)
def wake_up(self) -> None:
    """Allocate the storage again (its contents undefined until the push that follows fills it)."""
    if not self.asleep:
        return
    with self.record("wake_up"):
        start = time.perf_counter()
        restore_storage(self._tensors().values())
        self.asleep, self.ready = False, False              # awake, but stale until the push completes
        self.stats["wake_seconds"] = time.perf_counter() - start


# %% [markdown]
# And the seed per prompt that makes a batch's samples independent of how it is split over
# the ranks (`--seed-per-prompt`, section 7's one-rank-or-two check):

# %%
# | export minirl/rollout/colocated.py
def prompt_seed(seed: int, prompt: str) -> int:
    """A sampling seed that depends only on a batch's seed and the prompt (not on its place in the batch)."""
    digest = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**62


class SeedPerPrompt:
    """An engine whose samples for a prompt depend only on one seed drawn for the batch and on the prompt.

    generate() draws a seed s from the generator, then samples each prompt alone from
    `prompt_seed(s, prompt)`: a batch split over any number of ranks (each drawing s from the
    same shared generator) gets the same completions. One generate call per prompt (slower).
    Everything else is the wrapped engine's.
    """

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):                          # model, dtype, tokenizer, named_weights, ...
        return getattr(self.engine, name)

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def load_weights(self, named_tensors, version: int) -> None:
        self.engine.load_weights(named_tensors, version)

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        seed = draw_seed(generator) or 0
        parts = [self.engine.generate([prompt], sampling, expected_version,
                                      torch.Generator().manual_seed(prompt_seed(seed, prompt))) for prompt in prompts]
        return Batch.concat(parts)

# %% [markdown]
# Now the three modes end to end, in this one-process group: an FSDP2-wrapped actor, its
# engine, a push in each mode, one all-gather per tensor and packed, each checked against
# the trainer by the stale-parameter check (`verify=True`). The bytes are what travels; the
# seconds are this machine's. In a group of one nothing really travels (the "shard" is the
# whole tensor), so the collectives' cost, the gathered peak and the share of a step are
# measured in the torchrun jobs of section 7.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.memory.measure import storage_bytes  # noqa: E402
from minirl.parallel.roles import DistributedActor  # noqa: E402
from minirl.rollout.colocated import ColocatedEngine  # noqa: E402
from minirl.rollout.shared_prefix import SharedPrefixEngine  # noqa: E402
from minirl.sync.sharded import ShardedSync  # noqa: E402

config = RLConfig.from_flat(num_generations=4)
rows = []
for mode in ("full", "merged", "adapter"):
    policy = copy.deepcopy(model)
    if mode == "adapter":                          # the engine holds base + adapter: build it from the peft model
        policy = apply_lora(policy, 8)
        engine = ColocatedEngine(SharedPrefixEngine(policy, tokenizer), adapter_only=True)
    else:                                          # the engine holds the plain policy
        engine = ColocatedEngine(SharedPrefixEngine(policy, tokenizer))
        policy = apply_lora(policy, 8) if mode == "merged" else policy
    actor = DistributedActor(wrap_model(policy, 3, "cpu"), config.algorithm, config.optimizer, config.sampling, group)
    for packed in (False, True):
        sync = ShardedSync(mode, lora_scaling=None if mode == "full" else 2.0, verify=True, packed=packed,
                           bucket_bytes=256 * MiB)
        reports = [sync.push(actor.named_weights(), engine, engine.version + 1) for _ in range(5)]
        seconds = sorted(r.seconds for r in reports)[2]
        rows.append((mode, "packed" if packed else "per tensor", reports[-1].tensors,
                     f"{reports[-1].bytes / MiB:.3f}", f"{1000 * seconds:.1f}"))
show(rows, ("mode", "transfer", "tensors", "MiB pushed", "ms per push (median of 5, verified)"))
layer_bytes = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".layers.0." in n)
whole_bytes = storage_bytes(model.state_dict().values())
full_bytes, adapter_bytes = float(rows[0][3]), float(rows[4][3])
print(f"adapter only ships {adapter_bytes / full_bytes:.1%} of the bytes of a full sync; every push above was "
      "verified tensor by tensor, packed or not")

# %% [markdown]
# And colocation, measured with notebook 03's byte counting (`storage_bytes`): the engine's
# weights before and after `sleep()`, and what sleeping and waking cost. Waking only
# allocates; the push that follows refills, and that is the sync's own time (above).

# %%
from minirl.sync.base import InProcessSync  # noqa: E402

engine = ColocatedEngine(SharedPrefixEngine(copy.deepcopy(model), tokenizer))
sampling = config.sampling
awake = storage_bytes(t for _, t in engine.named_weights())
sleeps, wakes = [], []
for i in range(20 if not SMOKE else 5):
    engine.generate(["12+34="], sampling, generator=torch.Generator().manual_seed(i))      # then it sleeps
    asleep = storage_bytes(t for _, t in engine.named_weights())
    sleeps.append(engine.stats["sleep_seconds"])
    InProcessSync().push(model.state_dict().items(), engine, engine.version + 1)          # wakes, refills
    wakes.append(engine.stats["wake_seconds"])
median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
show([("engine weights", f"{awake / MiB:.3f}", f"{asleep / MiB:.3f}", f"{(awake - asleep) / MiB:.3f}",
       f"{1e3 * median(sleeps):.3f}", f"{1e3 * median(wakes):.3f}")],
     ("", "awake MiB", "asleep MiB", "freed MiB", "sleep ms", "wake ms"))
assert asleep == 0 and awake > 0

# %% [markdown]
# ## 5. The vLLM engine, behind the same protocol
#
# On GPUs the rollout engine is vLLM: PagedAttention, continuous batching and prefix caching
# (notebook 05 builds each of them small). `VLLMEngine` puts it behind the same
# `RolloutEngine` protocol, using only vLLM's documented offline API the way TRL's colocate
# mode does:
#
# - `LLM(model=path, enable_prefix_caching=True, enable_sleep_mode=True,
#   logprobs_mode="processed_logprobs", distributed_executor_backend="external_launcher")`:
#   one engine per rank inside the training process (external launcher: torchrun started the
#   processes), prefix caching on (the G samples of a prompt share its prefill), and
#   log-probs taken **after** the temperature is applied. vLLM's default returns the raw
#   model's log-probs, which at temperature ≠ 1 are not the distribution the tokens were
#   drawn from: the importance ratio of notebook 02 would be biased.
# - `SamplingParams(n=G, temperature=T, max_tokens=C, logprobs=0, seed=s)`: G samples per
#   prompt, and the sampled token's own log-prob (0 extra candidates), one seed per prompt.
# - After an update: `wake_up(tags=["weights"])`, then the tensors streamed one at a time
#   into the worker's model through vLLM's public `collective_rpc("reload_weights",
#   kwargs={"weights_iterator": ...})` (vLLM maps Hugging Face names onto its fused layouts
#   itself); where a vLLM lacks it, TRL's path: `load_weights` on
#   `llm_engine.model_executor.driver_worker.model_runner.model`, an internal chain. Then
#   `reset_prefix_cache()`, because cached prefixes were computed with the old weights.
# - Colocation: `sleep(level=2)` after generating (weights and KV cache discarded; the next
#   push refills the weights), `wake_up(tags=["kv_cache"])` before the next generation.
# - Sizing beside a trainer: `gpu_memory_utilization` (the stage-4 flag
#   `--vllm-gpu-memory-utilization`), `max_model_len` from the task (its longest prompt plus
#   `max_completion_length`, not the model's whole context) and `max_num_batched_tokens`.
#   vLLM allocates outside PyTorch's allocator, so the engine's memory is read from the
#   device's free memory (`torch.cuda.mem_get_info`) around building, sleeping and waking.
#
# vLLM is not installed on the machines that run CI and it needs a CUDA GPU, so this engine
# is exercised only by the tests marked `vllm` (skipped cleanly elsewhere) and by
# `--rollout-engine vllm` on a GPU machine. It joins notebook 01's engine registry under the
# name "vllm" (end of this section), so every stage's `--rollout-engine` takes it, and asking
# for it where it cannot run is refused in one line before anything is loaded.

# %%
# | export minirl/rollout/vllm.py
"""The vLLM engine behind the rollout protocol: paged KV cache, prefix caching, sleep mode, in-place weight loads.

Written against vLLM's offline API as TRL's colocate mode uses it: one `vllm.LLM` per
training process (`distributed_executor_backend="external_launcher"` under torchrun, so the
engine and its worker run inside this process), prefix caching on, log-probs after the
temperature (`logprobs_mode="processed_logprobs"`), `SamplingParams(n=G, logprobs=0,
seed=...)` per prompt, `sleep(level=2)` after generating and `wake_up(tags=...)` before
loading weights and before generating, and `reset_prefix_cache()` after every push.

Sizing (what a user sets on a shared GPU): `gpu_memory_utilization` (the share of the GPU
vLLM may take for weights, activations and KV cache; the trainer needs the rest),
`max_model_len` (the longest prompt plus completion the task needs, `task_model_len`;
without it vLLM reserves room for the model's whole context, e.g. 32k tokens, which may not
fit beside a trainer) and `max_num_batched_tokens` (the tokens of one scheduler step; 4096
as TRL, whose comment says vLLM's memory profiler is misled by its larger default).

Weights, in two ways, the first that this vLLM offers:
1. vLLM's public API: `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`,
   the worker's in-place reload that vLLM's sleep-mode documentation uses after a level-2
   sleep, given the trainer's tensors instead of the checkpoint's (it maps Hugging Face names
   onto vLLM's fused layers and runs `process_weights_after_loading`). The tensors are passed
   as an iterator, one at a time: the external launcher runs the worker in this process, so
   nothing is serialized or copied. vLLM's weight-transfer engines (`LLM.update_weights` with
   the "nccl" or "ipc" backend) move weights between processes: a trainer on other GPUs
   (NCCL needs two ranks) or in another process (CUDA IPC cannot reopen a handle in the
   process that exported it), so they do not fit an engine inside the trainer's process.
2. Fallback, when `collective_rpc` is missing or refuses before it took a tensor: vLLM's
   internal chain `llm.llm_engine.model_executor.driver_worker.model_runner.model` and the
   model's `load_weights`, what TRL's colocate mode uses. It is internal and moves between
   vLLM versions. `weight_api` says which path the engine uses.

Memory: vLLM allocates outside PyTorch's caching allocator, so the engine's device bytes are
read from `torch.cuda.mem_get_info` (free memory before and after the engine is built, and
around each sleep and wake): `memory_bytes()`. Simplified: anything else that allocates in
those windows is counted too. The model is written to a temporary directory for vLLM to
read and removed as soon as the engine is built (also when building fails).

Needs vLLM and a CUDA GPU (`pip install -r requirements-gpu.txt`); CI has neither: the tests
marked `vllm` run it on a GPU machine, and CPU tests run this code against a stand-in for
vLLM (tests/test_vllm.py). Simplified vs TRL: tensor parallel size 1, no server mode, no
LoRA adapters inside vLLM (push merged weights).
"""

# %% [markdown]
# The module's imports and constants: vLLM's compute dtypes, and the two ways into vLLM's
# model that `load_weights` knows (the public reload, and the internal chain it falls back
# to). Then three helpers: a free port, importing vLLM with a message that says how to get
# it, and the model length a task needs.

# %%
# | export minirl/rollout/vllm.py
import os
import shutil
import socket
import tempfile
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig, auto_dtype
from minirl.data import Rollout
from minirl.rollout.base import VersionMismatchError, check_request, check_tokenizer, draw_seed, make_rollout
from minirl.rollout.colocated import prompt_seed
from minirl.rollout.registry import VLLM_DTYPES, VLLM_INSTALL
from minirl.runtime.validate import ConfigError, check_float, check_int

PUBLIC_API = "collective_rpc('reload_weights')"
INTERNAL_API = "llm_engine.model_executor.driver_worker.model_runner.model.load_weights"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_vllm():
    """The vllm module, or ConfigError saying how to get it (and that it needs a CUDA GPU)."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError("rollout_engine", "vllm", f"vLLM is not installed ({err}); {VLLM_INSTALL}") from None
    if not torch.cuda.is_available():
        raise ConfigError("rollout_engine", "vllm", "vLLM's engine needs a CUDA GPU and this machine has none; use "
                                                    "--rollout-engine shared_prefix")
    return vllm


def task_model_len(tokenizer, prompts: list[str], max_completion_length: int, context: int | None = None) -> int:
    """vLLM's max_model_len for a task: its longest prompt (tokens) plus `max_completion_length`.

    Rounded up to a multiple of 64 (room for held-out prompts a little longer than the
    training ones); at most `context`, the model's positions. ConfigError when the longest
    prompt and its completion do not fit the context at all.
    """
    longest = max((len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]), default=0)
    need = longest + max_completion_length
    if context is not None and need > context:
        raise ConfigError("max_completion_length", max_completion_length,
                          f"the longest prompt has {longest} tokens, and with {max_completion_length} new ones they "
                          f"exceed the model's {context} positions; shorten the prompts or the completions")
    rounded = -(-need // 64) * 64
    return rounded if context is None else min(rounded, context)

# %% [markdown]
# The engine's settings, checked before vLLM is imported, and the `LLM` built from the policy
# (written to a temporary directory that vLLM reads, removed as soon as it has):

# %%
# | export minirl/rollout/vllm.py
def vllm_settings(model, dtype: str, gpu_memory_utilization: float, max_model_len: int | None,
                  max_num_batched_tokens: int) -> tuple[str, int | None]:
    """(vLLM's compute dtype, max_model_len: the given one or the model's context), or ConfigError naming the
    setting."""
    dtype = auto_dtype(dtype, "cuda")
    if dtype not in VLLM_DTYPES:
        raise ConfigError("rollout_dtype", dtype, f"vLLM computes in {', '.join(VLLM_DTYPES)} (its FP8 is a "
                                                  "quantization mode); pick one of those")
    check_float("vllm_gpu_memory_utilization", gpu_memory_utilization, low=0.0, high=1.0, low_open=True)
    check_int("vllm_max_num_batched_tokens", max_num_batched_tokens, low=1)
    context = getattr(model.config, "max_position_embeddings", None)
    max_model_len = max_model_len or context
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, low=1, high=context, why="the model's positions")
    return dtype, max_model_len


def start_llm(vllm, model, tokenizer, **options):
    """`vllm.LLM` on a temporary copy of the policy (removed once read, also when building fails), with the
    options every minirl engine uses (prefix caching, processed log-probs, the external launcher) and `options`."""
    path = tempfile.mkdtemp(prefix="minirl-vllm-")
    try:                                                 # the copy lives only while vLLM reads it
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return vllm.LLM(model=path, tokenizer=path, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                        distributed_executor_backend="external_launcher", **options)
    finally:
        shutil.rmtree(path, ignore_errors=True)

# %% [markdown]
# Two pieces the engine uses: the tensors of a push, checked by name as vLLM takes them, and
# the rows vLLM returns, padded into notebook 01's `Rollout`:

# %%
# | export minirl/rollout/vllm.py
class _Stream:
    """The tensors of a push, checked by name as vLLM takes them; counts what it took."""

    def __init__(self, named: Iterable[tuple[str, Tensor]], known: set[str], version: int):
        self.named, self.known, self.version = iter(named), known, version
        self.seen: set[str] = set()
        self.taken = 0

    def __iter__(self):
        for name, tensor in self.named:
            if name not in self.known:
                raise ValueError(f"VLLMEngine.load_weights(version={self.version}): unexpected tensor {name!r}; "
                                 "push the policy's tensors under their Hugging Face names")
            self.taken += 1
            self.seen.add(name)
            yield name, tensor


def padded_rollout(tokenizer, prompts: list[str], G: int, rows: list[tuple], version: int) -> Rollout:
    """The rollout of vLLM's (prompt ids, completion ids, log-probs) rows: prompts left-padded, completions
    right-padded (log-probs with 0.0), rows i*G .. i*G+G-1 continuing prompts[i]."""
    P, width = max(len(p) for p, _, _ in rows), max(1, max(len(t) for _, t, _ in rows))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p, _, _ in rows])               # [N, P]
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _, _ in rows])
    completion_ids = torch.tensor([list(t) + [pad] * (width - len(t)) for _, t, _ in rows])       # [N, C]
    logprobs = torch.tensor([list(lp) + [0.0] * (width - len(lp)) for _, _, lp in rows])
    return make_rollout(tokenizer, prompts, G, prompt_ids, prompt_mask, completion_ids, logprobs, version)

# %% [markdown]
# vLLM's sleep mode, as the engine uses it: device memory read from the free memory around
# each transition (vLLM allocates outside PyTorch), level 2 after generating (weights and
# KV cache discarded), and a wake-up by tags (the weights before a push, the KV cache before
# generating):

# %%
# | export minirl/rollout/vllm.py
class VLLMSleepMode:
    """The sleep and memory side of `VLLMEngine` (a mixin: it uses the engine's llm, device, held, sleeping
    and ready)."""

    def _free_bytes(self) -> int:
        """Free device memory now: vLLM's own allocator is invisible to torch.cuda.memory_allocated."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()                             # torch's cached blocks are not vLLM's
        return torch.cuda.mem_get_info(self.device)[0]

    def memory_bytes(self) -> int:
        """Device bytes the engine holds now (weights, KV cache, ...), from mem_get_info around its transitions."""
        return self.held

    def _wake(self, tags: tuple[str, ...]) -> None:
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            free = self._free_bytes()
            self.llm.wake_up(tags=tags)
            self.sleeping -= set(tags)
            self.held += max(0, free - self._free_bytes())

    def sleep(self) -> None:
        """Discard weights and KV cache (vLLM sleep level 2); the next push refills the weights."""
        if not self.sleeping:
            free = self._free_bytes()
            self.llm.sleep(level=2)
            self.sleeping = {"weights", "kv_cache"}
            self.ready = False                                # level 2 discarded the weights
            self.held = max(0, self.held - max(0, self._free_bytes() - free))

    def wake_up(self) -> None:
        self._wake(("weights", "kv_cache"))

# %% [markdown]
# And the engine: its settings checked and its `LLM` started when it is built, G samples
# per prompt with their log-probs, and pushes taken in place:

# %%
# | export minirl/rollout/vllm.py
class VLLMEngine(VLLMSleepMode):
    """A vLLM `LLM` in this process, holding version `version` of the policy.

    model, tokenizer: the policy to start from (written to a temporary directory that vLLM
    loads, then removed); dtype: vLLM's compute dtype ("auto": bfloat16); colocate: sleep
    after generating, wake before loading weights and before generating;
    gpu_memory_utilization: the share of the GPU vLLM may take; max_model_len: the longest
    prompt plus completion (None: the model's context; see `task_model_len`);
    max_num_batched_tokens: tokens per scheduler step (at least max_model_len).
    """

    def __init__(self, model, tokenizer, dtype: str = "auto", device=None, *, colocate: bool = True,
                 gpu_memory_utilization: float = 0.3, seed: int = 0, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 4096):
        dtype, max_model_len = vllm_settings(model, dtype, gpu_memory_utilization, max_model_len,
                                             max_num_batched_tokens)
        vllm = import_vllm()
        check_tokenizer(tokenizer)
        self.tokenizer, self.dtype, self.colocate, self.max_model_len = tokenizer, dtype, colocate, max_model_len
        self.device = torch.device(device if device is not None else "cuda")
        self.names = list(model.state_dict())
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)                # external_launcher reads torchrun's variables
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        free_before = self._free_bytes()
        self.llm = start_llm(vllm, model, tokenizer, dtype=dtype, seed=seed, enable_sleep_mode=colocate,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             max_num_batched_tokens=max(max_num_batched_tokens, max_model_len or 0))
        self.held = max(0, free_before - self._free_bytes())   # weights, KV cache, CUDA graphs: vLLM's
        self.SamplingParams = vllm.SamplingParams
        self.weight_api = PUBLIC_API if callable(getattr(self.llm, "collective_rpc", None)) else INTERNAL_API
        self.version, self.ready, self.sleeping = 0, True, set()   # sleeping: the tags vLLM has released

# %% [markdown]
# Generating: G samples per prompt, each with the log-prob of every sampled token, the engine
# woken first and put back to sleep after, when it shares the GPU with the trainer.

# %%
# | export minirl/rollout/vllm.py
@add_to_class(VLLMEngine)
def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
             generator: torch.Generator | None = None) -> Rollout:
    """G samples per prompt with the sampled tokens' log-probs (after temperature); rows i*G .. i*G+G-1
    continue prompts[i]. With a generator, each prompt samples from `prompt_seed(s, prompt)`, s drawn
    from it, so a batch's samples do not depend on how it is split over ranks."""
    check_request(self, prompts, sampling, expected_version)
    if not self.ready:
        raise RuntimeError("VLLMEngine: no complete weights (asleep, or the last load_weights did not "
                           "complete); push the trainer's weights before generating")
    G, C, tok = sampling.num_generations, sampling.max_completion_length, self.tokenizer
    ids = self._prompt_ids(prompts, C)
    self._wake(("weights", "kv_cache"))
    seed = draw_seed(generator)
    params = [self.SamplingParams(n=G, temperature=sampling.temperature, max_tokens=C, logprobs=0,
                                  seed=None if seed is None else prompt_seed(seed, p)) for p in prompts]
    outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    rows = [(p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
            for p, out in zip(ids, outputs, strict=True) for c in out.outputs]                   # N = B * G rows
    if self.colocate:
        self.sleep()
    return padded_rollout(tok, prompts, G, rows, self.version)

@add_to_class(VLLMEngine)
def _prompt_ids(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of `prompts`; ValueError when one and its completion would not fit max_model_len."""
    ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
    longest = max(len(p) for p in ids)
    if self.max_model_len is not None and longest + max_tokens > self.max_model_len:
        raise ValueError(f"VLLMEngine: a prompt of {longest} tokens and {max_tokens} new ones exceed "
                         f"max_model_len={self.max_model_len}; build the engine with a larger max_model_len "
                         "(task_model_len over every prompt it will see)")
    return ids

# %% [markdown]
# Pushes taken in place: every tensor streamed into vLLM's model, a refusal of older weights
# or of a push that leaves names out, and the prefix cache emptied after.

# %%
# | export minirl/rollout/vllm.py
@add_to_class(VLLMEngine)
def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
    """Stream the trainer's tensors (Hugging Face names) into vLLM's model in place; then reset the prefix cache.

    Raises VersionMismatchError for an older version, ValueError for an unknown name or
    names missing at the end (after which the engine refuses to generate until a full push).
    """
    if version < self.version:
        raise VersionMismatchError(f"load_weights(version={version}) but the vLLM engine holds version "
                                   f"{self.version}: refusing to go back to older weights")
    self._wake(("weights",))                              # the KV cache stays released until generate
    self.ready = False
    stream = _Stream(named_tensors, set(self.names), version)
    self._push(stream)
    missing = [n for n in self.names if n not in stream.seen]
    if missing:
        raise ValueError(f"VLLMEngine.load_weights(version={version}): {len(missing)} tensors never pushed "
                         f"(first: {missing[0]}); push all of them")
    self.llm.reset_prefix_cache()                         # cached prefixes belong to the old weights
    self.version, self.ready = version, True

@add_to_class(VLLMEngine)
def named_weights(self):
    raise NotImplementedError("vLLM keeps its weights fused inside its worker (qkv_proj, gate_up_proj); compare "
                              "log-probs instead (notebook 02) to check a vLLM sync")


# %% [markdown]
# How a push reaches vLLM's model inside its worker (the public reload, else the internal
# chain), and the greedy completions behind held-out accuracy.

# %%
# | export minirl/rollout/vllm.py
@add_to_class(VLLMEngine)
def _push(self, stream: _Stream) -> None:
    """Into vLLM's worker: the public reload, or (refused before it took a tensor) the internal chain."""
    if self.weight_api == PUBLIC_API:
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stream)})
            return
        except (AttributeError, NotImplementedError, TypeError) as err:
            if stream.taken:
                raise
            self.weight_api = f"{INTERNAL_API} ({PUBLIC_API} refused: {type(err).__name__}: {err})"
    model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, tensor in stream:
        model.load_weights([(name, tensor)])


@add_to_class(VLLMEngine)
def greedy_completions(self, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions as text (for held-out accuracy), from the weights the engine holds."""
    if not self.ready:
        raise RuntimeError("VLLMEngine: no complete weights (asleep or half-loaded); push the weights first")
    ids = self._prompt_ids(prompts, max_new_tokens)
    self._wake(("kv_cache",))
    params = self.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return [self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]

# %% [markdown]
# The engine joins notebook 01's registry under the name "vllm": a factory that imports
# `minirl.rollout.vllm` (and vLLM) only when it builds one, and a check that needs neither, so
# that `--rollout-engine vllm` on a machine without vLLM or CUDA is refused with the flags,
# before torch or a model loads. A stage passes what it knows about sizing (stage 4: the
# task's prompts, its `--vllm-*` flags, colocation); other stages get vLLM's defaults.

# %%
from minirl.rollout.registry import ENGINES, register_engine  # noqa: E402  (notebook 01's registry)

print("engines before this one:", ", ".join(ENGINES))

# %%
# | export minirl/rollout/registry.py
import importlib.util

VLLM_DTYPES = ("bfloat16", "float16", "float32")   # vLLM's compute dtypes (its FP8 is a quantization mode)
VLLM_INSTALL = "on a CUDA machine run pip install -r requirements-gpu.txt, or use --rollout-engine shared_prefix"


def vllm_problem(config: RLConfig) -> str | None:
    """Why this run cannot roll out with vLLM (not installed, not on CUDA, an FP8 copy), or None; no heavy import."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {VLLM_INSTALL}"
    if not config.run.device.startswith("cuda"):
        return (f"vLLM's engine runs on CUDA GPUs and this run's --device is {config.run.device}; pass --device cuda "
                "on a GPU machine, or use --rollout-engine shared_prefix")
    if config.engine_dtype not in VLLM_DTYPES:
        return (f"vLLM computes in {', '.join(VLLM_DTYPES)} (its FP8 is a quantization mode) and --rollout-dtype is "
                f"{config.rollout.rollout_dtype}; pick one of those")
    return None


@register_engine("vllm", problem=vllm_problem)
def build_vllm(config: RLConfig, model, tokenizer, device, *, colocate: bool = False, prompts=(), **settings):
    """vLLM in this process (notebook 04). colocate: sleep after generating; prompts: the task's, which size
    max_model_len (the model's whole context without them); settings: VLLMEngine's gpu_memory_utilization and
    max_num_batched_tokens (its defaults without them)."""
    from minirl.rollout.vllm import VLLMEngine, task_model_len  # noqa: PLC0415 (vLLM loads when built)

    context = getattr(model.config, "max_position_embeddings", None)
    length = task_model_len(tokenizer, prompts, config.sampling.max_completion_length, context) if prompts else None
    return VLLMEngine(model, tokenizer, dtype=config.engine_dtype, device=device, colocate=colocate,
                      seed=config.run.seed, max_model_len=length, **settings)


# %%
from minirl.rollout.registry import check_engine  # noqa: E402

print("engines:", ", ".join(ENGINES))
try:
    check_engine(RLConfig.from_flat(rollout_engine="vllm", device="cuda" if torch.cuda.is_available() else "cpu"))
    print("--rollout-engine vllm can run here")
except ValueError as err:
    print(f"{err} (this notebook uses the in-process engines)")

# %% [markdown]
# ## 6. The stage-4 run: `rl_step` on every rank
#
# Everything above comes together in `setup_spmd` and `spmd_step`. Setup, on every rank:
# move the policy to the rank's device; copy the frozen reference if β > 0; build the
# rank's engine (from the base model, or from the peft model when only adapters travel);
# add LoRA; wrap for the ZeRO level; build the `DistributedActor` and the `ShardedSync`; and
# push version 0 through the sync, so that an engine that cannot take the trainer's tensors
# (a misnamed or missing tensor, a wrong shape) fails now, on every rank, before step 1. The
# step, on every rank: draw the global batch from the shared generator, keep this rank's
# share, and call notebook 01's `rl_step` with the process group. The record it returns is
# already global; the step adds the sync's peak, the engine's sleep and wake times, and
# each rank's stage times (the slowest rank sets the pace of a synchronous job).
#
# One choice is about randomness. Each rank samples its completions with a generator of its
# own (seeded from the run's seed and the rank), so two ranks never draw the same random
# numbers; the completions a run sees then depend on the world size. `seed_per_prompt=True`
# instead samples each prompt from a seed of its own (`SeedPerPrompt`, defined with the
# colocated engine: a seed drawn from the shared generator, hashed with the prompt), so the
# batch is the same for any number of ranks: that is how the tests check that two ranks
# compute what one process computes. It costs a `generate` call per prompt with the HF
# engines; vLLM takes a seed per request anyway, so `VLLMEngine` always seeds this way.

# %%
# | export minirl/parallel/spmd.py
"""The stage-4 run: every rank runs notebook 01's `rl_step` on its share of the batch (SPMD).

`setup_spmd` builds, on every rank, the reference copy (beta > 0), the rank's engine (a full
copy of the policy beside its trainer shard: colocated), the LoRA adapters, the wrapped
trainer (`DistributedActor`) and the `ShardedSync`, and pushes version 0 so that a bad
engine fails before any step. `spmd_step` draws the global batch from the generator every
rank shares, keeps this rank's share and calls `rl_step` with the process group; with
`sync_every` K > 1 only every K-th step pushes its update (`sync_due`; the other steps hand
`rl_step` a `KeepWeights`, and the engine generates with weights up to K-1 updates old,
recorded per step as `staleness`). `run` and the callbacks of notebook 01 drive it
unchanged. `evaluate_engine` scores a task's held-out rows on the engine's copy (the
trainer's latest weights, whole), and `export_policy` gathers the (LoRA-merged) policy
into a Hugging Face directory.

Simplified vs NeMo-Aligner / veRL: every rank holds a whole engine copy (no tensor-parallel
rollout), GRPO only, one model family's decoder layers per FSDP unit.
"""

import errno
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

from minirl.config import RLConfig
from minirl.memory.wrap import apply_lora, set_checkpointing, wrap_model
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import DistContext, ProcessGroup, agree, rank_slice
from minirl.parallel.roles import DistributedActor
from minirl.parallel.stops import deferred_signals
from minirl.roles.reference import Reference
from minirl.rollout.base import Colocated
from minirl.rollout.colocated import ColocatedEngine, SeedPerPrompt
from minirl.rollout.registry import build_engine
from minirl.sync.base import SyncReport
from minirl.sync.sharded import ShardedSync, SinkEngine, engine_tensors, gather_buckets
from minirl.tasks.task import Task
from minirl.train.run import RunState
from minirl.train.step import Roles, rl_step, sample_prompts


@dataclass
class SPMDState(RunState):
    """A RunState with what a rank of a data-parallel run also needs."""

    pconfig: ParallelConfig | None = None
    ctx: DistContext | None = None
    group: ProcessGroup | None = None
    sampling_generator: torch.Generator | None = None   # this rank's own sampling seeds
    lag: int = 0                                        # updates the engine's weights are behind the trainer's


# %% [markdown]
# Setting up a rank: its engine (vLLM on a GPU, or the in-process engine, colocated or not),
# then everything `setup_spmd` builds before the first step, with version 0 pushed so that a
# bad engine fails before any training.

# %%
# | export minirl/parallel/spmd.py
def build_rank_engine(config: RLConfig, pconfig: ParallelConfig, model, tokenizer, device, prompts=()):
    """This rank's engine holding a copy of `model` (version 0), built by the engine registry, colocated.

    An engine that colocates itself (vLLM's sleep mode: the `Colocated` protocol) is used as
    built; an in-process one is wrapped in `ColocatedEngine` (and `SeedPerPrompt`).
    prompts: the task's, which size vLLM's max_model_len (the model's context without them)."""
    engine = build_engine(config, model, tokenizer, device, colocate=pconfig.colocate, prompts=tuple(prompts),
                          gpu_memory_utilization=pconfig.vllm_gpu_memory_utilization,
                          max_num_batched_tokens=pconfig.vllm_max_num_batched_tokens)
    if isinstance(engine, Colocated):
        return engine
    if pconfig.seed_per_prompt:
        engine = SeedPerPrompt(engine)
    return ColocatedEngine(engine, colocate=pconfig.colocate, adapter_only=pconfig.resolved_sync_mode == "adapter")


def setup_spmd(config: RLConfig, pconfig: ParallelConfig, model, tokenizer, rows: list[dict], reward_funcs: list,
               ctx: DistContext, reward_weights: list[float] | None = None) -> SPMDState:
    """Every rank: reference, engine, LoRA, wrapped actor, sync; version 0 pushed (bad engines fail here).

    rows: the task's training rows; reward_funcs, reward_weights: its rewards (TRL's signature and
    weights; None: 1 each)."""
    model.to(ctx.device).eval()
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    mode = pconfig.resolved_sync_mode
    engine = None if mode == "adapter" else build_rank_engine(config, pconfig, model, tokenizer, ctx.device,
                                                              [r["prompt"] for r in rows])
    if pconfig.lora_rank:
        model = apply_lora(model, pconfig.lora_rank, pconfig.alpha, pconfig.targets)
    if engine is None:                                    # adapter-only: the engine holds base + adapter
        engine = build_rank_engine(config, pconfig, model, tokenizer, ctx.device)
    if pconfig.gradient_checkpointing:
        set_checkpointing(model, True)
    wrapped = wrap_model(model, pconfig.zero, ctx.device, pconfig.mixed_precision, pconfig.cpu_offload)
    group = ProcessGroup(ctx.device)
    actor = DistributedActor(wrapped, config.algorithm, config.optimizer, config.sampling, group,
                             checkpointing=pconfig.gradient_checkpointing)
    sync = ShardedSync(mode, pconfig.alpha / pconfig.lora_rank if pconfig.lora_rank else None, pconfig.verify_sync,
                       packed=pconfig.packed_sync, bucket_bytes=int(pconfig.sync_bucket_mb * 2**20))
    sync.push(actor.named_weights(), engine, 0)           # every name and shape checked before any step
    seed = config.run.seed
    return SPMDState(config, Roles(actor, reference), engine, sync, torch.Generator().manual_seed(seed), rows,
                     reward_funcs, reward_weights, pconfig=pconfig, ctx=ctx, group=group,
                     sampling_generator=torch.Generator().manual_seed(seed + 1_000_003 * (ctx.rank + 1)))


# %% [markdown]
# One step on a rank, and when it pushes: `KeepWeights` stands in for the sync on the steps
# that skip it, `spmd_step` is the step, `sync_table` times a push in every mode:

# %%
# | export minirl/parallel/spmd.py
class KeepWeights:
    """The sync of a step that does not synchronize: the engine keeps the weights (and version) it holds.

    push() moves nothing and reports the engine's own version, so `rl_step` keeps expecting
    the version the engine really holds: the next batch is generated, version-checked and
    logged (`generated_version`, the rollout's log-probs that an importance-sampling
    correction divides by) as the older policy it is. A version counts pushes, not updates.
    """

    def push(self, named_weights, engine, version: int) -> SyncReport:
        return SyncReport(engine.version, 0, 0, 0.0)


def sync_due(step: int, pconfig: ParallelConfig, config: RLConfig) -> bool:
    """Whether step `step` (1, 2, ...) pushes its update to the engine.

    Every `sync_every`-th step, and always the steps that evaluate, checkpoint or end the
    run: an evaluation measures the engine's copy (it must be the trainer's latest), and a
    resume refills the engine from the restored trainer (the engine must have held those
    weights when the checkpoint was taken, or the resumed run would differ). Between two
    pushes the engine generates with weights up to sync_every - 1 updates old.
    """
    run = config.run
    return (step % pconfig.sync_every == 0 or step == run.steps
            or bool(run.eval_every and step % run.eval_every == 0)
            or bool(run.checkpoint_every and step % run.checkpoint_every == 0))


def spmd_step(state: SPMDState) -> dict:
    """One step on this rank: the global batch's draw (the same on every rank), this rank's share, rl_step."""
    config, group = state.config, state.group
    rows = sample_prompts(state.rows, config.run.prompts_per_step, state.generator)
    mine = rank_slice(rows, group.rank, group.world_size)
    sampler = state.generator if state.pconfig.seed_per_prompt else state.sampling_generator
    staleness, due = state.lag, sync_due(state.step + 1, state.pconfig, config)
    sync = state.sync if due else KeepWeights()
    record = rl_step(state.roles, state.engine, sync, mine, state.reward_funcs, config, sampler, group=group,
                     reward_weights=state.reward_weights)
    state.lag = 0 if due else state.lag + 1
    report, stats = state.sync.last_report, getattr(state.engine, "stats", {})
    record |= {"sync/peak_bytes": report.peak_bytes if due else 0, "sync/tensors": report.tensors if due else 0,
               "sync/pushed": int(due), "staleness": staleness,
               "time/sleep": stats.get("sleep_seconds", 0.0), "time/wake": stats.get("wake_seconds", 0.0)}
    local = {k: v for k, v in record.items() if k.startswith(("time/", "rewards/")) or k == "reward_errors"}
    everyone = group.gather_objects(local)
    for key in local:
        if key.startswith("rewards/"):                    # equal shares: the mean of the ranks' means
            record[key] = sum(r[key] for r in everyone) / len(everyone)
    record["reward_errors"] = sum(r.get("reward_errors", 0) for r in everyone)
    record["time_by_rank"] = [{k: v for k, v in r.items() if k.startswith("time/")} for r in everyone]
    return record


# %% [markdown]
# The sync's cost, measured: every mode and transfer this run can ship is pushed into an
# engine that only receives, and timed; its share of the run's median step is the number the
# source's 5 % threshold applies to.

# %%
# | export minirl/parallel/spmd.py
def sync_table(state: SPMDState, metrics: list[dict], repeats: int = 5) -> list[dict]:
    """Seconds, bytes and share of the step of one sync in each mode and transfer this run can ship.

    Every rank calls it (the pushes are collectives). Each mode ("full"; with LoRA also
    "merged" and "adapter") is pushed into a `SinkEngine` three ways: one all-gather per
    tensor, one per layer (packed), and packed in buckets of the run's `sync_bucket_mb` (if > 0);
    once to allocate, then `repeats` times in turn (the machine's load hits every row alike),
    timed (median). "full" ships every tensor unmerged (for a LoRA run: the base weights, as
    full fine-tuning ships them). share = seconds / this run's median step (rank 0's clock).
    """
    steps = [m["time/step"] for m in metrics if "time/step" in m]
    step_time = statistics.median(steps) if steps else float("nan")
    scaling = state.sync.lora_scaling
    modes = ("full", "merged", "adapter") if scaling is not None else ("full",)
    bucket = state.sync.bucket_bytes
    transfers = {"per tensor": (False, 0), "per layer": (True, 0)}
    if bucket:
        transfers[f"{bucket / 2**20:g} MiB buckets"] = (True, bucket)
    named = list(state.roles.actor.named_weights())
    syncs = {(mode, name): (ShardedSync(mode, scaling, packed=packed, bucket_bytes=cap), SinkEngine())
             for mode in modes for name, (packed, cap) in transfers.items()}
    reports = {key: [] for key in syncs}
    for sync, sink in syncs.values():
        sync.push(named, sink, 0)
    for _ in range(repeats):
        for key, (sync, sink) in syncs.items():
            reports[key].append(sync.push(named, sink, 0))
    rows = []
    for (mode, transfer), got in reports.items():
        seconds = statistics.median(r.seconds for r in got)
        rows.append({"mode": mode, "transfer": transfer, "seconds": seconds, "bytes": got[-1].bytes,
                     "tensors": got[-1].tensors, "peak_bytes": got[-1].peak_bytes, "share": seconds / step_time})
    return rows


# %% [markdown]
# What rank 0 does at evaluations and at the end: score the engine's policy on held-out
# prompts and export the trained policy as a Hugging Face model:

# %%
# | export minirl/parallel/spmd.py
def innermost(engine):
    """The engine under any wrappers (SeedPerPrompt, ColocatedEngine)."""
    while hasattr(engine, "engine"):
        engine = engine.engine
    return engine


def evaluate_engine(engine, tokenizer, task: Task, max_new_tokens: int) -> float:
    """The task's evaluation of the policy the engine holds (the trainer's latest weights, whole): its held-out
    rows decoded greedily and scored by its rewards; the accuracy (0..1) when the task has a correctness
    reward, else the mean weighted reward (`Task.eval_fn`'s number)."""
    inner = innermost(engine)
    if not hasattr(inner, "greedy_completions"):          # minirl's engines hold a transformers model
        return task.eval_fn(tokenizer, max_new_tokens)(inner.model)
    completions = inner.greedy_completions([r["prompt"] for r in task.test], max_new_tokens)     # vLLM
    total, metrics = task.score(task.test, completions)
    return metrics[f"rewards/{task.accuracy_reward}"] if task.accuracy_reward else total.mean().item()


# %% [markdown]
# The trained policy leaves the job whole: gathered layer by layer, LoRA merged, and saved by
# rank 0 in Hugging Face format, a failed write raised on every rank.

# %%
# | export minirl/parallel/spmd.py
def _save_pretrained(model, tokenizer, path: Path) -> None:
    """save_pretrained, with safetensors' errors (which name no file) as the OSError they are, naming `path`."""
    try:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    except SafetensorError as err:
        code = re.search(r"(?:os error|code:) (\d+)", str(err))      # "No space left on device (os error 28)"
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number), str(path / "model.safetensors")) from err


def export_policy(actor: DistributedActor, lora_scaling: float | None, tokenizer, path,
                  ctx: DistContext) -> Path | None:
    """Gather the policy layer by layer (LoRA merged into the base) and save it on rank 0 in Hugging Face format.

    Every rank must call it (the gathers are collectives); rank 0 writes `path` atomically and
    returns it, the others return None; a failed write (a full disk) is raised on every rank.
    `AutoModelForCausalLM.from_pretrained(path)` loads it.
    """
    mode = "merged" if lora_scaling is not None else "full"
    state = {}
    for layer in gather_buckets(list(actor.named_weights())):       # one layer at a time
        for name, tensor in engine_tensors(layer, mode, lora_scaling):
            if ctx.is_main:
                state[name] = tensor.detach().to("cpu", copy=True)
    path = Path(path)

    def write() -> Path:                                   # rank 0: a temporary directory, renamed when whole
        base = actor.module.get_base_model() if hasattr(actor.module, "get_base_model") else actor.module
        model = AutoModelForCausalLM.from_config(base.config)
        model.load_state_dict(state, strict=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            _save_pretrained(model, tokenizer, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with deferred_signals():
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        return path

    return agree(f"writing {path}", write if ctx.is_main else lambda: None)

# %% [markdown]
# ### When a job stops early
#
# A job of N processes can stop in N + 1 ways: Ctrl-C (torchrun forwards it to every rank as
# SIGINT), or one rank dying (its own error, the kernel's OOM killer, a lost node), after which
# torchrun sends SIGTERM to the others. Either way, the ranks still alive meet a broken
# collective, and each one's traceback says little: gloo's "Connection reset by peer" names an
# address, not who died. What a user needs is one line: what stopped (which rank, on which
# host, which pid), the last intact checkpoint, and the command that continues the run. So each
# rank records every rank's host and pid at the start (`rank_processes`); a rank that stops
# looks which of them have ended (`dead_ranks`: a process of this host that is gone, or a
# zombie torchrun has not reaped yet) and which signals it received (`StopSignals`), and
# `why_stopped` turns that into the line and the exit status. Only one rank says it: rank 0
# for Ctrl-C, the job's errors and SIGTERM; the rank that died of its own error for that error;
# the lowest survivor for a rank killed outright (`first_to_report` keeps it to one). The
# chapter script sends the other ranks' standard error to /dev/null, so that a warning or a
# progress bar is printed once, not once per rank, and a rank's own death is still said.

# %%
# | export minirl/parallel/stops.py
"""Why a data-parallel job stopped, in one line from one rank: Ctrl-C, a dead rank, a full disk, an error.

`rank_processes` records every rank's host and pid at the start; after a failure,
`dead_ranks` finds the ones of this host that have ended. `StopSignals` turns the first
SIGINT and SIGTERM into exceptions and remembers what arrived; `deferred_signals` holds them
off while a checkpoint is promoted. `why_stopped` decides what this rank says (if anything)
and the exit status; `first_to_report` lets only one process say that a rank died;
`relaunch_command` is the torchrun command that continues the run.

Simplified vs torchelastic: no restarts and no health checks of other nodes (a rank on
another host is seen dying only as the broken connection, and reported as such).
"""

import contextlib
import os
import shlex
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch.distributed as dist

from minirl.parallel.launch import RankFailed, world_from_env
from minirl.rollout.base import VersionMismatchError
from minirl.runtime.rundir import RunDirError
from minirl.runtime.training_cli import write_failure
from minirl.runtime.validate import ConfigError

# %% [markdown]
# Who died: every rank learns every rank's host and process id at the start, so that a
# survivor can tell which process of its own host has ended.

# %%
# | export minirl/parallel/stops.py
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


# %% [markdown]
# Signals: the first Ctrl-C or SIGTERM interrupts a rank's work as an exception, later ones
# are only recorded, so a rank explaining why it stops is not interrupted again.

# %%
# | export minirl/parallel/stops.py
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


# %% [markdown]
# Then how a rank decides what happened: signals held back during a checkpoint, one rank
# chosen to report, the resume command, and `why_stopped`, which names the cause:

# %%
# | export minirl/parallel/stops.py
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


def first_to_report(key: str) -> bool:
    """True for the first process of this job (under torchrun, on this host) to ask with `key`; False after.

    A marker file in the temporary directory, created atomically: when a rank dies of its own
    error it says so, and the rank that then finds it dead stays quiet. Outside torchrun: True.
    """
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is None:
        return True
    marker = Path(tempfile.gettempdir()) / f"minirl-{job}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{key}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def relaunch_command(script, args: list[str]) -> str:
    """The torchrun command line that starts this job's script again with `args`, on as many ranks."""
    _, world, _ = world_from_env()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = f"--nnodes {world // local} " if world > local else ""
    return f"torchrun {nodes}--nproc_per_node {local} {shlex.join([str(script), *map(str, args)])}"


BAD_INPUT = (ConfigError, RunDirError, ValueError, VersionMismatchError)   # found alike on every rank: exit 2


# %% [markdown]
# What a stopping rank says, and which rank says it: `why_stopped` maps the exception that
# ended the run to one line, an exit status, and whether to print the resume command.

# %%
# | export minirl/parallel/stops.py
@dataclass
class Stop:
    """What a stopping rank says: `what` happened (None: this rank stays quiet), its exit status, and
    whether the line goes on with the last intact checkpoint and the resume command."""

    what: str | None
    code: int
    resumable: bool = True


def _names(ranks: list[int], processes: list[tuple[str, int]]) -> str:
    return ", ".join(f"rank {r} (pid {processes[r][1]} on {processes[r][0]})" for r in ranks)


def why_stopped(err: BaseException, signals: StopSignals, processes: list[tuple[str, int]], rank: int, out,
                wait: float = 1.0) -> Stop:
    """This rank's `Stop` for `err`, the exception that ended its run.

    In order: Ctrl-C (rank 0 says "interrupted", exit 130); an error every rank met (`agree`, or
    marked `agreed`): rank 0 says it, exit 1 for a file that could not be written (disk full,
    read-only), else 2 (bad input); a rank of this host that died (the lowest rank alive says
    so, unless the dead one already said why: exit 1); SIGTERM without a dead rank (rank 0,
    143); this rank's own error: it says so itself (1). A broken collective without a dead
    rank in sight waits up to `wait` seconds for the death or the signal that caused it. out:
    the run directory (a write failure outside it still names its file).
    """
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
        dead = dead_ranks(processes)
        if dead:
            return Stop(f"{_names(dead, processes)} died" if says() else None, 1)
        if signal.SIGINT in signals.received:
            return Stop("interrupted" if says() else None, 130)
        if signal.SIGTERM in signals.received or isinstance(err, Terminated):
            return Stop("stopped by SIGTERM" if rank == 0 else None, 143)
        if not isinstance(err, RuntimeError) or time.monotonic() > deadline:
            break
        time.sleep(0.05)                        # a broken collective: who broke it shows in a moment
    first = first_to_report("stop")
    if line is not None:
        return Stop(f"error on {_names([rank], processes)}: {line}" if first else None, 1)
    text = str(err).strip().splitlines()
    return Stop(f"{_names([rank], processes)} failed with {type(err).__name__}: {text[0] if text else ''}"
                if first else None, 1)


# %% [markdown]
# What each kind of stop prints, for a job of two ranks where "rank 1" is a process that has
# already ended (rank 0 reports; the same calls on rank 1 return no line):

# %%
import socket  # noqa: E402
import subprocess  # noqa: E402

from minirl.parallel.launch import RankFailed  # noqa: E402
from minirl.parallel.stops import StopSignals, why_stopped  # noqa: E402
from minirl.runtime.training_cli import stop_line  # noqa: E402

peer = subprocess.Popen([sys.executable, "-c", "pass"])
peer.wait()                                         # rank 1's process has ended
here = socket.gethostname()
stops = {"Ctrl-C": (KeyboardInterrupt(), [(here, os.getpid()), (here, peer.pid)]),
         "rank 1 killed": (RuntimeError("[gloo] Read error: Connection reset by peer"),
                           [(here, os.getpid()), (here, peer.pid)]),
         "a full disk on rank 1": (RankFailed("writing: rank 1 failed with OSError", 1,
                                              OSError(28, "No space left on device", "runs/04/checkpoints/"
                                                      ".tmp-step-000060/__1_0.distcp")),
                                   [(here, os.getpid()), (here, os.getpid())])}
again = "torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04 --resume"
for what, (err, processes) in stops.items():
    stop = why_stopped(err, StopSignals(), processes, 0, "runs/04")
    print(f"{what} (exit {stop.code}):\n    {stop_line(stop.what, 'runs/04/checkpoints/step-000050', again)}")

# %% [markdown]
# ### Sharded checkpoints
#
# A sharded trainer saves sharded: each rank writes its own shards with
# `torch.distributed.checkpoint` (DCP), which also records how they fit together, so a run
# can resume on the same number of ranks (and DCP could reshard to another). The state that
# `get_state_dict` returns for the model and the optimizer covers DDP, FSDP2 and LoRA alike;
# ZeRO-1's `ZeroRedundancyOptimizer` is not one DCP knows, so each rank saves its own part
# of Adam's state beside the shards. What the weights do not say (step, version, records, the
# shared generator; each rank's sampling generator and RNG) goes into small files. As in
# stage 1, a checkpoint is written into a temporary directory and renamed into place by rank
# 0 after every rank has finished, so a crash mid-write (say, rank 1 killed) leaves the
# previous checkpoint as the newest intact one. Resuming loads the shards, the optimizer
# and the generators and pushes the restored weights into the engines at the restored
# version, so on one CPU the resumed run should end with exactly the weights of an
# uninterrupted one: section 7 kills a rank, resumes, and prints whether they are identical.

# %%
# | export minirl/parallel/checkpoint.py
"""Sharded checkpoints of a data-parallel run: torch.distributed.checkpoint, atomic, verified, exactly resumable.

`save_sharded` writes `root/step-000010/`: every rank's model and optimizer shards with DCP
(`get_state_dict` covers DDP, FSDP2 and peft models), ZeRO-1's per-rank optimizer state
(ZeroRedundancyOptimizer is not a DCP optimizer), each rank's RNG and sampling generator
(`rank-N.pt`), and on rank 0 `training_state.pt` (step, version, records, the shared
generator, the settings, the world size). Written to a temporary directory that rank 0
renames into place once every rank is done (a failed write on any rank stops every rank,
and nothing is renamed). Stage 1's rule for reading them back (notebook 01): newest intact
first, a broken one named and skipped. `sharded_problem` checks a checkpoint's files without
loading the shards (the training state loads, DCP's metadata loads, every shard file is as
long as the metadata says, every rank's file is there); `newest_intact` applies it, in one
process; `ShardedCheckpoints.restore` also falls back when loading fails on any rank.

Simplified vs torchtitan: synchronous saves (no async staging), same world size on resume, no
checksums (a shard overwritten with garbage of the same length loads as garbage weights).
"""

import dataclasses
import errno
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from minirl.parallel.launch import RankFailed, agree
from minirl.parallel.stops import deferred_signals
from minirl.runtime.checkpoint import PREFIX, TMP_PREFIX, CheckpointError
from minirl.runtime.rundir import RunDirError
from minirl.runtime.validate import ConfigError
from minirl.train.run import Callback

TMP = TMP_PREFIX + PREFIX           # .tmp-step-000010: a checkpoint being written


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# %% [markdown]
# The pieces of a sharded checkpoint: what DCP saves for the model and optimizer, what each
# rank saves itself (its random generators' states, ZeRO-1's optimizer), and DCP's and
# torch.save's failures turned into the errors they are (a full disk names its file).

# %%
# | export minirl/parallel/checkpoint.py
def _model_and_optimizer(state):
    """What DCP saves: the model's state, and the optimizer's unless it is ZeRO-1's (saved per rank)."""
    actor = state.roles.actor
    if actor.zero == 1:
        return {"model": get_state_dict(actor.module, [])[0]}
    model_state, optim_state = get_state_dict(actor.module, actor.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _dcp_error(err: CheckpointException, what: str) -> Exception:
    """DCP's CheckpointException (a BaseException, raised on every rank with each failed rank's error) as the first
    failed rank's error, marked `agreed` (every rank has it): an OSError stays one (a full disk names its file)."""
    rank, (first, _) = min(err.failures.items(), key=lambda item: item[0])
    error = first if isinstance(first, OSError) else \
        CheckpointError(f"{what}: rank {rank} failed with {type(first).__name__}: {first}")
    error.agreed = True
    return error


def _rank_state(state) -> dict:
    actor = state.roles.actor
    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "sampling_generator": state.sampling_generator.get_state(),
            "zero1_optimizer": actor.optimizer.optim.state_dict() if actor.zero == 1 else None}


def _disk_error(err: Exception, where: Path) -> Exception:
    """`err` as the OSError it is when the disk holding `where` is full (torch.save's zip writer reports a full
    disk as a RuntimeError, "unexpected pos"), marked `agreed` like `err`; else `err` itself."""
    if isinstance(err, OSError):
        return err
    try:
        full = shutil.disk_usage(where if where.exists() else where.parent).free < 2**20
    except OSError:
        return err
    if not full:
        return err
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    error.agreed = getattr(err, "agreed", False) or isinstance(err, RankFailed)
    return error


# %% [markdown]
# Writing a checkpoint, and finding the newest intact one:

# %%
# | export minirl/parallel/checkpoint.py
def save_sharded(root, state, keep: int = 2) -> Path:
    """Every rank: write checkpoint `root/step-{state.step:06d}` (a collective); returns its path.

    An error while writing on any rank (a full disk, say) is raised on every rank (`agree`):
    the temporary directory is then deleted, never renamed into place.
    """
    root = Path(root)
    rank = dist.get_rank()
    final, tmp = root / f"{PREFIX}{state.step:06d}", root / f"{TMP}{state.step:06d}"

    def promote():                                        # rank 0, once every rank's files are on disk
        torch.save({"step": state.step, "version": state.roles.version, "metrics": state.metrics,
                    "generator": state.generator.get_state(), "world_size": dist.get_world_size(),
                    "config": dataclasses.asdict(state.config), "pconfig": dataclasses.asdict(state.pconfig)},
                   tmp / "training_state.pt")
        with deferred_signals():                          # Ctrl-C waits: all of it or none of it
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        agree(f"creating {tmp}", lambda: tmp.mkdir(parents=True) if rank == 0 else None)
        try:
            dcp.save(_model_and_optimizer(state), checkpoint_id=str(tmp))
        except CheckpointException as err:                # on every rank alike
            raise _dcp_error(err, f"writing {tmp}") from None
        agree(f"writing {tmp}", lambda: torch.save(_rank_state(state), tmp / f"rank-{rank}.pt"))
        agree(f"writing {tmp}", promote if rank == 0 else lambda: None)
    except Exception as err:
        error = _disk_error(err, tmp)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)        # nothing half-written stays (and the space comes back)
        if error is err:
            raise
        raise error from err
    return final


# %% [markdown]
# Checking a checkpoint without loading it: every file it needs is there, none is empty, and
# every shard holds at least the bytes DCP's metadata records for it.

# %%
# | export minirl/parallel/checkpoint.py
def sharded_problem(path) -> str | None:
    """What is wrong with checkpoint `path`, naming the file, or None when it is intact (one process, no collectives).

    Checked without loading the shards: training_state.pt loads and names the world size;
    every rank-N.pt is there and not empty; DCP's .metadata loads, and every shard file it
    lists holds at least the bytes it records there (a truncated .distcp is caught).
    """
    path = Path(path)
    name = path / "training_state.pt"
    try:
        training = torch.load(name, weights_only=False, map_location="cpu")
        world = int(training["world_size"])
    except FileNotFoundError:
        return f"{name} is missing"
    except Exception as err:
        return f"{name} does not load ({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''})"
    for r in range(world):
        own = path / f"rank-{r}.pt"
        if not own.is_file() or own.stat().st_size == 0:
            return f"{own} is missing or empty"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        return f"{path / '.metadata'} does not load ({type(err).__name__}: {err})"
    needed = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        have = shard.stat().st_size if shard.is_file() else None
        if have is None:
            return f"{shard} is missing"
        if have < size:
            return f"{shard} is truncated ({have} of {size} bytes)"
    return None


# %% [markdown]
# Finding where to resume: the newest checkpoint whose files are intact, decided on rank 0
# and the same on every rank.

# %%
# | export minirl/parallel/checkpoint.py
def checkpoints_in(root) -> list[Path]:
    """The checkpoint directories under `root`, newest first (half-written `.tmp-step-*` ones excluded)."""
    root = Path(root)
    return sorted(root.glob(f"{PREFIX}*"), reverse=True) if root.is_dir() else []


def newest_intact(root) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `root` whose files are intact, or None; what is wrong with each newer one)."""
    problems = []
    for path in checkpoints_in(root):
        problem = sharded_problem(path)
        if problem is None:
            return path, problems
        problems.append(problem)
    return None, problems


def latest_sharded(root, world_size: int | None = None) -> Path | None:
    """The newest intact checkpoint under `root` (decided on rank 0, the same on every rank), or None."""
    found = str(newest_intact(root)[0] or "") if dist.get_rank() == 0 else None
    found = _broadcast(found)
    return Path(found) if found else None


# %% [markdown]
# Reading one back, and the two objects the run uses (a callback that saves, and stage 1's
# `LocalCheckpoints` interface for a sharded run):

# %%
# | export minirl/parallel/checkpoint.py
def load_sharded(path, state, push: bool = True) -> None:
    """Restore checkpoint `path` into a freshly built state (every rank), then (push=True) push the weights
    to the engine.

    ConfigError when it was written by another number of ranks; CheckpointError naming the file
    that does not load.
    """
    path = Path(path)
    try:
        training = torch.load(path / "training_state.pt", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{path / 'training_state.pt'} does not load ({type(err).__name__}: {err})") from None
    if training["world_size"] != dist.get_world_size():
        raise ConfigError("nproc_per_node", dist.get_world_size(),
                          f"the checkpoint {path} was written by {training['world_size']} ranks; resume with "
                          f"torchrun --nproc_per_node {training['world_size']}")
    actor = state.roles.actor
    target = _model_and_optimizer(state)
    try:
        dcp.load(target, checkpoint_id=str(path))
    except CheckpointException as err:
        raise _dcp_error(err, f"{path}: the shards do not load") from None
    except Exception as err:
        raise CheckpointError(f"{path}: the shards do not load ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0] if str(err) else ''})") from None
    if actor.zero == 1:
        set_state_dict(actor.module, [], model_state_dict=target["model"], optim_state_dict={})
    else:
        set_state_dict(actor.module, actor.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    own = path / f"rank-{dist.get_rank()}.pt"
    try:
        mine = torch.load(own, weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{own} does not load ({type(err).__name__}: {err})") from None
    if actor.zero == 1:
        actor.optimizer.optim.load_state_dict(mine["zero1_optimizer"])
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    state.sampling_generator.set_state(mine["sampling_generator"])
    state.generator.set_state(training["generator"])
    state.step, state.roles.version, state.metrics = training["step"], training["version"], training["metrics"]
    if push:
        state.sync.push(actor.named_weights(), state.engine, state.roles.version)


# %% [markdown]
# The callback that saves a sharded checkpoint every `every` steps and at the end of a run,
# with every rank taking part.

# %%
# | export minirl/parallel/checkpoint.py
class ShardedCheckpointer(Callback):
    """A sharded checkpoint every `every` steps and at a normal end (every rank takes part)."""

    def __init__(self, root, every: int, keep: int):
        self.root, self.every, self.keep = Path(root), every, keep
        self.saved_step = None

    def on_start(self, state):
        if dist.get_rank() == 0 and self.root.is_dir():
            for stale in self.root.glob(f"{TMP}*"):       # half-written by a crash
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    def on_step(self, state, record):
        if self.every and state.step % self.every == 0:
            save_sharded(self.root, state, self.keep)
            self.saved_step = state.step

    def on_end(self, state):
        if not state.interrupted and self.saved_step != state.step:
            save_sharded(self.root, state, self.keep)


# %% [markdown]
# The checkpoints as notebook 01's `run_in_dir` wants them: a callback to save, and a
# `restore` that loads the newest intact checkpoint and falls back to the one before it when
# a rank fails to load it.

# %%
# | export minirl/parallel/checkpoint.py
class ShardedCheckpoints:
    """Sharded checkpoints as notebook 01's `run_in_dir` takes them (the protocol of its `LocalCheckpoints`).

    `callback()` is a ShardedCheckpointer under `out_dir/checkpoints`; `restore(state)` loads
    the newest intact one on every rank: a checkpoint whose files are broken, or that fails to
    load on any rank, is named on rank 0's stderr and the one before it is tried (RunDirError,
    on every rank alike, when none is left).
    """

    def __init__(self, out_dir, config):
        self.root, self.config = Path(out_dir) / "checkpoints", config

    def callback(self) -> ShardedCheckpointer:
        return ShardedCheckpointer(self.root, self.config.run.checkpoint_every, self.config.run.keep_checkpoints)

    def restore(self, state) -> None:
        main, problems = dist.get_rank() == 0, []
        for path in map(Path, _broadcast([str(p) for p in checkpoints_in(self.root)] if main else None)):
            problem = _broadcast(sharded_problem(path) if main else None)
            if problem is None:
                try:
                    agree(f"restoring {path}", lambda path=path: load_sharded(path, state, push=False))
                except ConfigError:
                    raise
                except Exception as err:                  # on every rank alike: this rank's or another's error
                    problem = str(err)
                else:
                    state.sync.push(state.roles.actor.named_weights(), state.engine, state.roles.version)
                    return
            if main:
                print(f"warning: checkpoint {path} is broken: {problem}; falling back to the one before it",
                      file=sys.stderr, flush=True)
            problems.append(problem)
        if problems:
            error = RunDirError(f"--resume: no checkpoint in {self.root} is intact (each is named above); put the "
                                "files back from a copy, or start the run again with --overwrite")
        else:
            error = RunDirError(f"--resume: {self.root.parent} holds no checkpoint yet (the run stopped before its "
                                "first one); start it again with --overwrite")
        error.agreed = True                               # every rank raises it (see `agree`)
        raise error

# %% [markdown]
# ### Memory, per rank, as notebook 03 counts it
#
# Notebook 03 counted what a rank holds by the storages behind its tensors (DTensor shards
# by their local storage, shared storages once). `MemoryTracker` applies the same count to a
# live RL run: the trainer's parameters, gradients and Adam state at rest, the engine's
# weights, and a sample taken right after the actor's forward pass in the update, when FSDP2
# has a layer's full weights gathered (ZeRO-2 keeps them all until backward) and the
# previous step's gradients are already freed (`zero_grad(set_to_none=True)` runs first);
# the peak column is the largest of the samples, printed per run. The engine's bytes are taken twice: during the
# update (asleep, when colocated) and after the sync (awake). Their difference is what
# colocation gives back to the trainer. On CUDA it also reads the allocator's own peak,
# which sees what counting named tensors cannot: activations, communication buffers, KV
# caches, fragmentation.

# %%
# | export minirl/memory/tracking.py
"""Memory of a live data-parallel run, per rank, counted as notebook 03 counts it.

`trainer_bytes` splits what a rank's actor holds into weights (local shards), gradients and
optimizer state; `engine_bytes` counts the engine's weights (0 while a colocated engine
sleeps). `MemoryTracker` is a run callback: a forward hook on the actor samples the rank's
total right after the update's forward pass (gathered FSDP2 weights, last step's gradients,
Adam, the engine, asleep if colocated), the end of each step samples it at rest (engine
awake after the sync), and every rank's figures are gathered into the record (lists, one
entry per rank): "memory/update_bytes" (the sample in the update), "memory/rest_bytes" (at
rest), "memory/peak_bytes" (the larger), "memory/state_bytes", "memory/{weights,grads,
optimizer}_bytes", "memory/engine_awake_bytes", "memory/engine_asleep_bytes", and on CUDA
"memory/cuda_peak_bytes".

Simplified: storage counting sees named tensors only (no activations or buffers); the CUDA
allocator's peak is the ground truth where there is one.
"""

import torch
import torch.distributed as dist

from minirl.memory.measure import storage_bytes
from minirl.train.run import Callback


def _optimizer_tensors(actor) -> list:
    optimizer = actor.optimizer.optim if hasattr(actor.optimizer, "optim") else actor.optimizer   # ZeRO-1 wraps one
    return [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]


def trainer_bytes(actor) -> dict[str, int]:
    """{"weights", "grads", "optimizer"}: storage bytes this rank's actor holds at rest (DTensor shards locally)."""
    params = list(actor.model.parameters())
    return {"weights": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
            "optimizer": storage_bytes(_optimizer_tensors(actor))}


def engine_bytes(engine) -> int:
    """Bytes of the engine's weights as it holds them now (vLLM: its device memory, from mem_get_info)."""
    if hasattr(engine, "memory_bytes"):
        return engine.memory_bytes()
    try:
        return storage_bytes(t for _, t in engine.named_weights())
    except NotImplementedError:
        return 0


# %% [markdown]
# The callback that records each rank's memory on every step, so that the run's records can
# be set beside notebook 03's calculator.

# %%
# | export minirl/memory/tracking.py
class MemoryTracker(Callback):
    """Per-rank memory of every step, in the record (lists indexed by rank). Every rank must run it."""

    def __init__(self):
        self.hook, self.shards, self.update, self.asleep = None, [], 0, 0

    def _sample(self, state, registered) -> int:
        """This rank's bytes now: shards + the parameters registered now + gradients + Adam + the engine."""
        grads = [p.grad for p in self.shards]
        tensors = [*self.shards, *registered, *grads, *_optimizer_tensors(state.roles.actor)]
        return storage_bytes(tensors) + engine_bytes(state.engine)

    def on_start(self, state):
        module = state.roles.actor.module
        self.shards = list(module.parameters())          # at rest: what the rank owns

        def after_forward(mod, args, output):            # FSDP2 has swapped gathered tensors in
            if torch.is_grad_enabled():
                self.update = max(self.update, self._sample(state, list(module.parameters())))
                self.asleep = engine_bytes(state.engine)

        self.hook = module.register_forward_hook(after_forward)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step(self, state, record):
        parts = trainer_bytes(state.roles.actor)
        awake = engine_bytes(state.engine)
        rest = self._sample(state, [])
        mine = {"update": self.update, "rest": rest, "peak": max(self.update, rest), "state": sum(parts.values()),
                "awake": awake, "asleep": self.asleep, **parts}
        if torch.cuda.is_available():
            mine["cuda_peak"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        for key in ("update", "rest", "peak"):
            record[f"memory/{key}_bytes"] = [m[key] for m in everyone]
        record["memory/state_bytes"] = [m["state"] for m in everyone]
        record["memory/engine_awake_bytes"] = [m["awake"] for m in everyone]
        record["memory/engine_asleep_bytes"] = [m["asleep"] for m in everyone]
        for part in ("weights", "grads", "optimizer"):
            record[f"memory/{part}_bytes"] = [m[part] for m in everyone]
        if "cuda_peak" in mine:
            record["memory/cuda_peak_bytes"] = [m["cuda_peak"] for m in everyone]
        self.update = 0

    def on_end(self, state):
        if self.hook is not None:
            self.hook.remove()

# %% [markdown]
# ## 7. Run it under `torchrun`
#
# The chapter script is the whole job: every rank parses the flags (and refuses bad ones),
# joins the group, loads the policy, sets up its roles, engine and sync (all ranks agreeing),
# and runs `spmd_step` through notebook 01's `run_in_dir`, the function under stage 1's
# `train` and stage 6's Driver (the run directory, resume, evaluation, log, checkpoints):
# rank 0 opens the directory, evaluates held-out accuracy on its engine, logs, and writes
# the summary (`main=False` on the others); every rank takes part in the sharded
# checkpoints (`ShardedCheckpoints`, with the two methods of stage 1's `LocalCheckpoints`),
# and `agree` makes a failure while opening or restoring stop every rank. This cell launches
# it on two CPU processes (`torchrun --nproc_per_node 2`). In smoke mode it reads section 0's
# short LoRA job again (no new job); in full mode it runs a set of jobs: each ZeRO level
# briefly (memory), full fine-tuning and LoRA long enough to learn, LoRA with adapter-only
# sync, the sync before packing (one all-gather per tensor), syncing every 4th step (without
# and with an importance-sampling correction), and one and two ranks on the same batch. Each
# job shows a bar that follows the steps rank 0 logs to its `metrics.jsonl` (`step_bar`,
# in the first cell: the chapter's own bar is only drawn on a terminal).

# %%
from minirl.runtime.launch import torchrun  # noqa: E402

SYNC_EVERY = 4      # the runs that synchronize less often: every 4th update, without and with TIS
STALE_STEPS = 60    # their length (the learning they cost is compared over these first steps)

runs = {}
started = time.perf_counter()
if SMOKE:
    runs["lora"] = first                       # section 0's job
else:
    for zero in (0, 1, 2):
        runs[f"zero{zero}"] = run_chapter(f"04_zero{zero}", "--zero", str(zero), "--steps", "10", "--eval-every", "0")
    runs["full"] = run_chapter("04_full", "--zero", "3", "--steps", "150", "--eval-every", "25")
    runs["zero3"] = runs["full"]
    runs["lora"] = run_chapter("04_lora", "--zero", "3", "--lora-rank", "8", "--learning-rate", LORA_LR,
                               "--steps", "150", "--eval-every", "25")
    runs["adapter"] = run_chapter("04_adapter", "--zero", "3", "--lora-rank", "8", "--sync-mode", "adapter",
                                  "--learning-rate", LORA_LR, "--steps", "30", "--eval-every", "0")
    runs["per_tensor"] = run_chapter("04_per_tensor", "--zero", "3", "--no-packed-sync", "--steps", "30",
                                     "--eval-every", "0")                      # the sync before packing
    for name, extra in (("sync_every", ()), ("sync_every_tis", ("--importance-sampling-correction",))):
        runs[name] = run_chapter(f"04_{name}", "--zero", "3", "--sync-every", str(SYNC_EVERY), "--no-colocate",
                                 "--steps", str(STALE_STEPS), "--eval-every", "0", *extra)
print("smoke mode: section 0's job, read again" if SMOKE else
      f"\n{len(runs)} runs in {time.perf_counter() - started:.0f} s")

# %% [markdown]
# ### Does it learn?
#
# Stage 1's claim was that GRPO from the warm start raises held-out accuracy; the same step on
# two ranks should do the same per step, since each step sees the same global batch size
# (16 prompts, 8 completions each, 8 prompts per rank).

# %%
rows = []
for name in ("full", "lora"):
    if name in runs and runs[name][0]["accuracy_before"] is not None:
        s = runs[name][0]
        rows.append((name, s["steps"], f"{s['accuracy_before']:.3f}", f"{s['accuracy_after']:.3f}",
                     f"{100 * (s['accuracy_after'] - s['accuracy_before']):+.1f}", f"{s['seconds']:.0f}"))
show(rows, ("run", "steps", "accuracy before", "after", "points", "seconds"))
if SMOKE:
    print("smoke mode: 4 steps on 4 prompts, too short to judge; full mode trains 150 steps")
else:
    gain = runs["full"][0]["accuracy_after"] - runs["full"][0]["accuracy_before"]
    print("held-out accuracy rises as in stage 1:", "yes" if gain > 0.05 else "NO (look at the reward curve)")
fig, ax = plt.subplots(figsize=(8, 3.4))
for name, (_, metrics) in runs.items():
    if name in ("full", "lora"):
        steps = [m for m in metrics if "reward" in m]
        k = max(1, len(steps) // 15)
        reward = [sum(m["reward"] for m in steps[max(0, i - k + 1):i + 1]) / len(steps[max(0, i - k + 1):i + 1])
                  for i in range(len(steps))]
        ax.plot([m["step"] for m in steps], reward, label=f"{name}: batch reward (mean of {k})")
        evals = [(m["step"], m["accuracy"]) for m in metrics if "accuracy" in m]
        ax.plot(*zip(*evals, strict=True), "o--", label=f"{name}: held-out accuracy")
ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1), title="GRPO on 2 ranks: full fine-tuning vs LoRA")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Per-rank memory at each ZeRO level, against notebook 03's calculator
#
# Every step logs each rank's bytes, counted as notebook 03 counts them. The bars are the
# trainer's state at rest (weights, gradients, Adam) with the engine's copy (awake) stacked
# on top; the triangle is what the rank held right after the update's forward pass (the
# engine asleep, FSDP2's gathered layers still there, the previous step's gradients already
# freed); the star is the calculator's FP32 state per rank (`zero_per_gpu`, or `lora_memory`
# for LoRA) for the same parameter count and two ranks.

# %%
from minirl.memory.calculator import lora_memory, zero_per_gpu  # noqa: E402

labels, rows = [], []
fig, ax = plt.subplots(figsize=(9, 3.6))
colors = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "engine": "#bbbbbb"}
for i, name in enumerate(n for n in ("zero0", "zero1", "zero2", "zero3", "lora") if n in runs):
    summary, metrics = runs[name]
    last, zero = [m for m in metrics if "memory/peak_bytes" in m][-1], summary["parallel"]["zero"]
    psi, trainable = summary["params"], summary["trainable_params"]
    calc = (zero_per_gpu(psi, 2, zero, "fp32") if trainable == psi
            else lora_memory(psi - trainable, trainable, 2, zero, "fp32"))["total"]
    for rank in range(2):
        x, bottom = 2.5 * i + rank, 0.0
        for part in ("weights", "grads", "optimizer"):
            value = last[f"memory/{part}_bytes"][rank] / MiB
            ax.bar(x, value, bottom=bottom, color=colors[part], label=part if i == rank == 0 else None)
            bottom += value
        engine = last["memory/engine_awake_bytes"][rank] / MiB
        ax.bar(x, engine, bottom=bottom, color=colors["engine"], hatch="//", label="engine (awake)" if i == rank == 0 else None)
        ax.plot(x, summary["update_bytes"][rank] / MiB, "k^", label="during the update" if i == rank == 0 else None)
        ax.plot(x, calc / MiB, "r*", ms=11, label="calculator (state)" if i == rank == 0 else None)
        state = last["memory/state_bytes"][rank]
        rows.append((name, f"ZeRO-{zero}", rank, f"{state / MiB:.2f}", f"{calc / MiB:.2f}", f"{state / calc:.3f}",
                     f"{summary['update_bytes'][rank] / MiB:.2f}", f"{summary['peak_bytes'][rank] / MiB:.2f}"))
    labels.append((2.5 * i + 0.5, f"{name}\nZeRO-{zero}"))
ax.set_xticks([x for x, _ in labels], [t for _, t in labels])
ax.set(ylabel="MiB per rank", title="what each rank holds (2 ranks, FP32, embedded policy)")
ax.legend(fontsize=7, ncol=3)
plt.tight_layout()
plt.show()
show(rows, ("run", "stage", "rank", "state MiB", "calculator MiB", "measured / calculator", "in update MiB",
            "peak MiB"))

# %% [markdown]
# Read the ratios against notebook 03's table. DDP holds the whole 16 bytes per parameter on
# each rank and ZeRO-3 a half. ZeRO-1's ZeroRedundancyOptimizer hands out *whole tensors*, so
# its ranks' shares need not be equal (the ratio column shows how close they came). FSDP2's
# "ZeRO-2" reshards after backward, so at rest it holds ZeRO-3's shard (ratio below 1 against
# the calculator's ZeRO-2, which keeps whole weights); the column "in update" shows the whole
# weights it keeps gathered from forward to backward, while ZeRO-3 has let them go. The
# engine's copy is the one thing the calculator does not count, and on every rank it is a
# whole model; colocation gives it back during the update, and that is exactly the room
# ZeRO-2's gathered weights take.

# %%
if not SMOKE:
    ratios = {r[0]: float(r[5]) for r in rows}
    for name in ("zero0", "zero3", "lora"):
        assert abs(ratios[name] - 1) < 0.02, f"{name}: measured state differs from the calculator"
    update = {name: runs[name][0]["update_bytes"][0] for name in ("zero2", "zero3")}
    assert update["zero2"] > update["zero3"], "ZeRO-2 keeps the gathered layers through the update"

# %% [markdown]
# The source's ZeRO table gives each level's per-GPU saving: ~4×, ~8× and N×. Those follow
# from its own 16 bytes per parameter in mixed precision (2 + 2 + 12): ZeRO-1 keeps
# 4 + 12/N and ZeRO-2 2 + 14/N bytes, so ~4× and ~8× are the limits for many GPUs, and
# ZeRO-3's 16/N is exactly N×. Our runs are FP32 on two ranks (4 + 4 + 8 bytes), where the
# same formula gives much less. The table sets the source's figure beside its formula's
# limit, the formula at our setting (notebook 03's `zero_saving`), and what the runs held
# (DDP's state over each level's, rank mean); the rule of each verdict is in the cell.

# %%
from minirl.memory.calculator import zero_saving  # noqa: E402

SOURCE_SAVING = {1: ("~4x", 4.0), 2: ("~8x", 8.0), 3: ("Nx", None)}   # None: N itself
MANY = 10**6                                                          # "many GPUs", for the limits
state = {zero: sum(runs[f"zero{zero}"][0]["state_bytes"]) / 2 for zero in range(4) if f"zero{zero}" in runs}
rows = []
for zero, (said, value) in SOURCE_SAVING.items():
    limit = zero_saving(MANY, zero, "mixed") if value else None
    source_ok = (abs(limit - value) / value < 0.1) if value else zero_saving(2, 3, "mixed") == 2
    ours = zero_saving(2, zero, "fp32")
    measured = state[0] / state[zero] if 0 in state and zero in state else None
    rows.append((f"ZeRO-{zero}", said, f"{limit:.2f}x" if value else "N x (2.00x at N=2)",
                 "agree" if source_ok else "differs", f"{ours:.2f}x",
                 "not run (smoke mode)" if measured is None else f"{measured:.2f}x",
                 "-" if measured is None else "agree" if abs(measured / ours - 1) < 0.05 else "differs"))
show(rows, ("stage", "source", "its formula, mixed, N -> inf", "source vs formula (10 %)", "formula, FP32, N=2",
            "measured (DDP / this)", "measured vs formula (5 %)"))
if 2 in state and 3 in state:
    at_rest = state[0] / state[2]
    print(f"FSDP2's ZeRO-2 at rest saves {at_rest:.2f}x: " + (
        "ZeRO-3's figure (it reshards after backward; its whole weights live only from forward to backward)"
        if abs(at_rest / zero_saving(2, 3, "fp32") - 1) < 0.05 else "not ZeRO-3's figure either"))

# %% [markdown]
# ### The sync's share of the step, beside the source's 5 %
#
# The source's symptom table flags weight synchronization above 5 % of the step and names
# three remedies: pack the transfers, synchronize only the LoRA adapters, synchronize less
# often. Each run times its sync at every step; at the end the chapter also pushes the
# trainer's weights in every mode it can ship, one all-gather per tensor (the sync before
# packing), one per layer, and in 256 MiB buckets, into a buffer (so only the sync is
# timed, interleaved so the machine's load hits every row alike), and divides by the run's
# median step. First that table, from the LoRA run:

# %%
import statistics  # noqa: E402
import subprocess  # noqa: E402

print("machine load (uptime):", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
summary = runs["lora"][0]
rows = [(r["mode"], r["transfer"], r["tensors"], f"{r['bytes'] / MiB:.3f}", f"{1e3 * r['seconds']:.1f}",
         f"{100 * r['share']:.1f} %", "above: slow sync" if r["share"] > 0.05 else "below")
        for r in summary["sync_table"]]
show(rows, ("sync mode", "transfer", "tensors", "MiB per sync", "ms per sync", "push / median step", "source: 5 %"))
table = {(r["mode"], r["transfer"]): r for r in summary["sync_table"]}
bucketed = next(t for _, t in table if t.endswith("buckets"))
for mode in ("full", "merged", "adapter"):
    per_tensor, packed = table[(mode, "per tensor")]["seconds"], table[(mode, bucketed)]["seconds"]
    print(f"{mode}: packed into {bucketed} it takes {packed / per_tensor:.0%} of the per-tensor time "
          f"({per_tensor / packed:.1f}x faster)")
for transfer in ("per tensor", bucketed):
    adapter, merged = table[("adapter", transfer)], table[("merged", transfer)]
    time_ratio = adapter["seconds"] / merged["seconds"]
    print(f"adapter-only against merged, {transfer}: {adapter['bytes'] / merged['bytes']:.1%} of the bytes, "
          f"{time_ratio:.0%} of the time, {adapter['tensors']} tensors against {merged['tensors']}: "
          + ("faster in time too" if time_ratio < 1 else "NOT faster in time"))
    assert adapter["bytes"] < 0.1 * merged["bytes"]

# %% [markdown]
# The bytes are fixed by the shapes; the time is this machine's, and the last two lines say,
# per transfer, whether the adapter's fewer bytes also made it faster. Packed, the whole
# adapter is one small collective and the engine copies only A and B into place, where a
# merged sync gathers every base weight with its adapter, multiplies B A for every adapted
# layer and copies whole matrices. One tensor per collective, the adapter needs more round
# trips than merged (its tensors column) but skips the merge; on CPUs with gloo a round
# trip's fixed cost, not its bytes, is what a small collective pays, and the per-tensor line
# says which of the two won here.
#
# The table times pushes into a buffer; each run's own share (one per run: the run's sync
# seconds over its step seconds, the figure set beside the 5 %) also pays the real engine
# (waking it up, copying into place) and the wait for the slower rank at the first
# collective after its update (the line under the run table sets the LoRA run's share
# beside its buffer row, and says how far apart they are). The runs, side by side (full mode: one run per remedy;
# smoke mode: the one LoRA job). The defaults of `chapters/04_fsdp_lora.py` are the `full`
# run's settings: ZeRO-3, full fine-tuning, packed in 256 MiB buckets, a sync every step.

# %%
def sync_row(name: str) -> tuple:
    """One run's own sync: what it shipped, how often, its share of the steps and the staleness it paid."""
    s, metrics = runs[name]
    steps = [m for m in metrics if "reward" in m]
    median_ms = 1e3 * statistics.median(m["time/sync"] for m in steps if m.get("sync/pushed", 1))
    transfer = f"{s['parallel']['sync_bucket_mb']:g} MiB buckets" if s["packed_sync"] else "per tensor"
    return (name, s["sync_mode"], transfer, s["sync_every"], f"{s['sync_bytes'] / MiB:.3f}", f"{median_ms:.1f}",
            f"{100 * s['sync_share']:.1f} %", s["staleness_max"],
            "above: slow sync" if s["sync_share"] > 0.05 else "below")


names = [n for n in ("per_tensor", "full", "lora", "adapter", "sync_every", "sync_every_tis") if n in runs]
show([sync_row(n) for n in names], ("run", "mode", "transfer", "sync every", "MiB per push", "ms per push (median)",
                                    "sync share of the run", "max staleness", "source: 5 %"))
own, timed = runs["lora"][0], table[("merged", bucketed)]
ratio = own["sync_share"] / timed["share"]
print(f"\nthe LoRA run's one sync share: {100 * own['sync_share']:.1f} % (all its sync seconds over all its step "
      f"seconds); the buffer table's push alone (merged, {bucketed}): {100 * timed['share']:.1f} % of a median step; "
      + (f"the run's is {ratio:.1f}x that: it also pays the engine's copy and the wait for the slower rank"
         if ratio > 1.1 else f"the run's is {ratio:.2f}x that: within 10 %, the push is nearly all of the run's sync"
         if ratio >= 0.9 else f"the run's is {ratio:.2f}x that: a noisy machine (the two were timed at different "
         "moments)"))
if "sync_every" in runs:
    before, after = runs["per_tensor"][0]["sync_share"], runs["full"][0]["sync_share"]
    print(f"\nfull fine-tuning at the chapter's defaults: {100 * before:.1f} % of the step per tensor, "
          f"{100 * after:.1f} % packed: " + ("under" if after < 0.05 else "NOT under") + " the source's 5 %")
    s = runs["sync_every"][0]
    print(f"sync every {s['sync_every']} steps: share {100 * s['sync_share']:.1f} % against {100 * after:.1f} % every "
          f"step, {after / s['sync_share']:.1f}x less for K = {s['sync_every']}")
    print(f"sync every {s['sync_every']} steps: {s['pushes']} pushes in {s['steps']} steps (every {s['sync_every']}th,"
          f" and the last); each batch generated up to {s['staleness_max']} updates behind the trainer "
          f"(mean {s['staleness_mean']:.2f}). What that costs the learning, over the same first {STALE_STEPS} steps:")

    def mean_reward(name: str) -> float:
        steps = [m for m in runs[name][1] if "reward" in m][:STALE_STEPS]
        return sum(m["reward"] for m in steps) / len(steps)

    fresh = mean_reward("full")
    show([(name, runs[name][0]["sync_every"], "TIS" if runs[name][0]["config"]["algorithm"][
              "importance_sampling_correction"] else "none", runs[name][0]["staleness_max"],
           f"{mean_reward(name):.3f}", f"{mean_reward(name) - fresh:+.3f}")
          for name in ("full", "sync_every", "sync_every_tis")],
         ("run", "sync every", "correction", "max staleness", f"mean batch reward, steps 1-{STALE_STEPS}",
          "vs every step"))
    stale, corrected = mean_reward("sync_every"), mean_reward("sync_every_tis")
    print("stale batches learn " + ("less" if stale < fresh else "NOT less") + " than fresh ones here, and the "
          "correction " + ("has nothing to recover" if stale >= fresh else "recovers part of it"
                           if stale < corrected < fresh else "recovers all of it" if corrected >= fresh
                           else "does not help on this run"))

# %% [markdown]
# Synchronizing every K-th step divides the sync's share by up to about K (a run also pushes
# at evaluations, checkpoints and its last step; the first "sync every" line under the run
# table prints the factor this run got) and costs freshness:
# between two pushes the engine keeps generating with the weights it holds, so a batch can
# be up to K-1 updates old, and a policy gradient taken on another policy's samples is a
# biased one: the table above puts a number on what that did to the learning here (the
# embedded policy moves a long way in a few updates at this learning rate, so K = 4 is a
# harsh setting for it). The step stays honest about the staleness. The skipped syncs hand
# `rl_step` a `KeepWeights`, which moves nothing and reports the version the engine really
# holds, so every batch is generated, version-checked and logged as the policy that made
# it (`generated_version`); the rollout's log-probs, the denominator of notebook 02's
# importance-sampling correction (`--importance-sampling-correction`), come from that same
# older policy; and each record says how many updates it lagged (`staleness`). Without the
# correction the update treats the stale batch as on-policy, as LlamaRL does (notebook 07);
# with it, each token is reweighted by pi_theta / pi_behaviour, truncated. Evaluations,
# checkpoints and the last step always push: an evaluation must measure the latest weights,
# and a resume refills the engine from the restored trainer, so the engine must have held
# exactly those when the checkpoint was taken (otherwise the resumed run would differ).
# Syncing less often needs the engine to keep its weights between steps, so it cannot be
# colocated at vLLM's sleep level 2 (`--no-colocate`; on a GPU, level 1 would offload them).
#
# By ZeRO level, the runs' own shares:

# %%
rows = [(name, f"ZeRO-{runs[name][0]['parallel']['zero']}", runs[name][0]["sync_mode"],
         f"{1e3 * runs[name][0]['sync_seconds']:.1f}", f"{100 * runs[name][0]['sync_share']:.1f} %")
        for name in ("zero0", "zero1", "zero2", "zero3", "lora", "adapter") if name in runs]
show(rows, ("run", "stage", "sync", "ms per sync", "share of the step"))
s = runs["lora"][0]
print(f"the gathered copy peaked at {s['sync_peak_bytes'] / MiB:.2f} MiB in the LoRA run (one decoder layer of the "
      f"policy: {layer_bytes / MiB:.2f} MiB; the whole policy: {whole_bytes / MiB:.2f} MiB): a 256 MiB bucket holds "
      "this whole model, buffer and tensors")
if not SMOKE:
    ddp, fsdp = runs["zero0"][0]["sync_share"], runs["zero3"][0]["sync_share"]
    print("DDP's sync is a copy (its weights are whole on every rank), FSDP2's needs a gather: DDP's share is",
          "smaller" if ddp < fsdp else "NOT smaller on this run")

# %% [markdown]
# Under DDP and ZeRO-1 every rank already holds whole weights, so the sync is a copy in
# memory. Under FSDP2 the weights are first all-gathered, and on CPUs with gloo that time
# is mostly latency: that is what the per-tensor rows of the tables above pay, for a
# 1 M-parameter model (their verdict column sets each beside the source's 5 %). On GPUs with NCCL and a real model the bandwidth term grows
# and the bytes column becomes the one to read: that is where adapter-only sync pays most,
# and where the bucket size (memory against round trips) is a real decision.

# %% [markdown]
# ### Full fine-tuning against LoRA
#
# Same policy, same steps, two ranks, ZeRO-3: what each holds, what each sync moves, how
# fast each steps, and how each learns (the curves above). The source's memory table puts
# "~40 % slower per step" on ZeRO-3 + gradient checkpointing + LoRA, against unsharded full
# fine-tuning; notebook 03 showed that checkpointing alone costs up to a third more compute,
# and these runs use none. So the line under the table sets LoRA's own change in step time
# (against full fine-tuning, both ZeRO-3) beside the source's 40 %, with the rule it uses.

# %%
SOURCE_LORA_SLOWDOWN = 0.40        # the source: "~40 % slower per step" (ZeRO-3 + checkpointing + LoRA)


def step_seconds(name: str, stage: str | None = None) -> float:
    """Median seconds of a step of run `name` (or of one of its stages: "update"), rank 0's records."""
    steps = [m for m in runs[name][1] if "reward" in m]
    return statistics.median(m[f"time/{stage or 'step'}"] for m in steps)


if SMOKE:
    print("smoke mode: one LoRA job only; full mode runs full fine-tuning beside it")
else:
    rows = []
    for name in ("full", "lora", "adapter"):
        s = runs[name][0]
        rows.append((name, f"{s['trainable_params']:,}", f"{s['state_bytes'][0] / MiB:.2f}",
                     f"{s['peak_bytes'][0] / MiB:.2f}", s["sync_mode"], f"{s['sync_bytes'] / MiB:.3f}",
                     f"{100 * s['sync_share']:.1f} %", f"{1e3 * step_seconds(name):.0f}",
                     f"{1e3 * step_seconds(name, 'update'):.0f}",
                     "not evaluated" if s["accuracy_after"] is None else f"{s['accuracy_after']:.3f}"))
    show(rows, ("run", "trainable", "state MiB (rank 0)", "peak MiB", "sync", "MiB per sync", "sync share",
                "ms per step", "ms per update", "accuracy after"))
    slower = step_seconds("lora") / step_seconds("full") - 1
    update = step_seconds("lora", "update") / step_seconds("full", "update") - 1
    print(f"\nLoRA against full fine-tuning (both ZeRO-3, no checkpointing): {slower:+.0%} per step, {update:+.0%} per "
          f"update; the source: {SOURCE_LORA_SLOWDOWN:+.0%} per step with checkpointing. Within 15 points: "
          + ("agree" if abs(slower - SOURCE_LORA_SLOWDOWN) <= 0.15 else "differs"))

# %% [markdown]
# ### Colocation in the run
#
# Each rank's engine slept through every update. The record of each step holds its bytes
# during the update and after the sync, and how long the sleep and the wake-up took:

# %%
rows = []
for name in ("zero3", "lora", "adapter"):
    if name in runs:
        c = runs[name][0]["colocation"]
        rows.append((name, f"{c['engine_awake_bytes'][0] / MiB:.3f}", f"{c['engine_asleep_bytes'][0] / MiB:.3f}",
                     f"{(c['engine_awake_bytes'][0] - c['engine_asleep_bytes'][0]) / MiB:.3f}",
                     f"{1e3 * c['sleep_seconds']:.2f}", f"{1e3 * c['wake_seconds']:.2f}"))
show(rows, ("run", "engine awake MiB", "asleep MiB", "freed MiB", "sleep ms", "wake ms"))

# %% [markdown]
# ### One rank or two: the same numbers
#
# With `--seed-per-prompt` the batch of a step does not depend on how many ranks share it,
# so one and two ranks must compute the same losses and end with the same weights, up to
# float rounding: a sum over two halves is not bit for bit a sum over the whole, and Adam,
# which divides by the root of the squared gradient, can turn a rounding difference in a
# gradient close to zero into a difference of up to about one learning rate per step.
# `tests/test_parallel_torchrun.py` checks this against notebook 01's loop for dapo and grpo,
# with and without LoRA, under every wrapper; here once more, on the embedded policy.

# %%
if SMOKE:
    print("smoke mode: skipped (tests/test_parallel_torchrun.py checks it on every CI run)")
else:
    same = ("--seed-per-prompt", "--steps", "5", "--eval-every", "0", "--zero", "3")
    one = run_chapter("04_one_rank", *same, nproc=1)
    two = run_chapter("04_two_ranks", *same, nproc=2)
    from safetensors.torch import load_file

    rows = [(m1["step"], f"{m1['loss']:+.6f}", f"{m2['loss']:+.6f}", f"{m1['reward']:.4f}", f"{m2['reward']:.4f}")
            for m1, m2 in zip(one[1], two[1], strict=True)]
    show(rows, ("step", "loss, 1 rank", "loss, 2 ranks", "reward, 1 rank", "reward, 2 ranks"))
    w1, w2 = (load_file(RUNS / n / "final" / "model.safetensors") for n in ("04_one_rank", "04_two_ranks"))
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    print(f"largest weight difference after 5 steps: {worst:.2e} (learning rate {RLConfig().optimizer.learning_rate})")
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(one[1], two[1], strict=True)) and worst < 5 * 3e-4

# %% [markdown]
# ### A killed rank, resumed exactly
#
# Section 6 promised that a sharded run resumes to exactly the weights of an uninterrupted
# one. Here it is, small (in both modes): section 0's 4-step LoRA job, with its checkpoint
# every 2 steps, against the same job with rank 1 killed after step 3
# (`--kill-rank 1:3`, a test flag that ends that process as a crash would); then
# `--resume` on the broken run, which loads step 2's shards, replays step 3 and finishes.
# The cell compares the two final models tensor by tensor.

# %%
from safetensors.torch import load_file  # noqa: E402

whole_dir = RUNS / "04_first"                   # section 0's job, uninterrupted
broken_dir = RUNS / "04_resume_broken"
QUICK_STEPS = int(QUICK[QUICK.index("--steps") + 1])
with step_bar(broken_dir / "metrics.jsonl", QUICK_STEPS, "killed job"):
    killed = torchrun(CHAPTER, 2, ["--out", broken_dir, "--overwrite", "--no-progress", *QUICK,
                                   "--kill-rank", "1:3"], timeout=900)
said = [line for line in killed.stdout.splitlines() if line.startswith("rank 1")]
print(f"killed job: exit {killed.returncode}; " + "; ".join(said))
print("checkpoints left:", sorted(p.name for p in (broken_dir / "checkpoints").iterdir()))
with step_bar(broken_dir / "metrics.jsonl", QUICK_STEPS, "resumed job"):
    resumed = torchrun(CHAPTER, 2, ["--out", broken_dir, "--resume", "--no-progress"], timeout=900)
if resumed.returncode:
    raise RuntimeError(f"resume failed (exit {resumed.returncode}):\n{resumed.stdout[-3000:]}")
a, b = (load_file(d / "final" / "model.safetensors") for d in (whole_dir, broken_dir))
identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
logged = [json.loads(line)["step"] for line in (broken_dir / "metrics.jsonl").read_text().splitlines()]
print(f"steps logged by the resumed run: {logged}")
print(f"final weights, resumed against uninterrupted ({len(a)} tensors): "
      + ("identical, bit for bit" if identical else "DIFFERENT"))
assert killed.returncode != 0 and identical

# %% [markdown]
# ## 8. Bad input stops every rank, with its cause
#
# A job of N processes has N ways to fail halfway. The rule here: anything that can be checked
# before loading is checked by every rank on its own (they reach the same verdict: a flag is
# the same everywhere), and anything found later (a LoRA target that matches nothing, an
# engine that cannot take a tensor) is found inside `agree`, which turns one rank's error into
# an error on every rank, so that none is left waiting in a collective. `torchrun` then ends
# the job. The in-process checks:

# %%
from minirl.rollout.base import VersionMismatchError  # noqa: E402
from minirl.rollout.colocated import EngineNotReady  # noqa: E402
from minirl.runtime.validate import ConfigError  # noqa: E402

engine = ColocatedEngine(SharedPrefixEngine(copy.deepcopy(model), tokenizer), colocate=False)
state = list(model.state_dict().items())
attempts = {
    "LoRA target that matches nothing": lambda: apply_lora(copy.deepcopy(model), 8, targets=("q_proj", "wq")),
    "a misnamed tensor": lambda: engine.load_weights([(n.replace("up_proj", "up"), t) for n, t in state], 1),
    "a missing tensor": lambda: engine.load_weights(state[:-2], 1),
    "generate after a failed push": lambda: engine.generate(["1+2="], config.sampling),
}
for what, attempt in attempts.items():
    try:
        attempt()
    except (ConfigError, ValueError, EngineNotReady) as err:
        print(f"{what}:\n    {type(err).__name__}: {err}")
engine.load_weights(state, 5)
try:
    engine.load_weights(state, 4)
except VersionMismatchError as err:
    print(f"an older version:\n    {type(err).__name__}: {err}")

# %% [markdown]
# And on two ranks: a batch of 3 prompts does not divide over 2 ranks, and every rank refuses
# it and exits before loading anything (rank 0's message is the one printed: the others'
# standard error goes to /dev/null) (full mode; `tests/test_chapter04.py` runs it in CI, with
# a LoRA target that matches nothing, a misnamed or missing tensor and an older version on
# every rank in `tests/test_parallel_torchrun.py`).

# %%
if not SMOKE:
    job = torchrun(CHAPTER, 2, ["--out", RUNS / "04_bad", "--prompts-per-step", "3"], timeout=300)
    print(f"exit status {job.returncode}")
    print("\n".join(line for line in job.stdout.splitlines() if "error:" in line))

# %% [markdown]
# ## 9. What to remember
#
# | question | answer |
# |---|---|
# | multi-controller (SPMD) | every rank runs the same loop on its share of the prompts; they meet only in collectives |
# | what must be global | `dapo`'s token count (weight W·T_r/T), a batch reward std, the logged batch statistics; and every rank must make the same forward passes (pad to the widest completion) |
# | ZeRO per rank, measured | DDP 16 B/param, ZeRO-3 16/N; ZeRO-1 by whole tensors; FSDP2's ZeRO-2 reshards after backward; the source's ~4× and ~8× are its own formula's limits for many GPUs in mixed precision, far from two FP32 ranks (section 7's table) |
# | weight sync from shards | gather one layer (or one bucket of layers, packed) at a time (peak ≈ one layer unpacked, about twice the bucket packed; section 7 prints the run's), merge LoRA or ship the adapter, stream into the engine, check the version and (optionally) every tensor |
# | the 5 % rule | on CPUs and gloo a collective's fixed cost dominates: pack whole layers into one all-gather per bucket (the chapter's defaults before and after: section 7's table); adapter-only moves only A and B (section 7 prints whether that was also faster than merged here); `--sync-every K` divides the share by up to about K, for batches up to K-1 updates stale (what that cost the learning: section 7) |
# | colocation | the engine releases its weights during the update (vLLM sleep level 2 here) and takes them back at the sync; with adapter-only sync the base must stay |
# | exact resume | DCP shards + per-rank RNG and generators; a killed rank costs the steps since the last checkpoint, never the run; a broken newest checkpoint is named and the one before it used |
# | a job that stops | every rank knows every rank's host and pid; one rank says in one line who died (or Ctrl-C), the last intact checkpoint and the resume command; the others stay quiet |
#
# On a GPU machine the same chapter runs with `--device cuda` (NCCL), `--rollout-engine vllm`,
# `--mixed-precision bf16`, `--cpu-offload` and any Hugging Face causal LM (`--model`):
#
# ```
# torchrun --nproc_per_node 8 chapters/04_fsdp_lora.py --model Qwen/Qwen2.5-0.5B --device cuda \
#     --zero 3 --lora-rank 16 --rollout-engine vllm --mixed-precision bf16 --out runs/04-qwen
# ```

# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/04_fsdp_lora.py`. Fill them in, then grade:
#
# ```
# python -m minirl.grade --only 04
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 4.1 | `reduce_metrics` | the ranks' records as one: token-weighted means, global min and max, rank 0's gradient norm, the weighted loss |
# | 4.2 | `gather_by_layer` | one list per layer, whole tensors, gathered only when asked for, no layer kept alive |
# | 4.3 | `merge_lora` | W + (α/r) B A against peft's `merge_and_unload`; a new tensor in the base's dtype, computed in FP32 |
#
# Questions to think about (not graded): why does `bnpo` give a different gradient on two
# ranks than on one, and which of `dapo` and `bnpo` would you choose for a job whose ranks
# see very different completion lengths? With adapter-only sync the engine computes B A x at
# every generated token: when does that cost more than the sync it saves?
