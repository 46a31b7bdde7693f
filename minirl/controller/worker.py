# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The Worker: one Ray actor per device, with its rank, a torch.distributed world, and a timeline.

A `Worker` is created by its `WorkerGroup` with its group's name, its rank in the group,
the group's size and its device. The driver then joins all workers into one
torch.distributed world (`init_world`: gloo between CPU processes, NCCL between GPUs) and
creates the named subgroups they need (`new_groups`): each group's data-parallel ranks,
and the trainer-to-rollout group of the weight sync. Every call is recorded in the worker's
timeline (`record`): what ran, from when to when, in wall-clock seconds, so the driver can
draw which role was busy when on every worker.

Simplified vs veRL's `Worker`: rank and world size are arguments, not environment
variables; one world for all workers instead of a store per group; timeline clocks are
each node's wall clock (synchronized by NTP on a real cluster, equal here).
"""

__all__ = ["Worker"]

import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import ray
import torch
import torch.distributed as dist


class Worker:
    """Base of every worker process: its place in its group, the world it joined, its timeline."""

    def __init__(self, group: str, rank: int, size: int, device: str = "cpu", threads: int = 1):
        self.group, self.rank, self.size, self.device = group, rank, size, device
        self.world_rank, self.groups, self.events = None, {}, []
        if threads:
            torch.set_num_threads(threads)

    def where(self) -> dict:
        """Where this worker runs: its group, rank, node, device and process id."""
        gpus = ray.get_gpu_ids()
        return {"group": self.group, "rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "device": f"gpu{gpus[0]}" if gpus else "cpu", "pid": os.getpid()}

    def free_address(self) -> str:
        """tcp://ip:port with a port free on this node: where the world's rank 0 meets the others."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def init_world(self, init_method: str, world_rank: int, world_size: int, backend: str,
                   timeout_s: float = 120.0) -> int:
        """Join the world of all workers (every member calls this at the same time)."""
        dist.init_process_group(backend, init_method=init_method, rank=world_rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.world_rank = world_rank
        return world_rank

    def new_groups(self, groups: dict[str, list[int]]) -> list[str]:
        """Create every named subgroup (world ranks), in order; keep those this worker belongs to.

        Every member of the world must call this with the same `groups`: torch.distributed
        creates a group collectively, even for the processes outside it.
        """
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
        """The recorded calls by start time (a call inside another, a sleep inside generate, comes after it)."""
        events = sorted(self.events, key=lambda event: event[1])
        if clear:
            self.events.clear()
        return events

    def ping(self) -> bool:
        return True
