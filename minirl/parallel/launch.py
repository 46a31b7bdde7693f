# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Joining a data-parallel job (a process per device under torchrun), and the step's collectives.

Simplified vs torchrun + accelerate: one node, one flat process group, no elastic restarts.
"""

__all__ = ["DistContext", "init_distributed", "shutdown", "ProcessGroup", "rank_slice"]

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from minirl.runtime.ranks import pick_backend, world_from_env
from minirl.runtime.validate import ConfigError


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


def init_distributed(backend: str = "auto", device: str = "cpu", timeout_s: float = 900.0
                     ) -> DistContext:
    """Join the job's process group; returns this rank's context. Without torchrun: a group of one
    through a file store, so the same FSDP2 and DTensor code runs."""
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
    """Leave the job: with together=True a barrier first; after an error only this rank met, none
    (its peers may be inside another collective: a barrier there would wait forever)."""
    if dist.is_initialized():
        try:
            if together:
                dist.barrier()
        finally:
            dist.destroy_process_group()


class ProcessGroup:
    """A process group as the step and the roles use it (rl_step's `group`). Tensors travel on
    `device` (NCCL moves only GPU memory); group: a subgroup (notebook 06), None: the world."""

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
        """The elementwise sum over ranks of `values` (numbers or a tensor), float64 on the CPU."""
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
    """Rank `rank`'s contiguous slice of a global batch: whole prompts, as many as every rank's."""
    if len(items) % world_size:
        raise ConfigError("prompts_per_step", len(items),
                          f"{len(items)} prompts do not divide over {world_size} ranks; "
                          f"use a multiple of {world_size}")
    k = len(items) // world_size
    return items[rank * k:(rank + 1) * k]
