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
# # 06 · One driver, many workers: the single controller on Ray
#
# **By the end of this notebook you can** place the five roles of the RL loop (actor,
# rollout, critic, reference, reward) on pools of devices across the nodes of a Ray cluster,
# run stage 1's very step on them from one driver process, and move the weights between them.
#
# The source asks *how models are placed on GPUs*. veRL (HybridFlow) answers with a
# **ResourcePool** (a group of devices), a **Worker** (one model instance on one device) and a
# **Driver**, the single controller that runs the algorithm. Roles share a pool and take turns
# (**colocated**) or get devices of their own (**disaggregated**). We build each piece (§1-§7),
# check the algorithm is the same in every placement (§8), and reproduce the source's rows 1,
# 7 and 8. Ray's test cluster runs two "nodes" here; a device is a quarter-CPU slot.

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import os
import time
from pathlib import Path

import matplotlib.pyplot as plt
import ray
import torch
from tqdm.auto import tqdm

from minirl.models.policy import load_default_policy
from minirl.runtime.notebook import add_to_class
from minirl.tasks.arithmetic import make_task
from minirl.tasks.task import arithmetic_task

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()   # the repository
RUNS = ROOT / "runs"
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny policy gains nothing from more threads
model, tokenizer, policy_path = load_default_policy()
task = make_task()
rewards = arithmetic_task().reward_funcs   # the reward stage 1's train() uses, under the same name
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # Ray's workers inherit this environment

# %% [markdown]
# ## The whole loop first
#
# Two GRPO steps from a `Driver` whose one worker holds every role (colocated), beside the same
# two steps in one process (stage 1's `train`). Starting Ray on a busy machine lives in
# `minirl/runtime/ray_start.py`; we only call it.

# %%
from minirl.config import RLConfig
from minirl.controller.driver import Driver
from minirl.controller.placement import make_placement
from minirl.runtime.ray_start import local_cluster
from minirl.train.run import train

started = time.perf_counter()
cluster = local_cluster(num_nodes=2, cpus_per_node=2)        # two Ray nodes on this machine
ray.init(address=cluster.address, log_to_driver=False)
print(f"cluster up after {time.perf_counter() - started:.0f} s", flush=True)
first_look = RLConfig.from_flat(steps=2, prompts_per_step=8, num_generations=8, eval_every=0)
alone = train(first_look, load_default_policy(progress=False)[0], tokenizer)
with Driver(first_look, make_placement("colocated"), load_default_policy(progress=False)[0],
            tokenizer, rewards) as driver:
    on_ray = driver.train(task.rows("train"))
    print("roles -> devices:", driver.where())
for a, b in zip(alone, on_ray, strict=True):
    print(f"step {a['step']}: reward {a['reward']:.4f} in one process, {b['reward']:.4f} "
          f"from the Driver; loss {a['loss']:+.5f} / {b['loss']:+.5f}")

# %% [markdown]
# ## 1. Resource pools: which devices, on which nodes
#
# A pool says how many devices its roles need on each node it spans: `ResourcePool([2])` is
# two devices on one node, `ResourcePool([1, 1])` one on each of two nodes; a device is a GPU
# or a slot of `cpus_per_device` CPUs. Before any process starts the driver **plans** (each
# pool entry to a node, first fit) and only then **reserves** a Ray placement group per entry,
# one bundle per device, on the planned node (`minirl/runtime/reservations.py`; we call it).

# %%
# | export minirl/controller/resource_pool.py
"""Resource pools: devices on nodes, planned first (`plan_placement`), then reserved (`reserve`).

Simplified vs veRL's `RayResourcePool`: veRL lets Ray choose each placement group's node; we
choose it (first fit over the nodes' total resources) and pin the group there, so the plan we
print is the placement that happens. Reserving it in Ray: `minirl.runtime.reservations`.
"""

from minirl.runtime.placement_checks import check_pool


class PlacementError(ValueError):
    """A placement the cluster cannot hold; the message names the pool and the numbers."""


class ResourcePool:
    """Devices on one or more nodes, for the roles placed on this pool."""

    def __init__(self, devices_per_node: list[int], device: str = "cpu",
                 cpus_per_device: float = 0.25):
        check_pool(devices_per_node, device, cpus_per_device)      # a ConfigError names a bad one
        self.devices_per_node = list(devices_per_node)
        self.device, self.cpus_per_device = device, cpus_per_device

    @property
    def size(self) -> int:
        """Devices in all: the number of workers (ranks) the pool holds."""
        return sum(self.devices_per_node)

    def bundle(self) -> dict[str, float]:
        """What one device reserves: {"CPU": c} or {"CPU": c, "GPU": 1}."""
        return {"CPU": self.cpus_per_device, **({"GPU": 1.0} if self.device == "gpu" else {})}

    def __repr__(self) -> str:
        return (f"ResourcePool({self.devices_per_node}, {self.device!r}, "
                f"cpus_per_device={self.cpus_per_device:g})")


def _fmt(resources: dict) -> str:
    return " ".join(f"{k} {v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))

# %% [markdown]
# The plan is a first-fit assignment (exercise 6.1): each entry of a pool lands on a node the
# pool does not use yet and that still has room after the pools placed before it.

# %%
# | export minirl/controller/resource_pool.py
def plan_placement(pools: dict[str, ResourcePool], nodes: list[dict]) -> dict[str, list[int]]:
    """A node for every entry of every pool: {pool name: [node of each devices_per_node entry]}.

    nodes: each node's total resources, e.g. [{"CPU": 2.0, "GPU": 0.0}, ...] (other keys are
    ignored), in cluster order; node i is `nodes[i]`. First fit, pools in the order of `pools`
    and entries in the order of `devices_per_node`: an entry of k devices goes to the first
    node that (a) this pool does not use yet and (b) still holds k of the pool's bundles
    after everything placed before it, for every resource r of `pool.bundle()`:
    k * bundle[r] <= what is left of r on the node, with a tolerance of 1e-9 (fractional CPUs).
    The chosen node's resources shrink by k * bundle. Raises PlacementError naming the pool,
    the entry's demand and what every node has left when no node fits.
    """
    # BEGIN SOLUTION
    left = [{r: float(node.get(r, 0.0)) for r in ("CPU", "GPU")} for node in nodes]
    plan = {}
    for name, pool in pools.items():
        used = []
        for k, count in enumerate(pool.devices_per_node):
            need = {r: count * amount for r, amount in pool.bundle().items()}
            fits = [i for i, free in enumerate(left) if i not in used
                    and all(free[r] >= amount - 1e-9 for r, amount in need.items())]
            if not fits:
                raise PlacementError(
                    f"pool {name!r} (devices_per_node={pool.devices_per_node}) needs {count} "
                    f"device(s) = {_fmt(need)} on a node of its own for entry {k}, but no node has "
                    "that left: " + ", ".join(f"node{i} has {_fmt(free)}"
                                              + (" (used by this pool)" if i in used else "")
                                              for i, free in enumerate(left))
                    + f" ({len(nodes)} node(s) in the cluster)")
            node = fits[0]
            for r, amount in need.items():
                left[node][r] -= amount
            used.append(node)
        plan[name] = used
    return plan
    # END SOLUTION

# %% [markdown]
# Three pools planned on a cluster that exists only on paper (two nodes of 8 GPUs), then on
# the two Ray nodes started above; a request too large (17 GPUs) fails before anything starts.

# %%
from minirl.controller.resource_pool import PlacementError, ResourcePool, plan_placement
from minirl.runtime.ray_start import cluster_nodes

paper = [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}]
pools = {"train": ResourcePool([4, 4], "gpu", 8), "rollout": ResourcePool([4], "gpu", 8),
         "reward": ResourcePool([1], "cpu", 4)}
print("on paper (2 x 8 GPUs):", plan_placement(pools, paper))
here = cluster_nodes()
print("here:", [{k: v for k, v in n.items() if k != "node_id"} for n in here])
print("here:", plan_placement({"train": ResourcePool([1, 1]), "rollout": ResourcePool([2])}, here))
try:
    plan_placement({"train": ResourcePool([8, 8], "gpu"), "rollout": ResourcePool([1], "gpu")},
                   paper)
    raise AssertionError("17 GPUs on a 16-GPU cluster should not fit")
except PlacementError as err:
    print("PlacementError:", err)

# %% [markdown]
# ## 2. The Worker: a Ray actor that knows its rank
#
# A worker is one process on one device, with its rank and world size. It joins a
# **torch.distributed world** with the others (gloo on CPUs, NCCL on GPUs), through which the
# actor's ranks average gradients and the trainer broadcasts weights, and keeps a **timeline**.

# %%
# | export minirl/controller/worker.py
"""The Worker: one Ray actor per device, with its rank, a torch.distributed world, and a timeline.

Simplified vs veRL's `Worker`: rank and world size are arguments, not environment variables;
one torch.distributed world for all workers, with named subgroups (`new_groups`).
"""

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

# %%
# | export minirl/controller/worker.py
@add_to_class(Worker)
def init_world(self, init_method: str, world_rank: int, world_size: int, backend: str,
               timeout_s: float = 120.0) -> int:
    """Join the world of all workers (every member calls this at the same time)."""
    dist.init_process_group(backend, init_method=init_method, rank=world_rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    self.world_rank = world_rank
    return world_rank


@add_to_class(Worker)
def new_groups(self, groups: dict[str, list[int]]) -> list[str]:
    """Create every named subgroup (world ranks), in order; keep those this worker belongs to."""
    for name, ranks in groups.items():
        group = dist.new_group(ranks)
        if self.world_rank in ranks:
            self.groups[name] = group
    return sorted(self.groups)


@add_to_class(Worker)
@contextmanager
def record(self, what: str):
    """Add (what, start, end) to the timeline, wall clock."""
    start = time.time()
    try:
        yield
    finally:
        self.events.append((what, start, time.time()))


@add_to_class(Worker)
def timeline(self, clear: bool = False) -> list[tuple[str, float, float]]:
    """The recorded calls by start time (a call inside another comes after it)."""
    events = sorted(self.events, key=lambda event: event[1])
    if clear:
        self.events.clear()
    return events

# %% [markdown]
# ## 3. A WorkerGroup and its dispatch modes
#
# A `WorkerGroup` is the workers of one pool, rank 0 to n − 1. The driver calls the group,
# never a worker, and a **dispatch mode** says how the call's arguments go out to the ranks
# and how their results come back. The RL loop needs four:
#
# | mode | arguments | result | used for |
# |---|---|---|---|
# | `ONE_TO_ALL` | the same to every rank | a list, by rank | set-up, loading weights |
# | `DP_COMPUTE` | a batch split in equal parts of whole groups | the parts concatenated | log-probs, values, generation |
# | `DP_UPDATE` | split the same way | rank 0's (the ranks reduce their metrics) | the actor's and critic's update |
# | `RANK_ZERO` | to rank 0 only | rank 0's result | weights and optimizer state |
#
# A mode is two plain functions, one to split the arguments and one to collect the results.
# Splitting is exercise 6.2: contiguous equal parts, a prompt's G completions never torn apart.

# %%
# | export minirl/controller/worker_group.py
"""WorkerGroup: the workers of one pool, and the dispatch modes that fan a call out to them.

A `Mode` is two plain functions: `dispatch(n, *args)` -> one argument tuple per rank (None:
that rank sits out), `collect(results)` -> the call's result. Every wait goes through
`minirl.runtime.ray_calls.gather`, which names a worker that died. Simplified vs veRL: no
decorator that registers modes on worker methods; the role and method are named in the call.
"""

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

# %%
# | export minirl/controller/worker_group.py
def split_by_rank(n: int, batch, *args) -> list[tuple]:
    """Rank r gets (part r of `batch`, *args): n contiguous parts of equal size, in order.

    batch: a `Batch` (Rollout, Experience), whose parts must be whole groups of
    `batch.group_size` rows (use its `split(n)`), or a list (a list of prompts), split into n
    contiguous slices of len(batch) // n items. Concatenating the parts in rank order gives
    the batch back. Raises ValueError naming n and the batch's length when the batch does not
    split into n equal parts (of whole groups).
    """
    # BEGIN SOLUTION
    if isinstance(batch, Batch) or hasattr(batch, "group_size"):   # any copy of minirl.data's Batch
        parts = batch.split(n)
    else:
        if n < 1 or len(batch) % n:
            raise ValueError(f"split_by_rank: {len(batch)} items do not split into {n} equal "
                             f"parts; use a number of ranks that divides {len(batch)}")
        size = len(batch) // n
        parts = [batch[r * size:(r + 1) * size] for r in range(n)]
    return [(part, *args) for part in parts]
    # END SOLUTION

# %%
# | export minirl/controller/worker_group.py
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

# %%
# | export minirl/controller/worker_group.py
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

# %% [markdown]
# Two plain workers, one on each node, joined in one gloo world: an all-reduce across the
# nodes, a dispatch in each mode, and the timeline each worker kept.

# %%
from minirl.controller.worker import Worker
from minirl.controller.worker_group import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO, WorkerGroup
from minirl.runtime.reservations import release, reserve


class SumWorker(Worker):
    """A worker with two methods to try the group with."""

    def call(self, role, method, *args):
        with self.record(method):
            if method == "all_reduce":
                t = torch.tensor([float(self.rank + 1)])
                torch.distributed.all_reduce(t)
                return t.item()
            if method == "echo":
                return [f"rank {self.rank} got {x}" for x in args[0]]
            return self.where()


pool = ResourcePool([1, 1])
plan = plan_placement({"demo": pool}, here)
pgs = reserve("demo", pool, [here[i]["node_id"] for i in plan["demo"]])
demo = WorkerGroup("demo", pool, pgs, ["demo"], SumWorker, nodes=plan["demo"])
address = ray.get(demo.workers[0].free_address.remote())
demo.run("init_world", [(address, rank, 2, "gloo") for rank in range(2)])
where = demo.execute(ONE_TO_ALL, "", "where")
print("where:", [(w["group"], w["rank"], w["node_id"][:8]) for w in where])
print("all-reduce of 1 + 2 across two nodes:", demo.execute(ONE_TO_ALL, "", "all_reduce"))
print("DP_COMPUTE, 4 prompts:", demo.execute(DP_COMPUTE, "", "echo", ["1+1", "2+2", "3+3", "4+4"]))
print("RANK_ZERO:", demo.execute(RANK_ZERO, "", "echo", ["only rank 0"]))
print("timeline of rank 1:", [(what, round(end - start, 4)) for what, start, end in
                              ray.get(demo.workers[1].timeline.remote())])
demo.shutdown()
release(pgs)

# %% [markdown]
# ## 4. The five roles as workers
#
# A `RoleWorker` hosts its pool's roles and answers `call(role, method, *args)` with stage 1's
# own objects, built as stage 1 builds them. It adds only **data parallelism** (on several
# ranks, notebook 04's DDP `DistributedActor` and `DistributedCritic`) and **colocation** (an
# engine beside the actor is notebook 04's `ColocatedEngine`, which frees its weights after
# generating). Its ends of the weight syncs are in `minirl/runtime/sync_ends.py`.

# %%
# | export minirl/controller/names.py
"""The names stage 6 chooses among: its roles, its placements, its weight syncs (no Ray, no torch:
chapters/06_ray.py checks its flags against them before anything heavy loads)."""
ROLES = ("actor", "rollout", "reward", "reference", "critic")


# %%
# | export minirl/controller/roles.py
"""The five roles of the RL loop as Ray workers: stage 1's own objects, built as stage 1 does.

A `RoleWorker` hosts the roles of its pool and answers `call(role, method, *args)`, so a change
of placement cannot change what is computed. Simplified: a data-parallel rank holds a full
replica (stage 4's DDP roles; no FSDP sharding inside a pool).
"""

import copy

import torch

from minirl.controller.names import ROLES
from minirl.controller.worker import Worker
from minirl.memory.wrap import wrap_model
from minirl.models.critic import ValueModel
from minirl.parallel.launch import ProcessGroup
from minirl.parallel.roles import DistributedActor, DistributedCritic
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.registry import build_engine
from minirl.runtime.callbacks import autocast_context
from minirl.runtime.object_store_sync import ObjectStoreEnds
from minirl.runtime.ray_calls import moved
from minirl.runtime.reward_extras import worker_rewards
from minirl.runtime.role_checkpoints import RestoringWorker
from minirl.runtime.seeding import seed_everything
from minirl.runtime.sync_ends import SyncEnds


class RewardRole:
    """The reward functions (TRL signature), where the reward worker runs."""

    def __init__(self, reward_funcs):
        self.funcs = list(reward_funcs)

    def score(self, index: int, prompts: list, completions: list, columns: dict) -> tuple[list, dict]:
        return worker_rewards(self.funcs[index], prompts, completions, columns)   # as TRL calls it; what it logged


def build_role(name: str, config, model, tokenizer, reward_funcs, group=None):
    """One role, as stage 1 builds it; with `group` (the pool's ranks): stage 4's DDP roles."""
    algo, opt, sampling = config.algorithm, config.optimizer, config.sampling
    if name == "actor":
        if group is None:
            return Actor(model, algo, opt, sampling)
        ddp = wrap_model(model, 0, group.device, process_group=group.group)
        return DistributedActor(ddp, algo, opt, sampling, group)
    if name == "critic":
        value = ValueModel.from_policy(model)
        if group is None:
            return Critic(value, algo, opt)
        ddp = wrap_model(value, 0, group.device, process_group=group.group)
        return DistributedCritic(ddp, algo, opt, group)
    if name == "reference":
        return Reference(model, sampling.temperature)
    if name == "rollout":
        return build_engine(config, model, tokenizer)
    if name == "reward":
        return RewardRole(reward_funcs)
    raise ValueError(f"role {name!r}: the roles are {', '.join(ROLES)}")

# %%
# | export minirl/controller/roles.py
class RoleWorker(Worker, ObjectStoreEnds, SyncEnds, RestoringWorker):
    """A worker that hosts roles of the RL loop; roles on one worker share its process and device.

    From minirl/runtime/: the ends of the syncs (object_store_sync.py: `put_weights`, `receive`;
    sync_ends.py: `send_weights`, `recv_weights`, `local_sync`) and `restore`."""

    def setup(self, roles: list[str], config, model, tokenizer, reward_funcs=()) -> dict[str, str]:
        seed_everything(config.run.seed)
        self.torch_device, self.config = torch.device(config.run.device), config
        model = copy.deepcopy(model).to(self.torch_device).eval()
        ranks = self.groups.get(f"dp:{self.group}") if self.size > 1 else None   # model pools
        group = ProcessGroup(self.torch_device, ranks) if ranks is not None else None
        order = ("reference", "critic", "actor", "rollout", "reward")   # copies before the actor
        self.roles = {name: build_role(name, config, model, tokenizer, reward_funcs, group)
                      for name in order if name in roles}
        if "actor" in self.roles and "rollout" in self.roles:              # colocated: take turns
            self.roles["rollout"] = ColocatedEngine(self.roles["rollout"], stream=False,
                                                    record=lambda w: self.record(f"rollout.{w}"))
        return {name: type(role).__name__ for name, role in self.roles.items()}

    def call(self, role: str, method: str, *args, **kwargs):
        """`self.roles[role].method(*args, **kwargs)`, recorded in the timeline as "role.method"
        (tensors `moved` to this worker's device, results back to the CPU), under the run's autocast."""
        with self.record(f"{role}.{method}"), autocast_context(self.config):
            result = getattr(self.roles[role], method)(*moved(args, self.torch_device), **kwargs)
            return moved(result, "cpu")

    def named_weights(self, role: str = "actor") -> list:
        """The role's weights by name, on the CPU (what the driver's copy and a checkpoint hold)."""
        with self.record(f"{role}.named_weights"):
            return [(name, t.detach().cpu()) for name, t in self.roles[role].named_weights()]

# %% [markdown]
# ## 5. Weight sync between actors
#
# Colocated workers copy in-process, as stage 1 did; rollout workers elsewhere need the weights
# to travel. Trainer rank 0 **broadcasts** to them over a torch.distributed group (NCCL in veRL
# and OpenRLHF; gloo here) in **buckets** both sides plan from the same names, shapes and
# dtypes, so only flat buffers move. Ray's object store (`minirl/runtime/object_store_sync.py`)
# is the comparison: no process group, but it serializes and copies.

# %%
# | export minirl/sync/broadcast.py
"""Bucketed broadcast of named tensors over a torch.distributed group: the wire of stage 6's sync.

Both ends plan the same buckets from the same metadata, so only flat buffers travel, one
`broadcast` per bucket. Simplified: the sender holds full tensors (an FSDP trainer gathers its
shards first, notebook 04); tensors travel in the trainer's dtype.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to rebuild one tensor from a flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_metadata(named_tensors) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in named_tensors]


def plan_buckets(metadata: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors in buckets of one dtype and at most `bucket_bytes` bytes (a larger tensor
    goes alone). Sender and receivers agree on the buckets without sending them."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1 (e.g. 32 << 20 for 32 MiB)")
    buckets, current, size = [], [], 0
    for meta in metadata:
        if current and (meta.dtype != current[0].dtype or size + meta.nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets

# %%
# | export minirl/sync/broadcast.py
def send_buckets(named: dict[str, Tensor], buckets: list[list[TensorMeta]], src: int,
                 group=None) -> int:
    """Broadcast every bucket from this process (global rank `src`); returns the bytes sent."""
    sent = 0
    for bucket in buckets:
        flat = torch.cat([named[meta.name].detach().reshape(-1) for meta in bucket])   # [numel]
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_buckets(buckets: list[list[TensorMeta]], src: int, group=None,
                 device="cpu") -> list[tuple[str, Tensor]]:
    """Every bucket broadcast by global rank `src`; the named tensors, as views of the buffers."""
    named = []
    for bucket in buckets:
        flat = torch.empty(sum(meta.numel for meta in bucket), dtype=bucket[0].dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        for meta, piece in zip(bucket, flat.split([meta.numel for meta in bucket]), strict=True):
            named.append((meta.name, piece.view(meta.shape)))
    return named

# %% [markdown]
# The wire at work: the policy's tensors in buckets, then two workers, one on each node, in one
# gloo world; rank 0 broadcasts the weights in 64 KiB buckets and rank 1 rebuilds every tensor.

# %%
from minirl.sync.broadcast import plan_buckets, recv_buckets, send_buckets, tensor_metadata

meta = tensor_metadata(model.named_parameters())
for limit in (32 << 20, 64 << 10):
    print(f"{len(meta)} tensors, {sum(m.nbytes for m in meta) / 2**20:.2f} MiB, buckets of at most "
          f"{limit / 2**10:g} KiB: {len(plan_buckets(meta, limit))} broadcasts")


class WireWorker(Worker):
    def send(self, named, buckets):
        with self.record("sync.send"):
            return send_buckets(named, buckets, src=0)

    def recv(self, buckets):
        with self.record("sync.recv"):
            return recv_buckets(buckets, src=0)


pgs = reserve("wire", pool, [here[i]["node_id"] for i in plan["demo"]])
wire = WorkerGroup("wire", pool, pgs, ["wire"], WireWorker, nodes=plan["demo"])
address = ray.get(wire.workers[0].free_address.remote())
wire.run("init_world", [(address, rank, 2, "gloo") for rank in range(2)])
named = {name: p.detach() for name, p in model.named_parameters()}
buckets = plan_buckets(tensor_metadata(named.items()), 64 << 10)
sender, receiver = wire.workers
sent, got = ray.get([sender.send.remote(named, buckets), receiver.recv.remote(buckets)])
same = all(torch.equal(named[name], tensor) for name, tensor in got)
print(f"{sent / 2**20:.2f} MiB in {len(buckets)} broadcasts; rank 1 holds every tensor: {same}")
wire.shutdown()
release(pgs)

# %% [markdown]
# On the driver's side a sync has stage 1's `push(named_weights, engine, version)`; for an
# actor on workers `named_weights` is a handle (section 7): the weights skip the driver.

# %%
# | export minirl/controller/weight_sync.py
"""Weight syncs between workers, behind stage 1's `push(named_weights, engine, version)`:
a bucketed broadcast, or (colocated) an in-process copy on every worker; the weights move
worker to worker, never through the driver (the object store: `runtime.object_store_sync`).
"""

import time

from minirl.runtime.ray_calls import gather
from minirl.sync.base import SyncReport, check_pushed
from minirl.sync.broadcast import plan_buckets


class CollectiveSync:
    """Bucketed broadcast from trainer rank 0 to every rollout worker over the "sync" group."""

    def __init__(self, actor_group, engine_group, bucket_bytes: int = 32 << 20):
        self.actor_group, self.engine_group = actor_group, engine_group
        metadata = actor_group.run("weight_metadata", [()] + [None] * (len(actor_group) - 1))[0]
        self.buckets = plan_buckets(metadata, bucket_bytes)
        self.tensors, self.bytes = len(metadata), sum(meta.nbytes for meta in metadata)
        self.src = actor_group.world_ranks[0]

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        rank0 = self.actor_group.workers[0]
        sender = (self.actor_group, 0, rank0.send_weights.remote(self.buckets, self.src))
        receivers = [(self.engine_group, r, w.recv_weights.remote(self.buckets, self.src, version))
                     for r, w in enumerate(self.engine_group.workers)]
        results = gather([sender, *receivers], "sync (broadcast)")
        engine.confirm(results[1:])
        check_pushed(engine, version)
        return SyncReport(version, self.tensors, self.bytes, time.perf_counter() - start)


class LocalSync:
    """Colocated: every worker copies its own actor's weights into its own engine, in-process."""

    def __init__(self, group):
        self.group = group

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        reports = self.group.run("local_sync", [(version,)] * len(self.group))
        engine.confirm([r.version for r in reports])
        check_pushed(engine, version)
        seconds = time.perf_counter() - start
        return SyncReport(version, reports[0].tensors, reports[0].bytes, seconds)

# %% [markdown]
# ## 6. Placement: which pool hosts each role
#
# A placement maps every role to a pool; roles on one pool share its workers and take turns on
# the device (veRL's fused workers). Three placements cover the source's designs (printed
# after the code; the per-role one with an actor pool that spans both nodes):
#
# | placement | pools | who shares a worker | weight sync |
# |---|---|---|---|
# | colocated | `shared` | all five roles | in-process copy on every worker |
# | disaggregated | `train`, `rollout` | actor + reference + critic; rollout + reward | broadcast or object store |
# | per-role | one per role | nobody: each role its own Ray actors (OpenRLHF) | broadcast or object store |

# %%
# | export minirl/controller/names.py
LAYOUTS = {
    "colocated": {role: "shared" for role in ROLES},
    "disaggregated": {"actor": "train", "reference": "train", "critic": "train",
                      "rollout": "rollout", "reward": "rollout"},
    "per-role": {role: role for role in ROLES},
}
PLACEMENTS = tuple(LAYOUTS)

# %%
# | export minirl/controller/placement.py
"""Placement: which pool hosts each role; three layouts (colocated, disaggregated, per-role).

Roles mapped to one pool share its workers; a placement is checked against a run's config
before any actor starts (`minirl.runtime.placement_checks`).
"""

from dataclasses import dataclass

from minirl.controller.names import LAYOUTS, ROLES
from minirl.controller.resource_pool import ResourcePool
from minirl.runtime.placement_checks import check_sizes


@dataclass
class Placement:
    """A pool for every role: `roles` maps role -> pool name, `pools` pool name -> ResourcePool."""

    name: str
    pools: dict[str, ResourcePool]
    roles: dict[str, str]

# %%
# | export minirl/controller/placement.py
def make_placement(kind: str, sizes: dict[str, list[int]] | None = None, device: str = "cpu",
                   cpus_per_device: float = 0.25) -> Placement:
    """The `kind` layout; `sizes`: {role: devices per node} (roles sharing a pool: one size)."""
    check_sizes(kind, sizes or {})      # a known layout; roles sharing a pool given one size
    layout, sizes = LAYOUTS[kind], dict(sizes or {})
    pools = {}
    for pool in dict.fromkeys(layout.values()):
        roles = [role for role in ROLES if layout[role] == pool]
        given = {role: sizes[role] for role in roles if role in sizes}
        pool_device = "cpu" if roles == ["reward"] else device
        pools[pool] = ResourcePool(next(iter(given.values()), [1]), pool_device, cpus_per_device)
    return Placement(kind, pools, dict(layout))

# %%
from minirl.controller.names import PLACEMENTS
from minirl.controller.placement import make_placement
from minirl.runtime.placement_checks import describe

for kind in PLACEMENTS:
    print(describe(make_placement(kind, {"actor": [1, 1]} if kind == "per-role" else None)))

# %% [markdown]
# ## 7. The Driver
#
# ### 7.1 The roles as the driver sees them
#
# Stage 1's `rl_step` takes `roles`, an `engine` and a `sync`. The driver hands it objects with
# those methods, each forwarding the call to the role's workers with a dispatch mode: the
# algorithm is written once and the proxies decide where it runs. `EngineGroup` gives rollout
# worker r the loop's generator after r seed draws, so one rollout worker samples as stage 1.

# %%
# | export minirl/controller/proxies.py
"""The roles as the driver sees them: stage 1's methods (Actor, Reference, Critic, RolloutEngine, a
reward function), each call forwarded to the WorkerGroup that hosts the role with a dispatch mode.
"""

import copy

import ray

from minirl.controller.worker_group import DP_COMPUTE, DP_UPDATE, split_by_rank
from minirl.data import Batch
from minirl.rollout.base import draw_seed
from minirl.runtime.reward_extras import joined_rewards, remote_rows
from minirl.runtime.role_checkpoints import CheckpointedRole
from minirl.runtime.sync_ends import RemoteWeights, one_version


class ActorGroup(CheckpointedRole):
    """The actor role on a WorkerGroup, with stage 1's Actor methods (its checkpoints:
    `CheckpointedRole`; `RemoteWeights`, a handle on rank 0's weights: runtime/sync_ends.py)."""

    role = "actor"

    def __init__(self, group, model):
        self.group, self._model, self._fresh = group, model, True

    @property
    def model(self):
        """The driver's copy of the policy, refreshed from rank 0 if the workers updated since."""
        if not self._fresh:
            self._model.load_state_dict(dict(RemoteWeights(self.group)))
            self._fresh = True
        return self._model

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "actor", "logprobs", rollout)

    def update(self, exp) -> dict:
        self._fresh = False
        return self.group.execute(DP_UPDATE, "actor", "update", exp)

    def named_weights(self) -> RemoteWeights:
        return RemoteWeights(self.group)

# %%
# | export minirl/controller/proxies.py
class ReferenceGroup:
    def __init__(self, group):
        self.group = group

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "reference", "logprobs", rollout)


class CriticGroup(CheckpointedRole):
    role = "critic"

    def __init__(self, group):
        self.group = group

    def values(self, rollout):
        return self.group.execute(DP_COMPUTE, "critic", "values", rollout)

    def update(self, exp) -> dict:
        return self.group.execute(DP_UPDATE, "critic", "update", exp)


class EngineGroup:
    """The rollout workers as one RolloutEngine: prompts split by rank, Rollouts concatenated."""

    def __init__(self, group):
        self.group, self.version = group, 0

    def generate(self, prompts, sampling, expected_version=None, generator=None):
        calls = []
        for (part,) in split_by_rank(len(self.group), list(prompts)):
            rng = copy.deepcopy(generator)
            calls.append(("rollout", "generate", part, sampling, expected_version, rng))
            draw_seed(generator)                  # the driver's generator moves on by that draw
        return Batch.concat(self.group.run("call", calls))

    def load_weights(self, named_tensors, version: int) -> None:
        ref = ray.put(list(named_tensors))
        self.confirm(self.group.run("receive", [(ref, version)] * len(self.group)))

    def confirm(self, versions: list[int]) -> None:
        """The versions the workers report after a sync: all equal, or VersionMismatchError."""
        self.version = one_version(self.group.name, versions)


class RemoteReward:
    """Reward function `index` of the reward workers, callable with TRL's signature."""

    def __init__(self, group, index: int, name: str):
        self.group, self.index, self.__name__ = group, index, name

    def __call__(self, prompts, completions, **columns) -> list[float]:
        N, n = len(completions), len(self.group)
        bounds = [(r * N // n, (r + 1) * N // n) for r in range(n)]      # contiguous, near equal
        calls = [("reward", "score", self.index, prompts[a:b], completions[a:b],
                  remote_rows(columns, a, b)) if b > a else None for a, b in bounds]   # TRL's extras too
        return joined_rewards(self.group.run("call", calls), columns)    # in order; their log_metric calls here

# %% [markdown]
# ### 7.2 The Driver
#
# The Driver checks the placement (`minirl/runtime/placement_checks.py`) and plans it before
# it reserves devices and starts workers. It joins the model workers in one torch.distributed
# world (a data-parallel group per pool, a sync group of trainer rank 0 and the rollout workers).

# %%
# | export minirl/controller/names.py
SYNCS = ("collective", "object_store")   # a bucketed broadcast, or Ray's object store

# %%
# | export minirl/controller/driver.py
"""The Driver: one process runs stage 1's step on role proxies backed by WorkerGroups.

Simplified vs veRL's RayPPOTrainer: batches pass through the driver (veRL too, as futures of
`DataProto`); no tensor or pipeline parallelism inside a role; one world for all workers.
"""

import uuid

import ray

from minirl.controller.placement import Placement
from minirl.controller.proxies import ActorGroup, CriticGroup, EngineGroup, ReferenceGroup, RemoteReward
from minirl.controller.roles import RoleWorker
from minirl.controller.weight_sync import CollectiveSync, LocalSync
from minirl.controller.worker_group import WorkerGroup
from minirl.runtime.driver_run import DriverLifecycle, stop_if_a_worker_died, train_on_driver
from minirl.runtime.object_store_sync import ObjectStoreSync
from minirl.runtime.placement_checks import check_driver_args, check_placement, plan_or_explain
from minirl.runtime.ray_calls import gather
from minirl.runtime.ray_start import cluster_nodes
from minirl.runtime.reservations import reserve
from minirl.tasks.rewards import reward_name
from minirl.train.run import RunState, stage1_step
from minirl.train.step import Roles

MODEL_ROLES = ("actor", "critic", "reference", "rollout")      # their workers join the torch world
SOURCE_ORDER = ("sync", "generate", "score", "reference", "advantages", "update", "update_critic")


class DriverSetup(DriverLifecycle):
    """Pools, workers, the torch.distributed world, role proxies and a weight sync for one run.

    From `DriverLifecycle` (minirl/runtime/driver_run.py): `where()` and `timeline()` (what the
    workers report) and `shutdown()` (every worker and reservation gone; also at a `with`'s end)."""

    def __init__(self, config, placement: Placement, model, tokenizer, reward_funcs, *,
                 sync: str = "collective", bucket_bytes: int = 32 << 20, threads: int = 1,
                 name: str | None = None, reserve_timeout: float = 60.0,
                 reward_weights: list[float] | None = None):
        check_driver_args(sync, reward_funcs, reward_weights)
        self.config, self.placement, self.tokenizer = config, placement, tokenizer
        self.reward_weights = None if reward_weights is None else list(reward_weights)
        self.name = name or f"minirl-{uuid.uuid4().hex[:6]}"   # workers: "<name>/<pool>-<rank>"
        self.used = check_placement(placement, config)         # {pool: roles}, before any start
        self.nodes = cluster_nodes()
        pools = {pool: placement.pools[pool] for pool in self.used}
        self.plan = plan_or_explain(pools, self.nodes, placement, self.roles_needed())
        self.groups, self._reserved = {}, []
        try:
            for pool, roles in self.used.items():
                node_ids = [self.nodes[i]["node_id"] for i in self.plan[pool]]
                groups = reserve(pool, pools[pool], node_ids, reserve_timeout)
                self._reserved += groups
                self.groups[pool] = WorkerGroup(pool, pools[pool], groups, roles, RoleWorker,
                                                prefix=f"{self.name}/", nodes=self.plan[pool],
                                                threads=threads)
            self._join_world()
            self.model = model.to("cpu").eval()                    # the driver's copy of the policy
            shared = ray.put(self.model)
            gather([(g, r, w.setup.remote(g.roles, config, shared, tokenizer, reward_funcs))
                    for g in self.groups.values() for r, w in enumerate(g.workers)], "setup")
            self._build_proxies(reward_funcs, sync, bucket_bytes)
        except BaseException:
            self.shutdown()
            raise

    def roles_needed(self):
        return [role for roles in self.used.values() for role in roles]

    def group_of(self, role: str) -> WorkerGroup:
        return self.groups[self.placement.roles[role]]

# %%
# | export minirl/controller/driver.py
@add_to_class(DriverSetup)
def _join_world(self) -> None:
    members = [g for g in self.groups.values() if any(r in MODEL_ROLES for r in g.roles)]
    world = [(group, rank) for group in members for rank in range(len(group))]
    backend = "nccl" if all(g.pool.device == "gpu" for g in members) else "gloo"
    first = world[0][0]
    address = gather([(first, 0, first.workers[0].free_address.remote())], "free_address")[0]
    gather([(g, r, g.workers[r].init_world.remote(address, i, len(world), backend))
            for i, (g, r) in enumerate(world)], "init_world")
    for group in members:
        group.world_ranks = [i for i, (g, _) in enumerate(world) if g is group]
    subgroups = {f"dp:{group.name}": group.world_ranks for group in members}
    actor, rollout = self.group_of("actor"), self.group_of("rollout")
    if actor is not rollout:
        subgroups["sync"] = [actor.world_ranks[0], *rollout.world_ranks]
    gather([(g, r, g.workers[r].new_groups.remote(subgroups)) for g, r in world], "new_groups")


@add_to_class(DriverSetup)
def _build_proxies(self, reward_funcs, sync: str, bucket_bytes: int) -> None:
    needed = self.roles_needed()
    actor, rollout = self.group_of("actor"), self.group_of("rollout")
    reference = ReferenceGroup(self.group_of("reference")) if "reference" in needed else None
    critic = CriticGroup(self.group_of("critic")) if "critic" in needed else None
    self.roles = Roles(ActorGroup(actor, self.model), reference, critic)
    self.engine = EngineGroup(rollout)
    self.reward_funcs = [RemoteReward(self.group_of("reward"), i, reward_name(f))
                         for i, f in enumerate(reward_funcs)]      # the name stage 1's metrics use
    if actor is rollout:
        self.syncs = {"local": LocalSync(actor)}
    else:
        self.syncs = {"collective": CollectiveSync(actor, rollout, bucket_bytes),
                      "object_store": ObjectStoreSync(actor, rollout)}
    self.sync = self.syncs.get(sync, next(iter(self.syncs.values())))

# %% [markdown]
# The Driver's step is stage 1's `stage1_step` on the proxies, and its run stage 1's
# `run_in_dir` (run directory, resume, checkpoints: `minirl/runtime/driver_run.py`).

# %%
# | export minirl/controller/driver.py
class Driver(DriverSetup):
    """The single controller: stage 1's step and run on what DriverSetup built."""

    def step(self, state: RunState) -> dict:
        """Stage 1's step; a worker that died during it stops the run with a WorkerDiedError."""
        with stop_if_a_worker_died(self.groups.values(), state):
            return stage1_step(state)

    def train(self, rows: list[dict], **options) -> list[dict]:
        """Stage 1's `train` on the workers: config.run.steps steps, one record per step (options:
        out_dir, resume, eval_fn, ... as in `minirl.runtime.driver_run.train_on_driver`)."""
        return train_on_driver(self, rows, **options)

# %% [markdown]
# Bad input fails in the Driver's first checks, before any worker starts, naming the role, the
# pool and the numbers (a pool too large for the cluster fails in the plan, as in §1):

# %%
from minirl.runtime.validate import ConfigError

grpo = RLConfig.from_flat(steps=3 if SMOKE else 10, prompts_per_step=8, num_generations=8,
                          eval_every=0)
ppo = grpo.replace(algo="ppo", beta=0.04)
no_critic = make_placement("per-role")
del no_critic.roles["critic"]
for label, config, placement in [
        ("a role with no pool", ppo, no_critic),
        ("a batch that does not split", grpo.replace(prompts_per_step=6),
         make_placement("per-role", {"actor": [2, 2]}))]:
    try:
        Driver(config, placement, model, tokenizer, rewards)
        print(f"{label}: no error?!")
    except ConfigError as err:
        print(f"{label}: {type(err).__name__}: {err}\n")
print("workers alive after all that:", ray.util.list_named_actors())

# %% [markdown]
# The source's Driver loop is sync → sample → score → values → advantages → update actor →
# update critic; `rl_step` runs generate → … → update → sync: the same cycle cut one stage
# later. Exercise 6.3 re-cuts a run's records into the source's iterations.

# %%
# | export minirl/controller/driver.py
def driver_cycles(records: list[dict]) -> list[dict[str, float]]:
    """A run's per-step records re-cut into the source's Driver iterations, seconds in SOURCE_ORDER.

    Records (in step order) without "time/generate" (the step-0 evaluation) are skipped. Step
    k ends with the sync the source counts as the start of iteration k + 1: iteration k's
    "sync" is step k-1's "time/sync" (0.0 for the first), its other stages step k's
    "time/<stage>". One dict per step, keys in SOURCE_ORDER, only the stages present ("sync"
    always; "update_critic" only for PPO). The last step's sync is left out.
    """
    # BEGIN SOLUTION
    cycles, previous_sync = [], 0.0
    for record in records:
        if "time/generate" not in record:
            continue
        cycle = {"sync": previous_sync}
        for stage in SOURCE_ORDER[1:]:
            if f"time/{stage}" in record:
                cycle[stage] = record[f"time/{stage}"]
        cycles.append(cycle)
        previous_sync = record["time/sync"]
    return cycles
    # END SOLUTION

# %% [markdown]
# ## 8. Same algorithm, different placement
#
# One configuration and seed, in one process (stage 1's `train`) and in three placements, every
# metric of every step compared. The per-role actor spans **both nodes** (two DDP ranks); the
# colocated run is PPO with a KL penalty (all five roles on one worker). The disaggregated
# workers also time the syncs, interleaved.

# %%
from minirl.controller.weight_sync import CollectiveSync

STEPS = grpo.run.steps
rows = task.rows("train")


def fresh_policy():
    """A new copy of the warm-started policy (every run trains its own)."""
    return load_default_policy(progress=False)[0]


reference = {"grpo": train(grpo, fresh_policy(), tokenizer),
             "ppo": train(ppo, fresh_policy(), tokenizer)}
runs, sync_times = {}, {}
plans = [("colocated", ppo, make_placement("colocated")),
         ("disaggregated", grpo, make_placement("disaggregated")),
         ("per-role", grpo, make_placement("per-role", {"actor": [1, 1]}))]
for name, config, placement in plans:
    started = time.perf_counter()
    with Driver(config, placement, fresh_policy(), tokenizer, rewards) as driver:
        up = time.perf_counter() - started
        runs[name] = {"records": driver.train(rows), "config": config, "startup": up,
                      "workers": sum(len(g) for g in driver.groups.values())}
        runs[name] |= {"timeline": driver.timeline(), "where": driver.where()}
        if name == "disaggregated":
            actor_group, rollout_group = driver.group_of("actor"), driver.group_of("rollout")
            small = CollectiveSync(actor_group, rollout_group, 64 << 10)
            syncs = {"broadcast, 32 MiB buckets": driver.syncs["collective"],
                     "broadcast, 64 KiB buckets": small,
                     "object store": driver.syncs["object_store"]}
            for _ in tqdm(range(5 if SMOKE else 30), desc="the three syncs, in turn"):
                for label, sync in syncs.items():
                    weights, version = driver.roles.actor.named_weights(), driver.roles.version
                    report = sync.push(weights, driver.engine, version)
                    sync_times.setdefault(label, []).append((report.seconds, report.bytes))
            buckets = {label: len(s.buckets) for label, s in syncs.items() if hasattr(s, "buckets")}


def max_difference(records, expected) -> float:
    """The largest |difference| over every numeric metric of every step (timings excluded)."""
    return max(abs(r[k] - e[k]) for r, e in zip(records, expected, strict=True) for k in e
               if not k.startswith("time/") and isinstance(e[k], (int, float)))


print(f"{'placement':>14} | algo | workers | start-up | steps | max |metric - stage 1|")
for name, result in runs.items():
    algo = result["config"].algorithm.algo
    diff = max_difference(result["records"], reference[algo])
    verdict = "(identical)" if diff == 0 else "(float rounding)" if diff < 1e-4 else "DIFFERS"
    print(f"{name:>14} | {algo:>4} | {result['workers']:7d} | {result['startup']:6.1f} s | "
          f"{len(result['records']):5d} | {diff:.2e} {verdict}")
assert all(max_difference(r["records"], reference[r["config"].algorithm.algo]) < 1e-4
           for r in runs.values())

# %% [markdown]
# Every metric agrees with stage 1 (0: bit for bit; the per-role actor's two ranks add their
# gradients in another order); start-up is a Python process per worker. The syncs, timed:

# %%
print(f"{'sync':>26} | buckets | MiB  | median ms | MiB/s")
medians = {}
for label, samples in sync_times.items():
    medians[label] = sorted(s for s, _ in samples)[len(samples) // 2]
    mib = samples[0][1] / 2**20
    print(f"{label:>26} | {buckets.get(label, '-'):>7} | {mib:4.2f} | "
          f"{1e3 * medians[label]:9.2f} | {mib / medians[label]:6.0f}")
fast = medians["broadcast, 32 MiB buckets"]
print(f"object store / broadcast: {medians['object store'] / fast:.1f}x the time; "
      f"small buckets / large: {medians['broadcast, 64 KiB buckets'] / fast:.1f}x")
for name, result in runs.items():
    steps = [r for r in result["records"] if "time/sync" in r]
    share = sum(r["time/sync"] for r in steps) / sum(r["time/step"] for r in steps)
    print(f"sync share of the step, {name}: {100 * share:.1f} %: "
          f"{'above' if share > 0.05 else 'at or below'} the source's 5 % for a slow sync")

# %% [markdown]
# **When a worker dies** its pending call fails and `gather` (`minirl/runtime/ray_calls.py`)
# names its roles, pool and rank; a new Driver resumes from the last checkpoint. A reward that
# kills its worker in step 3 (checkpoints every 2 steps); the resumed run repeats the first.

# %%
import shutil

from minirl.runtime.io import read_jsonl
from minirl.runtime.ray_calls import WorkerDiedError
from minirl.tasks.rewards import reward_name

crash, out = grpo.replace(checkpoint_every=2), RUNS / "06_crash"
shutil.rmtree(out, ignore_errors=True)


def reward_that_kills(kill_at: int):
    """The task's reward, but call `kill_at` kills the worker it runs in."""
    calls = []

    def reward(prompts, completions, answer, **columns):
        calls.append(1)
        if len(calls) == kill_at:
            ray.kill(ray.get_runtime_context().current_actor)
        return task.reward(prompts, completions, answer)
    reward.__name__ = reward_name(rewards[0])          # the records' `rewards/<name>`, as before
    return reward


try:
    killer = [reward_that_kills(3)]
    with Driver(crash, make_placement("colocated"), fresh_policy(), tokenizer, killer) as driver:
        driver.train(rows, out_dir=out, progress=False)
except WorkerDiedError as err:
    print(f"WorkerDiedError: {err}")
print("steps logged before the crash:", [r["step"] for r in read_jsonl(out / "metrics.jsonl")])
with Driver(crash, make_placement("colocated"), fresh_policy(), tokenizer, rewards) as driver:
    driver.train(rows, out_dir=out, resume=True, progress=False)
gap = max_difference(read_jsonl(out / "metrics.jsonl"), reference["grpo"])
print(f"resumed vs uninterrupted, max |metric difference|: {gap:.2e} (rule: < 1e-4)")
assert gap < 1e-4, "a resumed run must repeat the uninterrupted one"

# %% [markdown]
# Both syncs move the same bytes, here between processes through the loopback or shared
# memory. On GPUs NCCL broadcasts over NVLink while the object store first copies every
# tensor to host memory: why veRL and OpenRLHF sync with NCCL.
#
# ## 9. Where the roles ran, and when
#
# Role → node → device for each run, then which role was busy when on every worker. Colocated,
# one worker does everything in turn; apart, each waits for the others (notebook 07's target).

# %%
from minirl.runtime.cluster_plots import ROLE_COLORS, last_steps_of, plot_placement, plot_timelines

for name, result in runs.items():
    plot_placement(result["where"], title=f"{name}: role -> node -> device")
    plt.show()
    last_two = last_steps_of(result["timeline"], 2)
    plot_timelines({f"{name}: which role was busy when, last 2 steps": last_two}, ROLE_COLORS,
                   xlabel="seconds (wall clock)")
    plt.show()

# %% [markdown]
# **Row 1** (generate → reward → update → synchronize): the disaggregated run's first calls,
# by start. **Row 7** (the Driver's loop): every iteration of the colocated PPO run, its calls
# by recorded start (`minirl/runtime/source_rows.py`; the actor's update stands for the
# advantages computed right before it), and the check on a wrong middle order.

# %%
from minirl.runtime.source_rows import SOURCE_LOOP, driver_order_agrees, recorded_iterations

calls = sorted((start, what) for events in runs["disaggregated"]["timeline"].values()
               for what, start, _ in events)
row1 = {"rollout.generate": "generate", "reward.score": "reward", "actor.update": "update",
        "sync.send": "synchronize"}
ours_row1 = [row1[what] for _, what in calls if what in row1][:4]
source_row1 = ["generate", "reward", "update", "synchronize"]
iterations = recorded_iterations(runs["colocated"]["timeline"])
row7_agrees = driver_order_agrees(runs["colocated"]["timeline"])      # every iteration, as recorded
print("row 1, the loop order")
print("  source:", " -> ".join(source_row1))
print("  minirl:", " -> ".join(ours_row1), "|", "agree" if ours_row1 == source_row1 else "DIFFER")
print(f"row 7, the Driver's stages ({len(iterations)} complete iterations recorded)")
print("  source:", " -> ".join(SOURCE_LOOP))
for k, order in enumerate(iterations, 2):
    print(f"  minirl, iteration {k}:", " -> ".join(order))
print("  verdict:", "agree" if row7_agrees else "DIFFER")
swap = {"reward.score": "critic.values", "critic.values": "reward.score"}     # a wrong middle order
wrong = {worker: [(swap.get(what, what), start, end) for what, start, end in events]
         for worker, events in runs["colocated"]["timeline"].items()}
print("  the check on a timeline with score and values swapped:", driver_order_agrees(wrong))

# %%
from minirl.controller.driver import SOURCE_ORDER, driver_cycles
from minirl.runtime.source_rows import source_stage_shares

shares = {name: source_stage_shares(result["records"]) for name, result in runs.items()}
print(f"{'stage':>13} | " + " | ".join(f"{name:>13}" for name in shares))
for s in (*SOURCE_ORDER, "other"):
    cells = [f"{100 * sh[s]:12.1f}%" if s in sh else f"{'-':>13}" for sh in shares.values()]
    print(f"{s:>13} | " + " | ".join(cells))
for k, cycle in enumerate(driver_cycles(runs["colocated"]["records"]), 1):
    print(f"iteration {k} (ms): " + ", ".join(f"{s} {1e3 * t:.0f}" for s, t in cycle.items()))

# %% [markdown]
# ## 10. Four orchestration styles, side by side
#
# The source's four orchestration styles, all on the same `rl_step`: **single process** (TRL:
# stage 1's `train`), **multiple controllers** (NeMo-Aligner: every rank runs the loop under
# `torchrun`, meeting only in DDP's all-reduce), **single controller** (veRL: disaggregated)
# and **single controller with Ray actor isolation** (OpenRLHF: per-role).

# %%
import json

from minirl.runtime.launch import torchrun

SPMD = '''
"""Multiple controllers: every rank runs the loop on its share of each batch (under torchrun)."""
import json
import sys

import torch

from minirl.config import RLConfig
from minirl.models.policy import load_default_policy
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import init_distributed, shutdown
from minirl.parallel.spmd import setup_spmd, spmd_step
from minirl.runtime.launch import leave
from minirl.tasks.arithmetic import make_task
from minirl.train.run import run

ctx = init_distributed()                                     # gloo on CPUs, NCCL on GPUs
torch.set_num_threads(1)
config = RLConfig.from_flat(steps=int(sys.argv[1]), prompts_per_step=8, num_generations=8,
                            eval_every=0)
model, tokenizer, _ = load_default_policy(progress=False)
task = make_task()
state = setup_spmd(config, ParallelConfig(zero=0), model, tokenizer, task.rows("train"),
                   [task.reward], ctx)
for record in run(state, spmd_step, [], config.run.steps):   # DDP actor, rl_step on every rank
    if ctx.is_main:
        print(json.dumps({k: record[k] for k in ("step", "reward", "time/step")}))
shutdown()
leave(0)                                      # exit without the teardown where gloo can abort
'''
spmd_path = RUNS / "06_spmd.py"
spmd_path.parent.mkdir(parents=True, exist_ok=True)
spmd_path.write_text(SPMD)
RANKS = 2
proc = torchrun(spmd_path, RANKS, [STEPS], timeout=600)
assert proc.returncode == 0, proc.stdout[-3000:]
spmd = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
styles = [("TRL", "single process", "train()", 1, reference["grpo"]),
          ("NeMo-Aligner", "multiple controllers", f"torchrun x{RANKS}", RANKS, spmd)]
for framework, style, placement in (("veRL (HybridFlow)", "single controller", "disaggregated"),
                                    ("OpenRLHF", "single controller + actor/role", "per-role")):
    run_ = runs[placement]
    styles.append((framework, style, f"Driver, {placement}", 1 + run_["workers"], run_["records"]))
print(f"{'framework':>17} | {'orchestration (source)':>30} | {'minirl run':>21} | procs | "
      "reward | s/step")
mean_reward = {}
for framework, style, code, processes, records in styles:
    mean_reward[framework] = sum(r["reward"] for r in records) / len(records)
    per_step = sum(r["time/step"] for r in records) / len(records)
    print(f"{framework:>17} | {style:>30} | {code:>21} | {processes:5d} | "
          f"{mean_reward[framework]:6.3f} | {per_step:6.3f}")
all_ran = all(len(records) == STEPS for *_, records in styles)
same_draws = ("TRL", "veRL (HybridFlow)", "OpenRLHF")          # one sampler, the same seeds
spread = max(mean_reward[f] for f in same_draws) - min(mean_reward[f] for f in same_draws)
verdict = "agree" if all_ran and spread < 1e-6 else "DIFFER"
print(f"row 8, the four styles: {verdict} (all ran {STEPS} steps: {all_ran}; mean reward of the\n"
      f"  single-process and single-controller runs spread by {spread:.1e}, rule < 1e-6;\n"
      "  the multiple-controller run samples other draws)")

# %% [markdown]
# The styles change who holds the loop (one process, every rank, or a driver) and how weights
# and batches move, not the algorithm; the torchrun ranks sample from seeds of their own.
#
# ## 11. Beyond one machine
#
# Only the start changes: `ray start --head` on one machine, `ray start --address HEAD:6379`
# on the others, then `python chapters/06_ray.py --address auto --device cuda ...` anywhere:
# every model pool reserves a GPU per device and the world uses NCCL.
#
# ## What to take away
#
# - One algorithm, written once (`rl_step`), runs in one process, under torchrun, or from a
#   driver on Ray workers; the driver only hands it proxies with the same methods.
# - A placement maps roles to pools, planned before anything starts. Colocated roles take
#   turns on the same devices; disaggregated roles run apart and pay a weight sync.
#
# ## Exercises
#
# Your stubs are in `exercises/06_ray_controller.py`; grade them with
# `python -m minirl.grade --only 06`.
#
# | exercise | function | what it checks |
# |---|---|---|
# | 6.1 | `plan_placement` | first fit in order, distinct nodes per pool, earlier pools, fractional CPUs, GPUs |
# | 6.2 | `split_by_rank` | contiguous equal parts, whole groups, the batch back by concatenation, errors |
# | 6.3 | `driver_cycles` | the sync moved to the next iteration, the source's order, skipped evaluation records |
#
# To think about (not graded): per-role, the rollout worker waits while the actor trains and
# the other way round; how would you keep both busy, and what does the batch lose (notebook
# 07)? How does the object store's sync time grow with the number of rollout workers?

# %%
ray.shutdown()
cluster.shutdown()
