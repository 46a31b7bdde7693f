# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""WorkerGroup: the workers of one pool, and the dispatch modes that fan a call out to them.

A `Mode` is two plain functions: `dispatch(n, *args)` -> one argument tuple per rank (None:
that rank sits out), `collect(results)` -> the call's result. Every wait goes through
`minirl.runtime.ray_calls.gather`, which names a worker that died. Simplified vs veRL: no
decorator that registers modes on worker methods; the role and method are named in the call.
"""

__all__ = ["Mode", "one_to_all", "rank_zero", "split_by_rank", "as_list", "concat", "first",
           "ONE_TO_ALL", "DP_COMPUTE", "DP_UPDATE", "RANK_ZERO", "WorkerGroup"]

from dataclasses import dataclass
from typing import Callable

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minirl.controller.resource_pool import ResourcePool
from minirl.data import Batch
from minirl.runtime.ray_calls import gather


@dataclass(frozen=True)
class Mode:
    """How one call goes out to the ranks of a group and how its results come back."""

    dispatch: Callable   # (n, *args) -> [argument tuple or None (the rank sits out)] * n
    collect: Callable    # [result of each called rank, by rank] -> the call's result


def one_to_all(n: int, *args) -> list[tuple]:
    """Every rank gets the same arguments."""
    return [args] * n


def rank_zero(n: int, *args) -> list[tuple | None]:
    """Rank 0 gets the arguments; the other ranks are not called."""
    return [args] + [None] * (n - 1)


def split_by_rank(n: int, batch, *args) -> list[tuple]:
    """Rank r gets (part r of `batch`, *args): n contiguous parts of equal size, in order.

    batch: a `Batch` (Rollout, Experience), whose parts must be whole groups of
    `batch.group_size` rows (use its `split(n)`), or a list (a list of prompts), split into n
    contiguous slices of len(batch) // n items. Concatenating the parts in rank order gives
    the batch back. Raises ValueError naming n and the batch's length when the batch does not
    split into n equal parts (of whole groups).
    """
    if isinstance(batch, Batch) or hasattr(batch, "group_size"):   # any copy of minirl.data's Batch
        parts = batch.split(n)
    else:
        if n < 1 or len(batch) % n:
            raise ValueError(f"split_by_rank: {len(batch)} items do not split into {n} equal "
                             f"parts; use a number of ranks that divides {len(batch)}")
        size = len(batch) // n
        parts = [batch[r * size:(r + 1) * size] for r in range(n)]
    return [(part, *args) for part in parts]


def as_list(results: list) -> list:
    return list(results)


def concat(results: list):
    """The ranks' parts, back in one piece: Batch.concat, torch.cat, or a joined list."""
    if isinstance(results[0], Batch):
        return Batch.concat(results)
    if isinstance(results[0], torch.Tensor):
        return torch.cat(results)
    return [x for part in results for x in part]


def first(results: list):
    return results[0]


ONE_TO_ALL = Mode(one_to_all, as_list)
DP_COMPUTE = Mode(split_by_rank, concat)
DP_UPDATE = Mode(split_by_rank, first)       # every rank returns the same record
RANK_ZERO = Mode(rank_zero, first)


class WorkerGroup:
    """One worker (a Ray actor of class `worker_cls`) per device of `pool`, rank 0 .. size-1."""

    def __init__(self, name: str, pool: ResourcePool, placement_groups: list, roles: list[str],
                 worker_cls, prefix: str = "", nodes: list[int] | None = None, **worker_kwargs):
        self.name, self.pool, self.roles = name, pool, list(roles)
        self.nodes = nodes or [0] * len(placement_groups)    # node index of each placement group
        self.world_ranks, self.dead, self.death = [], None, None    # dead: a rank; death: its error
        remote = ray.remote(worker_cls)
        bundle = pool.bundle()
        slots = [(pg, i, node) for pg, node in zip(placement_groups, self.nodes, strict=True)
                 for i in range(pg.bundle_count)]
        self.node_of = [node for _, _, node in slots]
        self.workers = [
            remote.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=0,
                           name=f"{prefix}{name}-{rank}" if prefix else None,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index))
            .remote(name, rank, len(slots), pool.device, **worker_kwargs)
            for rank, (pg, index, _) in enumerate(slots)]

    def __len__(self) -> int:
        return len(self.workers)

    def describe(self, rank: int) -> str:
        return f"{'+'.join(self.roles)} worker {self.name}[rank {rank}] on node{self.node_of[rank]}"

    def run(self, method: str, per_rank_args: list[tuple | None], **kwargs) -> list:
        """Worker method `method` on every rank whose arguments are not None; results by rank."""
        pairs = enumerate(zip(self.workers, per_rank_args, strict=True))
        calls = [(self, rank, getattr(worker, method).remote(*args, **kwargs))
                 for rank, (worker, args) in pairs if args is not None]
        first = next((args for args in per_rank_args if args is not None), ())
        what = f"{first[0]}.{first[1]}" if method == "call" and len(first) > 1 else method
        return gather(calls, what)

    def execute(self, mode: Mode, role: str, method: str, *args, **kwargs):
        """`role.method(...)` on the ranks `mode` picks; `mode` splits the arguments, collects."""
        per_rank = mode.dispatch(len(self.workers), *args)
        calls = [(self, rank, self.workers[rank].call.remote(role, method, *a, **kwargs))
                 for rank, a in enumerate(per_rank) if a is not None]
        return mode.collect(gather(calls, f"{role}.{method}"))

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
