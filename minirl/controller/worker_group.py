# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""WorkerGroup: the workers of one pool, and the dispatch modes that fan a call out to them.

A dispatch mode is a pair of plain functions: `dispatch(n, *args)` turns one call's
arguments into one argument tuple per rank (None: that rank sits out) and `collect(results)`
turns the called ranks' results, in rank order, into the call's result. `ONE_TO_ALL`,
`DP_COMPUTE` (split a batch by data-parallel rank, concatenate the results), `DP_UPDATE`
(split; rank 0's result: a data-parallel update returns the same record on every rank) and
`RANK_ZERO` cover the RL loop. `WorkerGroup.execute(mode, role,
method, *args)` runs `role.method` on the ranks the mode picks; `gather` waits for the calls
and reports the first failure as soon as it happens: a dead worker as a `WorkerDiedError`
naming its roles, group and rank; an exception raised in a worker as itself, with a note
saying where it was raised.

Simplified vs veRL: no decorator that registers modes on worker methods and generates the
group's methods; the role and method are named in the call.
"""

__all__ = ["Mode", "one_to_all", "rank_zero", "split_by_rank", "as_list", "concat", "first",
           "ONE_TO_ALL", "DP_COMPUTE", "DP_UPDATE", "RANK_ZERO", "WorkerDiedError", "DEATHS",
           "died", "WorkerGroup", "gather"]

from dataclasses import dataclass
from typing import Callable

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minirl.controller.resource_pool import ResourcePool
from minirl.data import Batch


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
    if isinstance(batch, Batch) or hasattr(batch, "group_size"):   # a Batch, whichever copy of minirl.data
        parts = batch.split(n)
    else:
        if n < 1 or len(batch) % n:
            raise ValueError(f"split_by_rank: {len(batch)} items do not split into {n} equal parts; "
                             f"use a number of ranks that divides {len(batch)}")
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


class WorkerDiedError(RuntimeError):
    """A worker of the run died (killed, crashed, out of memory, its node lost); the message names its roles,
    its group, its rank and its node. `what` is that first part alone (the chapters' one stop line)."""

    def __init__(self, what: str, advice: str = "the run stops here: resume it from its last checkpoint"):
        super().__init__(f"{what}; {advice}")
        self.what = what


# what Ray raises when the process behind a call is gone: killed, crashed, its node lost, or killed by Ray's
# memory monitor (OutOfMemoryError); each becomes a WorkerDiedError naming the worker
DEATHS = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, ray.exceptions.WorkerCrashedError,
          ray.exceptions.NodeDiedError, ray.exceptions.LocalRayletDiedError)


def died(who: str, what: str, err: BaseException) -> WorkerDiedError:
    """The WorkerDiedError for `who` (a worker's description) failing with Ray's `err` during `what`."""
    oom = isinstance(err, ray.exceptions.OutOfMemoryError) or "memory monitor" in str(err)
    lines = str(err).strip().splitlines() or [type(err).__name__]
    reason = ("killed by Ray's memory monitor: the node ran out of memory; give the role fewer or smaller "
              "workers, or more memory" if oom else lines[0][:200])
    return WorkerDiedError(f"{who} died during {what} ({reason})")


class WorkerGroup:
    """One worker (a Ray actor of class `worker_cls`) per device of `pool`, rank 0 .. size-1."""

    def __init__(self, name: str, pool: ResourcePool, placement_groups: list, roles: list[str], worker_cls,
                 prefix: str = "", nodes: list[int] | None = None, **worker_kwargs):
        self.name, self.pool, self.roles = name, pool, list(roles)
        self.nodes = nodes or [0] * len(placement_groups)    # node index of each placement group (for messages)
        self.world_ranks, self.dead, self.death = [], None, None    # dead: a rank; death: its WorkerDiedError
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
        """Call worker method `method` on every rank whose arguments are not None; their results, by rank."""
        calls = [(self, rank, getattr(worker, method).remote(*args, **kwargs))
                 for rank, (worker, args) in enumerate(zip(self.workers, per_rank_args, strict=True))
                 if args is not None]
        first = next((args for args in per_rank_args if args is not None), ())
        return gather(calls, f"{first[0]}.{first[1]}" if method == "call" and len(first) > 1 else method)

    def execute(self, mode: Mode, role: str, method: str, *args, **kwargs):
        """`role.method(...)` on the ranks `mode` picks, arguments split and results collected by `mode`."""
        per_rank = mode.dispatch(len(self.workers), *args)
        calls = [(self, rank, self.workers[rank].call.remote(role, method, *a, **kwargs))
                 for rank, a in enumerate(per_rank) if a is not None]
        return mode.collect(gather(calls, f"{role}.{method}"))

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


def gather(calls: list[tuple["WorkerGroup", int, ray.ObjectRef]], what: str) -> list:
    """The results of (group, rank, ref) calls in the order given; the first failure raises when it happens.

    Every `ray.get` on a worker goes through here: a dead worker (DEATHS) raises a
    WorkerDiedError naming its roles, rank and node; an exception raised in a worker raises
    as itself, with a note saying where.
    """
    index = {ref: i for i, (_, _, ref) in enumerate(calls)}
    results, pending = [None] * len(calls), list(index)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i = index[done[0]]
        group, rank, _ = calls[i]
        try:
            results[i] = ray.get(done[0])
        except DEATHS as err:
            group.dead, group.death = rank, died(group.describe(rank), what, err)
            raise group.death from None
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            if isinstance(cause, DEATHS):                  # a worker that died while this one waited on it
                group.dead, group.death = rank, died(group.describe(rank), what, cause)
                raise group.death from None
            cause.add_note(f"(raised in {group.describe(rank)} during {what})")
            raise cause from None
    return results
