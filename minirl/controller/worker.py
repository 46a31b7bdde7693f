# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The Worker: one Ray actor per device, with its rank, a torch.distributed world, and a timeline.

Simplified vs veRL's `Worker`: rank and world size are arguments, not environment variables;
one torch.distributed world for all workers, with named subgroups (`new_groups`).
"""

__all__ = ["Worker"]

import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from minirl.runtime.ray_calls import WorkerInfo


class Worker(WorkerInfo):
    """Base of every worker process: its place in its group, the world it joined, its timeline
    (`where()` and `free_address()`, where rank 0 meets the others: runtime/ray_calls.py)."""

    def __init__(self, group: str, rank: int, size: int, device: str = "cpu", threads: int = 1):
        self.group, self.rank, self.size, self.device = group, rank, size, device
        self.world_rank, self.groups, self.events = None, {}, []
        if threads:
            torch.set_num_threads(threads)

    def init_world(self, init_method: str, world_rank: int, world_size: int, backend: str,
                   timeout_s: float = 120.0) -> int:
        """Join the world of all workers (every member calls this at the same time)."""
        dist.init_process_group(backend, init_method=init_method, rank=world_rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.world_rank = world_rank
        return world_rank

    def new_groups(self, groups: dict[str, list[int]]) -> list[str]:
        """Create every named subgroup (world ranks), in order; keep those this worker belongs to."""
        for name, ranks in groups.items():
            group = dist.new_group(ranks)
            if self.world_rank in ranks:
                self.groups[name] = group
        return sorted(self.groups)

    @contextmanager
    def record(self, what: str):
        """Add (what, start, end) to the timeline, wall clock."""
        start = time.time()
        try:
            yield
        finally:
            self.events.append((what, start, time.time()))

    def timeline(self, clear: bool = False) -> list[tuple[str, float, float]]:
        """The recorded calls by start time (a call inside another comes after it)."""
        events = sorted(self.events, key=lambda event: event[1])
        if clear:
            self.events.clear()
        return events
