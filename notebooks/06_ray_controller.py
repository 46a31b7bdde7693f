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
# run stage 1's very step on them from one driver process, move the weights from the
# trainer to the rollout workers through a collective or through Ray's object store, and
# read where each role ran and when it was busy.
#
# The source's question here is *how models are placed on GPUs*. veRL (HybridFlow) answers
# with three abstractions: a **ResourcePool** (a group of devices), a **Worker** (one model
# instance on one device: an actor that trains, a rollout engine that samples, ...) and a
# **Driver**, the single controller that runs the algorithm and tells the workers what to
# compute. Several roles may share a pool and take turns on its devices (**colocated**), or
# each may get its own devices (**disaggregated**); OpenRLHF isolates every role in its own
# group of Ray actors. We build each piece small, in order:
#
# | section | piece | module |
# |---|---|---|
# | 1 | ResourcePool, a placement plan, placement groups | `controller/resource_pool.py` |
# | 2 | Worker: rank, world size, a torch.distributed group inside a Ray actor | `controller/worker.py` |
# | 3 | WorkerGroup and its dispatch modes | `controller/worker_group.py` |
# | 4 | the five roles as workers | `controller/roles.py` |
# | 5 | weight sync between actors: a bucketed broadcast, and the object store | `sync/broadcast.py`, `controller/weight_sync.py` |
# | 6 | placement: colocated, disaggregated, per-role | `controller/placement.py` |
# | 7 | the driver's view of the roles, and the Driver | `controller/proxies.py`, `controller/driver.py` |
#
# Then we check the claim that matters most: **the same algorithm in every placement**. The
# Driver runs stage 1's `rl_step` unchanged on objects that forward each call to workers, so a
# disaggregated or colocated run reproduces the single-process metrics for the same seed.
# The notebook reproduces three rows of the source: the loop order (row 1), the Driver's
# stage order and timeline (row 7), and the four orchestration styles of its framework
# table, side by side as runnable code (row 8).
#
# Everything runs on this machine: Ray's test cluster (`ray.cluster_utils.Cluster`) starts
# two "nodes" here, each with two CPUs, and a device is a slot of a quarter CPU. On a real
# cluster the same code reserves GPUs (section 12 and the README show how).

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import json
import os
import subprocess
import sys
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
torch.set_num_threads(1)  # the tiny policy gains nothing from more threads; the workers get one each
model, tokenizer, policy_path = load_default_policy()
task = make_task()
rewards = arithmetic_task().reward_funcs   # the reward stage 1's train() uses, under the same name

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # Ray's workers inherit this environment

# %% [markdown]
# ## The whole loop first
#
# Stage 1's GRPO loop, run by the single controller: a two-node Ray cluster of our own on
# this machine (`local_cluster`: never a cluster someone else runs here), a `Driver` that
# starts one worker holding every role (the colocated placement), and two steps; beside
# them, the same two steps in one process (stage 1's `train`). The rest of the notebook
# builds each piece the Driver used; section 8 runs every placement and compares every metric.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.controller.driver import Driver  # noqa: E402
from minirl.controller.placement import make_placement  # noqa: E402
from minirl.controller.resource_pool import local_cluster  # noqa: E402
from minirl.train.run import train  # noqa: E402

started = time.perf_counter()
print("starting a two-node Ray cluster on this machine ...", flush=True)
cluster = local_cluster(num_nodes=2, cpus_per_node=2)        # two Ray nodes on this machine, two CPUs each
ray.init(address=cluster.address, log_to_driver=False)
print(f"cluster up after {time.perf_counter() - started:.0f} s", flush=True)
first_look = RLConfig.from_flat(steps=2, prompts_per_step=8, num_generations=8, eval_every=0)
alone = train(first_look, load_default_policy(progress=False)[0], tokenizer)
with Driver(first_look, make_placement("colocated"), load_default_policy(progress=False)[0], tokenizer,
            rewards) as driver:
    print(f"the Driver's worker is up after {time.perf_counter() - started:.0f} s", flush=True)
    on_ray = driver.train(task.rows("train"))
    print("roles -> devices:", driver.where())
for a, b in zip(alone, on_ray, strict=True):
    print(f"step {a['step']}: reward {a['reward']:.4f} in one process, {b['reward']:.4f} from the Driver; "
          f"loss {a['loss']:+.5f} / {b['loss']:+.5f}")

# %% [markdown]
# ## 1. Resource pools: which devices, on which nodes
#
# A pool says how many devices its roles need on each node it spans: `ResourcePool([2])` is
# two devices on one node, `ResourcePool([1, 1])` one device on each of two nodes (a pool
# that spans nodes, as a data-parallel trainer on two machines does). A device is one GPU,
# or on a machine without GPUs a slot of `cpus_per_device` CPUs, so a laptop can hold a
# whole cluster's worth of small workers.
#
# Before any process starts, the driver **plans**: it assigns every (pool, node) entry to a
# real node, first fit, and fails at once with the numbers when the cluster cannot hold the
# request. Only then does it ask Ray to **reserve** the devices: one placement group per
# entry, one bundle per device, pinned to the planned node. Ray holds a placement group's
# resources until it is removed, so the workers started in it later cannot be starved by
# anything else. (veRL creates the same per-node placement groups but lets Ray pick the
# nodes; choosing them ourselves makes the printed plan the placement that happens.)

# %%
# | export minirl/controller/resource_pool.py
"""Resource pools: devices on nodes, planned first, then reserved with Ray placement groups.

A `ResourcePool` says how many devices a set of roles needs on each node it spans:
`ResourcePool([2])` is two devices on one node, `ResourcePool([1, 1])` one on each of two
nodes. A device is one GPU (with `cpus_per_device` CPUs beside it) or, without GPUs, a slot
of `cpus_per_device` CPUs. `plan_placement` assigns every pool's entries to nodes before
anything starts, so a request the cluster cannot hold fails at once with the numbers;
`reserve` then turns each entry into a Ray placement group of one bundle per device,
pinned to its planned node (Ray holds it until `release`).

Simplified vs veRL's `RayResourcePool`: veRL makes one STRICT_PACK placement group per node
and lets Ray choose the node; we choose it (first fit over the nodes Ray reports, by their
total resources) and pin the group there with a label selector, so the plan we print is the
placement that happens. Resources other jobs hold are not seen by the plan: a reservation
that Ray cannot grant times out with a message instead.
"""

import contextlib
import logging
import os
import socket
import time
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from minirl.runtime.validate import ConfigError, check_choice, check_float

DEVICES = ("cpu", "gpu")


class PlacementError(ValueError):
    """A placement the cluster cannot hold; the message names the pool and the numbers."""

# %% [markdown]
# The pool: its device count on each node, checked when it is made, and the bundle that one
# device reserves. `cluster_nodes` reads what a plan places pools on: the total CPUs and GPUs
# of every alive node, head first.

# %%
# | export minirl/controller/resource_pool.py
class ResourcePool:
    """Devices on one or more nodes, for the roles placed on this pool."""

    def __init__(self, devices_per_node: list[int], device: str = "cpu", cpus_per_device: float = 0.25):
        check_choice("device", device, DEVICES)
        if (not isinstance(devices_per_node, (list, tuple)) or not devices_per_node
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in devices_per_node)):
            raise ConfigError("devices_per_node", devices_per_node,
                              "a list with one device count >= 1 per node, e.g. [2] or [1, 1]")
        check_float("cpus_per_device", cpus_per_device, low=0.0, low_open=True)
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
        return f"ResourcePool({self.devices_per_node}, {self.device!r}, cpus_per_device={self.cpus_per_device:g})"


def cluster_nodes() -> list[dict]:
    """The alive nodes of the connected cluster, head first: {"node_id", "CPU", "GPU"} (totals)."""
    nodes = sorted((n for n in ray.nodes() if n["Alive"]),
                   key=lambda n: "node:__internal_head__" not in n["Resources"])
    return [{"node_id": n["NodeID"], "CPU": n["Resources"].get("CPU", 0.0), "GPU": n["Resources"].get("GPU", 0.0)}
            for n in nodes]


def _fmt(resources: dict) -> str:
    return " ".join(f"{k} {v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))

# %% [markdown]
# The plan is a small first-fit assignment, and the first exercise (6.1). Every entry of a
# pool must land on a node the pool does not use yet (a pool "spans two nodes" means two
# different machines) and that still has room after the pools placed before it.

# %%
# | export minirl/controller/resource_pool.py
def plan_placement(pools: dict[str, ResourcePool], nodes: list[dict]) -> dict[str, list[int]]:
    """A node for every entry of every pool: {pool name: [node index for each entry of devices_per_node]}.

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
            fits = [i for i, free in enumerate(left)
                    if i not in used and all(free[r] >= amount - 1e-9 for r, amount in need.items())]
            if not fits:
                raise PlacementError(
                    f"pool {name!r} (devices_per_node={pool.devices_per_node}) needs {count} device(s) = "
                    f"{_fmt(need)} on a node of its own for entry {k}, but no node has that left: "
                    + ", ".join(f"node{i} has {_fmt(free)}" + (" (used by this pool)" if i in used else "")
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
# Reserving, and joining a cluster. `connect` starts a local cluster, or joins one at an
# address; an address where nothing listens fails within a few seconds (a bare `ray.init`
# would keep trying for much longer). `local_cluster` starts Ray's multi-node test cluster
# on this machine: every node is a real Ray node with its own resources, only the network is
# the loopback.
#
# Starting Ray on a busy machine fails more often than one would think: a node's raylet gives
# its dashboard agent (a Python process) 15 s to write each of its port files and then aborts,
# and at load 15-20 on two cores the agent's imports alone take longer. That wait is fixed in
# Ray 2.60, so both start Ray's processes at a raised CPU priority (where the OS allows it, and
# only for the start), raise the waits that are settings, run Ray's workers at nice 0 instead of
# Ray's 15 (beside other work they would get a sliver of a CPU), and try a failed start again
# after 2, 4, 8 s, cleaning up what the failed try left running. And since
# Ray 2.60, `ray start --head` turns token authentication on: a driver without the token is
# refused after 20 s with a bare "Failed to connect", so `connect` tries once more with
# `RAY_AUTH_MODE=token` when a token is at hand, and otherwise says so.

# %%
# | export minirl/controller/resource_pool.py
def reserve(name: str, pool: ResourcePool, node_ids: list[str], timeout: float = 60.0) -> list[PlacementGroup]:
    """One placement group per entry of `pool`, pinned to node_ids[entry], one bundle per device.

    Waits until Ray holds them all; otherwise removes what it made and raises PlacementError.
    """
    groups = []
    try:
        for count, node_id in zip(pool.devices_per_node, node_ids, strict=True):
            groups.append(placement_group([pool.bundle()] * count, strategy="STRICT_PACK",
                                          bundle_label_selector=[{"ray.io/node-id": node_id}] * count))
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout)
        if len(ready) < len(groups):
            raise PlacementError(f"pool {name!r}: Ray did not grant its {pool.size} device(s) ({_fmt(pool.bundle())} "
                                 f"each) within {timeout:g} s; another job may hold them (`ray status` shows "
                                 "what is in use)")
    except BaseException:
        release(groups)
        raise
    return groups


def release(groups: list[PlacementGroup]) -> None:
    for group in groups:
        remove_placement_group(group)


def probe(address: str, timeout: float = 5.0) -> None:
    """Raise ConnectionError within `timeout` seconds unless something listens at host:port."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ConnectionError(
            f"address={address!r}: no Ray cluster answers there within {timeout:g} s ({err}); start one with "
            "`ray start --head` and pass the address it prints (host:6379), or 'auto' on one of its nodes"
        ) from None

# %% [markdown]
# Starting Ray on a busy machine: the waits that are settings raised, Ray's workers at their
# fair share of the CPU, and a failed start tried again after a backoff, with what it left
# running cleaned up.

# %%
# | export minirl/controller/resource_pool.py
# Ray's start-up settings, applied where the user set none. A raylet gives its dashboard agent 15 s to
# write each of its port files (fixed in Ray 2.60) and its Python start takes longer than that on a
# machine at load 15-20, so the start itself runs at a raised CPU priority where allowed (`started`).
# The waits that are settings are raised: an agent's registration, a worker's. And Ray runs its
# workers at nice 15, a sliver of a CPU beside other work at nice 0 on a busy machine: 0 is their
# fair share.
START_ENV = {"RAY_agent_register_timeout_ms": "120000", "RAY_worker_register_timeout_seconds": "180",
             "RAY_worker_niceness": "0"}
AUTH_HINT = ("a cluster started by `ray start --head` asks for a token by default (Ray 2.60): run with "
             "RAY_AUTH_MODE=token and its token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN "
             "(`ray get-auth-token` on the head prints it)")


def raise_start_waits() -> None:
    """Set START_ENV in this process's environment (Ray's nodes started from here inherit it)."""
    for key, value in START_ENV.items():
        os.environ.setdefault(key, value)


def token_available() -> bool:
    """Whether a Ray auth token is at hand: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()

# %% [markdown]
# `started` is the retry: every try at a raised CPU priority, a failed one undone (what it
# left running killed) before the next, after a wait that doubles.

# %%
# | export minirl/controller/resource_pool.py
def started(start, stop, what: str, attempts: int = 4, backoff: float = 2.0, boost: int = 10):
    """start() until it succeeds, at most `attempts` times, waiting backoff * 2**k s after the k-th failure.

    Each try runs at a CPU priority `boost` steps above this process's (where the OS allows it:
    root, or a lowered niceness to take back), so that Ray's helper processes, which inherit it,
    start within Ray's fixed waits on a busy machine; this process and the ones the start left
    running go back to the old priority after it. A failed start is undone (stop(), then the
    processes this process started during it are killed: a raylet or GCS left half-started), so
    the next try begins clean. The last failure raises ConnectionError in one line: what, how
    often, and the first line of Ray's error.
    """
    for attempt in range(attempts):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        old = os.getpriority(os.PRIO_PROCESS, 0)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, max(-20, old - boost))
        except OSError:                                    # not allowed here: start at the usual priority
            pass
        try:
            return start()
        except Exception as err:
            stop()
            for child in psutil.Process().children(recursive=True):
                if child.pid not in before:
                    child.kill()
            if attempt == attempts - 1:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                raise ConnectionError(f"{what} failed {attempts} times ({type(err).__name__}: {reason}); the machine "
                                      "may be too busy: retry later, or start one with `ray start --head` and pass "
                                      "--address") from None
            time.sleep(backoff * 2**attempt)
        finally:
            if os.getpriority(os.PRIO_PROCESS, 0) != old:
                os.setpriority(os.PRIO_PROCESS, 0, old)
                for child in psutil.Process().children(recursive=True):
                    if child.pid not in before:
                        with contextlib.suppress(psutil.Error):
                            child.nice(old)

# %% [markdown]
# Joining: a local cluster of our own (address="local"), or the cluster at an address, probed
# first; and Ray's multi-node test cluster on this machine.

# %%
# | export minirl/controller/resource_pool.py
def connect(address: str | None = None, num_cpus: float = 2, timeout: float = 5.0, attempts: int = 4) -> str:
    """Join the Ray cluster at `address` ("auto", or "host:port"), or start a local one (num_cpus CPUs).

    Returns a one-line description. A local start is tried `attempts` times with backoff
    (`started`), with Ray's start-up waits raised (`raise_start_waits`). An address where
    nothing listens raises ConnectionError within `timeout` seconds. A cluster that refuses us
    (Ray gives up after about 20 s) is tried once more with token auth when RAY_AUTH_MODE is
    unset and a token is at hand (`ray start --head` turns token auth on by default in Ray
    2.60; a cluster without it refuses a token-mode driver's actors, so token mode is not the
    first try); otherwise ConnectionError names token auth. Already connected: nothing changes.
    """
    if ray.is_initialized():
        return f"connected to {ray.get_runtime_context().gcs_address}"
    raise_start_waits()
    if address is None:
        # "local": a new cluster of our own, even where another process left one running
        started(lambda: ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                                 logging_level=logging.WARNING),
                ray.shutdown, f"starting a local Ray cluster of {num_cpus:g} CPUs", attempts)
        return f"started a local Ray cluster with {num_cpus:g} CPUs"
    if address != "auto":
        probe(address, timeout)
    try:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError:
            if "RAY_AUTH_MODE" in os.environ or not token_available():
                raise
            ray.shutdown()                                 # a token here: the cluster may want it (Ray 2.60's default)
            os.environ["RAY_AUTH_MODE"] = "token"
            ray._raylet.Config.initialize("")              # as Ray does when it turns token auth on in a process
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as err:
        ray.shutdown()
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConnectionError(f"address={address!r}: the cluster there did not let us in ({reason}); "
                              f"{AUTH_HINT}") from None
    return f"joined the Ray cluster at {ray.get_runtime_context().gcs_address}"


def local_cluster(num_nodes: int = 2, cpus_per_node: float = 2, attempts: int = 4):
    """Ray's multi-node test cluster on this machine: `num_nodes` nodes of `cpus_per_node` CPUs each.

    Each node is a real raylet with its own resources, so placement across nodes is real;
    only the network is the loopback. A busy machine can still miss Ray's start-up waits
    (raised first, `raise_start_waits`): a failed start is cleaned up and tried again with
    backoff (`started`). Connect with `ray.init(address=cluster.address)`.
    """
    raise_start_waits()
    holder = {}

    def start():
        holder["cluster"] = cluster = Cluster()
        for _ in range(num_nodes):
            cluster.add_node(num_cpus=cpus_per_node, include_dashboard=False)
        return cluster
    return started(start, lambda: holder["cluster"].shutdown() if "cluster" in holder else None,
                   f"starting a local Ray cluster of {num_nodes} nodes", attempts)

# %% [markdown]
# Plan three pools on a cluster that exists only on paper (two nodes of 8 GPUs), then on the
# two Ray nodes the first cell started. A request too large for the cluster (16 GPUs of
# training and one more for rollout) fails before anything starts, with the numbers.

# %%
from minirl.controller.resource_pool import PlacementError, ResourcePool, cluster_nodes, local_cluster, plan_placement  # noqa: E402

# the cluster: the two-node one the first cell started (`local_cluster`, the next cells show how)
paper = [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}]
pools = {"train": ResourcePool([4, 4], "gpu", 8), "rollout": ResourcePool([4], "gpu", 8),
         "reward": ResourcePool([1], "cpu", 4)}
print("on paper (2 x 8 GPUs):", plan_placement(pools, paper))
here = cluster_nodes()
print("here:", [{k: v for k, v in n.items() if k != "node_id"} for n in here])
print("here:", plan_placement({"train": ResourcePool([1, 1]), "rollout": ResourcePool([2])}, here))
try:
    plan_placement({"train": ResourcePool([8, 8], "gpu"), "rollout": ResourcePool([1], "gpu")}, paper)
    raise AssertionError("17 GPUs on a 16-GPU cluster should not fit")
except PlacementError as err:
    print("PlacementError:", err)

# %% [markdown]
# ## 2. The Worker: a Ray actor that knows its rank
#
# A worker is one process on one device. veRL's `Worker` reads its rank and world size from
# environment variables its group sets; ours takes them as arguments, which is easier to
# follow. Besides its place in its group, a worker can join a **torch.distributed world**
# with the other workers (gloo between CPU processes, NCCL between GPUs): the actor ranks
# average their gradients through it, and the trainer broadcasts its weights to the rollout
# workers through it. A worker also keeps a **timeline** of what it ran, from when to when,
# so the driver can draw which role was busy when.

# %%
# | export minirl/controller/worker.py
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

# %% [markdown]
# A worker joins the one torch.distributed world of all workers at the address that world
# rank 0 offered (`free_address`); then all of them create the named subgroups together, since
# torch.distributed makes a group collectively, even in the processes outside it.

# %%
# | export minirl/controller/worker.py
@add_to_class(Worker)
def init_world(self, init_method: str, world_rank: int, world_size: int, backend: str,
               timeout_s: float = 120.0) -> int:
    """Join the world of all workers (every member calls this at the same time)."""
    dist.init_process_group(backend, init_method=init_method, rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    self.world_rank = world_rank
    return world_rank


@add_to_class(Worker)
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

# %% [markdown]
# The timeline: `record` wraps every call the worker runs and notes what ran from when to
# when; `timeline` hands the calls back by start time. `ping` answers once the process is up.

# %%
# | export minirl/controller/worker.py
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
    """The recorded calls by start time (a call inside another, a sleep inside generate, comes after it)."""
    events = sorted(self.events, key=lambda event: event[1])
    if clear:
        self.events.clear()
    return events


@add_to_class(Worker)
def ping(self) -> bool:
    return True

# %% [markdown]
# ## 3. A WorkerGroup and its dispatch modes
#
# A `WorkerGroup` is the workers of one pool, rank 0 to n − 1. The driver calls the group,
# never a worker directly, and a **dispatch mode** says how the call's arguments go out to the
# ranks and how their results come back. The RL loop needs four:
#
# | mode | arguments | result | used for |
# |---|---|---|---|
# | `ONE_TO_ALL` | the same to every rank | a list, by rank | set-up, loading weights, restoring |
# | `DP_COMPUTE` | a batch split into equal parts of whole groups, one per rank | the parts' results concatenated | log-probs, values, generation |
# | `DP_UPDATE` | split the same way | rank 0's (the ranks reduce their metrics into one record) | the actor's and the critic's update |
# | `RANK_ZERO` | to rank 0 only | rank 0's result | weights and optimizer state for a checkpoint |
#
# veRL attaches its modes to worker methods with a decorator that also generates the
# group's methods (`actor_rollout_compute_log_prob`, ...). Here a mode is two plain
# functions, one to split the arguments and one to collect the results, and the call names
# the role and the method as data: `group.execute(DP_COMPUTE, "actor", "logprobs", rollout)`.
# Splitting is the second exercise (6.2): contiguous, equal parts, a prompt's G completions
# never torn apart.

# %%
# | export minirl/controller/worker_group.py
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
    if isinstance(batch, Batch) or hasattr(batch, "group_size"):   # a Batch, whichever copy of minirl.data
        parts = batch.split(n)
    else:
        if n < 1 or len(batch) % n:
            raise ValueError(f"split_by_rank: {len(batch)} items do not split into {n} equal parts; "
                             f"use a number of ranks that divides {len(batch)}")
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

# %% [markdown]
# Waiting for results is where failures surface. First what a dead worker becomes: Ray
# raises one of several errors when the process behind a call is gone (`DEATHS`), and
# `died` turns each into a `WorkerDiedError` that names the worker's roles, group, rank and
# node, and says so when Ray's memory monitor killed it.

# %%
# | export minirl/controller/worker_group.py
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

# %% [markdown]
# The group itself starts one Ray actor per device of its pool, each in its bundle of the
# pool's placement groups, and names it after its group and rank. `run` calls one worker
# method on the ranks it gives arguments; `execute` calls a role's method through a dispatch
# mode.

# %%
# | export minirl/controller/worker_group.py
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

# %% [markdown]
# Every wait on a worker goes through `gather`. It takes the calls as they finish, so a worker
# that dies is reported at once, even while its peers are still blocked in a collective
# waiting for it (they are killed when the driver shuts the groups down).

# %%
# | export minirl/controller/worker_group.py
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

# %% [markdown]
# Two plain workers, one on each node, joined in one gloo world: an all-reduce across
# the nodes, a dispatch in each mode, and the timeline each worker kept.

# %%
from minirl.controller.resource_pool import release, reserve  # noqa: E402
from minirl.controller.worker import Worker  # noqa: E402
from minirl.controller.worker_group import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO, WorkerGroup, split_by_rank  # noqa: E402


class SumWorker(Worker):
    """A worker with two methods to try the group with."""

    def call(self, role, method, *args):
        with self.record(method):
            if method == "all_reduce":
                t = torch.tensor([float(self.rank + 1)])
                torch.distributed.all_reduce(t)
                return t.item()
            return [f"rank {self.rank} got {x}" for x in args[0]] if method == "echo" else self.where()


pool = ResourcePool([1, 1])
plan = plan_placement({"demo": pool}, here)
pgs = reserve("demo", pool, [here[i]["node_id"] for i in plan["demo"]])
demo = WorkerGroup("demo", pool, pgs, ["demo"], SumWorker, nodes=plan["demo"])
address = ray.get(demo.workers[0].free_address.remote())
demo.run("init_world", [(address, rank, 2, "gloo") for rank in range(2)])
print("where:", [(w["group"], w["rank"], w["node_id"][:8]) for w in demo.execute(ONE_TO_ALL, "", "where")])
print("all-reduce of 1 + 2 across two nodes:", demo.execute(ONE_TO_ALL, "", "all_reduce"))
print("DP_COMPUTE over 4 prompts:", demo.execute(DP_COMPUTE, "", "echo", ["1+1=", "2+2=", "3+3=", "4+4="]))
print("RANK_ZERO:", demo.execute(RANK_ZERO, "", "echo", ["only rank 0"]))
print("split_by_rank(2, 4 prompts):", split_by_rank(2, ["a", "b", "c", "d"]))
print("timeline of rank 1:", [(what, round(end - start, 4)) for what, start, end in
                              ray.get(demo.workers[1].timeline.remote())])
demo.shutdown()
release(pgs)

# %% [markdown]
# ## 4. The five roles as workers
#
# A `RoleWorker` hosts the roles its pool was given and answers `call(role, method, *args)`
# with stage 1's own objects: the `Actor`, `Reference` and `Critic` of `minirl.roles`, any
# engine behind the `RolloutEngine` protocol, and the reward functions. It builds them as
# stage 1's `build_roles` and `build_engine` do, from a copy of the policy the driver put in
# Ray's object store once. Nothing here computes anything new; a worker adds three things
# around the roles:
#
# - **Data parallelism.** With several ranks, the actor and the critic are notebook 04's
#   `DistributedActor` and `DistributedCritic`, built over the pool's own process group
#   (a `ProcessGroup` around the subgroup of its ranks; gloo here, NCCL on GPUs) with DDP
#   (`wrap_model(..., zero=0)`). DDP *averages* the ranks' gradients, which is right only
#   when every rank's loss has the same normalizer. The default loss (`loss_type="dapo"`)
#   divides by the number of completion tokens *in the whole batch*, and two halves of a
#   batch rarely hold the same number of tokens; so each rank weights its loss by
#   its loss type's `rank_weight` (W · T_r / T for dapo, TRL's `num_items_in_batch` across processes),
#   and W ranks make the update one process makes. The rest comes with it: one metric
#   record, the same on every rank (so the driver takes rank 0's), and the NaN rule: a
#   non-finite batch on any rank makes every rank skip the step together, where a rank
#   skipping alone would leave the others waiting in DDP's all-reduce until the world's
#   timeout (120 s here). Stage 4 and stage 6 share this one implementation.
# - **Colocation.** When the actor and the engine share a worker, the engine is wrapped in
#   notebook 04's `ColocatedEngine`: it frees its weights right after generating and gets
#   them back from the next sync, so training has the device's memory to itself (veRL's
#   hybrid engine switches vLLM between rollout and trainer mode the same way; vLLM calls it
#   `sleep`). The worker passes its `record`, so the sleeps and wake-ups show in its
#   timeline, and `stream=False`: the sync's push goes to the engine's own `load_weights`.
# - **The worker side of the weight syncs** (section 5).
#
# The names this stage chooses among (its roles here, the placements of section 6, the weight
# syncs of section 7) live in a module that imports neither Ray nor torch, so that the chapter
# script checks its flags against them before anything heavy loads.

# %%
# | export minirl/controller/names.py
"""The names stage 6 chooses among: its roles, its placements (a layout of the roles on pools), its weight syncs.

Imports nothing (no Ray, no torch): chapters/06_ray.py builds its flags from these names and
refuses a bad command line before anything heavy loads.
"""
ROLES = ("actor", "rollout", "reward", "reference", "critic")


# %%
# | export minirl/controller/roles.py
"""The five roles of the RL loop as Ray workers: Actor, Rollout, Critic, Reference, Reward.

A `RoleWorker` is one process on one device of a pool. It hosts the roles its pool was
given and answers `call(role, method, *args)` with stage 1's own objects, built as stage 1
builds them: `Actor`, `Reference`, `Critic` (minirl.roles), any engine behind the
`RolloutEngine` protocol (`build_engine`), and the reward functions (`RewardRole`). So a
change of placement cannot change what is computed.

Around the roles a worker adds data parallelism (on a pool of several ranks the actor and
the critic are stage 4's `DistributedActor` and `DistributedCritic`, DDP over the pool's
process group: the same loss weighting, metric reduction and NaN rule as under torchrun),
colocation (an engine that shares a worker with the actor is stage 4's `ColocatedEngine`:
it frees its weights after generating and gets them back from the next sync), and the
worker side of the weight syncs (send, receive, put in the object store, copy in-process).

Simplified: a data-parallel rank holds a full replica (DDP; no FSDP sharding inside a pool).
"""

import copy

import ray
import torch

from minirl.controller.names import ROLES
from minirl.controller.worker import Worker
from minirl.data import Batch
from minirl.memory.wrap import wrap_model
from minirl.models.critic import ValueModel
from minirl.parallel.launch import ProcessGroup
from minirl.parallel.roles import DistributedActor, DistributedCritic
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.registry import build_engine
from minirl.runtime.seeding import seed_everything
from minirl.sync.base import InProcessSync
from minirl.sync.broadcast import recv_buckets, send_buckets, tensor_metadata


class RewardRole:
    """The reward functions (TRL signature), where the reward worker runs."""

    def __init__(self, reward_funcs):
        self.funcs = list(reward_funcs)

    def score(self, index: int, prompts: list, completions: list, columns: dict) -> list[float]:
        return list(self.funcs[index](prompts=prompts, completions=completions, **columns))

# %% [markdown]
# Two helpers of the worker first: `moved` puts every tensor of a call's arguments on the
# worker's device (and its results back on the CPU), and `build_role` builds one role as
# stage 1 does, or as stage 4's data-parallel role when its pool has more than one rank.

# %%
# | export minirl/controller/roles.py
def moved(value, device):
    """`value` with every tensor (inside Batches, dicts, lists and tuples too) on `device`.

    Batches arrive from the driver on the CPU and results go back on the CPU: the driver may
    have no GPU, and a CUDA tensor cannot be unpickled without one.
    """
    if isinstance(value, (torch.Tensor, Batch)):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    return value


def build_role(name: str, config, model, tokenizer, reward_funcs, group: ProcessGroup | None = None):
    """One role, as stage 1 builds it; `group`: the pool's data-parallel ranks when it has more than one.

    With a group the actor and the critic are stage 4's data-parallel roles, DDP over it.
    """
    algo, opt, sampling = config.algorithm, config.optimizer, config.sampling
    if name == "actor":
        if group is None:
            return Actor(model, algo, opt, sampling)
        return DistributedActor(wrap_model(model, 0, group.device, process_group=group.group), algo, opt, sampling,
                                group)
    if name == "critic":
        value = ValueModel.from_policy(model)
        if group is None:
            return Critic(value, algo, opt)
        return DistributedCritic(wrap_model(value, 0, group.device, process_group=group.group), algo, opt, group)
    if name == "reference":
        return Reference(model, sampling.temperature)
    if name == "rollout":
        return build_engine(config, model, tokenizer)
    if name == "reward":
        return RewardRole(reward_funcs)
    raise ValueError(f"role {name!r}: the roles are {', '.join(ROLES)}")

# %% [markdown]
# The worker. `setup` builds the roles (the reference first: it copies the policy before the
# actor ever trains, as stage 1's `build_roles` does); `call` runs one method of one role
# and records it; the four sync methods are the worker's side of section 5.

# %%
# | export minirl/controller/roles.py
class RoleWorker(Worker):
    """A worker that hosts roles of the RL loop; roles on one worker share its process and device."""

    def setup(self, roles: list[str], config, model, tokenizer, reward_funcs=()) -> dict[str, str]:
        seed_everything(config.run.seed)
        self.torch_device = torch.device(config.run.device)
        model = copy.deepcopy(model).to(self.torch_device).eval()
        ranks = self.groups.get(f"dp:{self.group}") if self.size > 1 else None   # only pools that hold models
        group = ProcessGroup(self.torch_device, ranks) if ranks is not None else None
        order = ("reference", "critic", "actor", "rollout", "reward")   # the copies first, then the actor trains
        self.roles = {name: build_role(name, config, model, tokenizer, reward_funcs, group)
                      for name in order if name in roles}
        if "actor" in self.roles and "rollout" in self.roles:              # colocated: take turns on the device
            self.roles["rollout"] = ColocatedEngine(self.roles["rollout"], stream=False,
                                                    record=lambda what: self.record(f"rollout.{what}"))
        return {name: type(role).__name__ for name, role in self.roles.items()}

    def call(self, role: str, method: str, *args, **kwargs):
        """`self.roles[role].method(*args, **kwargs)`, recorded in the timeline as "role.method".

        Tensor arguments move to this worker's device, tensor results back to the CPU.
        """
        with self.record(f"{role}.{method}"):
            result = getattr(self.roles[role], method)(*moved(args, self.torch_device), **kwargs)
            return moved(result, "cpu")

    def named_weights(self, role: str = "actor") -> list:
        """The role's weights by name, on the CPU (what the driver's copy and a checkpoint hold)."""
        with self.record(f"{role}.named_weights"):
            return [(name, t.detach().cpu()) for name, t in self.roles[role].named_weights()]

    def restore(self, role: str, weights: dict, state: dict) -> None:
        """Load a checkpoint's weights and optimizer state into the actor (weights {} for other roles)."""
        target = self.roles[role]
        if weights:
            getattr(target, "module", target.model).load_state_dict(weights)
        target.load_state_dict(state)

# %% [markdown]
# The worker's side of the weight syncs of section 5: the metadata both ends plan the buckets
# from, the two ends of the broadcast, the put into Ray's object store and the receive from
# it, and the in-process copy of a colocated worker.

# %%
# | export minirl/controller/roles.py
@add_to_class(RoleWorker)
def weight_metadata(self) -> list:
    return tensor_metadata(self.roles["actor"].named_weights())


@add_to_class(RoleWorker)
def send_weights(self, buckets, src: int) -> int:
    """Trainer rank 0: broadcast the actor's weights, bucket by bucket, to the sync group."""
    with self.record("sync.send"):
        return send_buckets(dict(self.roles["actor"].named_weights()), buckets, src, self.groups["sync"])


@add_to_class(RoleWorker)
def recv_weights(self, buckets, src: int, version: int) -> int:
    """A rollout worker: receive the broadcast, load it into the engine; the engine's version."""
    with self.record("sync.recv"):
        device = "cuda" if self.device == "gpu" else "cpu"
        self.roles["rollout"].load_weights(recv_buckets(buckets, src, self.groups["sync"], device), version)
        return self.roles["rollout"].version


@add_to_class(RoleWorker)
def put_weights(self) -> dict:
    """Trainer rank 0: the actor's weights into Ray's object store; {"ref", "tensors", "bytes"}.

    The ref travels inside a dict, so Ray hands it over as a ref; passed on as a top-level
    argument, it is resolved to the weights in the receiving worker.
    """
    with self.record("sync.put"):
        named = [(name, t.detach().cpu()) for name, t in self.roles["actor"].named_weights()]
        return {"ref": ray.put(named), "tensors": len(named),
                "bytes": sum(t.numel() * t.element_size() for _, t in named)}


@add_to_class(RoleWorker)
def receive(self, named_tensors, version: int) -> int:
    """A rollout worker: load these weights (resolved from the object store by Ray); the engine's version."""
    with self.record("sync.receive"):
        self.roles["rollout"].load_weights(named_tensors, version)
        return self.roles["rollout"].version


@add_to_class(RoleWorker)
def local_sync(self, version: int):
    """Colocated: copy this worker's actor weights into this worker's engine (stage 1's InProcessSync)."""
    with self.record("sync.local"):
        return InProcessSync().push(self.roles["actor"].named_weights(), self.roles["rollout"], version)

# %% [markdown]
# ## 5. Weight sync between actors
#
# Step 4 of the loop, synchronize, is where placement costs the most. In stage 1 the engine
# lived in the trainer's process and copied tensors; colocated workers still can (each
# worker copies its own actor's weights into its own engine). When the rollout workers are
# other processes, on other devices or nodes, the weights must travel. Two ways:
#
# 1. **A collective.** Trainer rank 0 and every rollout worker belong to one
#    torch.distributed group; rank 0 broadcasts. On GPUs this is NCCL over NVLink or
#    InfiniBand, what veRL and OpenRLHF do; here it is gloo over TCP. Many small tensors would
#    pay the collective's fixed cost many times, so tensors travel in **buckets**: both sides
#    plan the same buckets from the same list of names, shapes and dtypes, and only the flat
#    buffers move.
# 2. **Ray's object store.** Rank 0 puts its weights in the store once; every rollout worker
#    gets them from there (Ray copies them between nodes). Simpler, no process group to set
#    up, but it serializes and copies through shared memory and the network stack: the
#    comparison below measures what that costs.

# %%
# | export minirl/sync/broadcast.py
"""Bucketed broadcast of named tensors over a torch.distributed group: the wire under stage 6's weight sync.

One sender (the trainer's rank 0, which holds every tensor whole) and any number of
receivers (rollout workers), all members of one process group: gloo between CPU processes,
NCCL between GPUs. Both sides plan the same buckets from the same metadata (names, shapes,
dtypes: `tensor_metadata`, `plan_buckets`), so only flat buffers travel: one `broadcast`
per bucket of at most `bucket_bytes` bytes of one dtype. Fewer, larger messages pay the
collective's fixed latency fewer times; the limit bounds the memory of the flat copy (veRL
and OpenRLHF bucket their NCCL weight updates the same way).

Simplified: the sender holds full tensors (an FSDP or tensor-parallel trainer gathers its
shards first, notebook 04); tensors travel in the trainer's dtype (the engine casts them on
load); tied weights travel once per name.
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

# %% [markdown]
# The buckets, and the two ends of the broadcast. Both ends call `plan_buckets` on the same
# metadata and so agree on the buckets without sending them; the sender checks every tensor
# against the plan and broadcasts one flat buffer per bucket, the receivers rebuild the
# tensors as views of theirs.

# %%
# | export minirl/sync/broadcast.py
def plan_buckets(metadata: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors in buckets of one dtype and at most `bucket_bytes` bytes (a larger tensor goes alone).

    Sender and receivers call this with the same arguments and so agree on the buckets
    without sending them.
    """
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


def send_buckets(named: dict[str, Tensor], buckets: list[list[TensorMeta]], src: int, group=None) -> int:
    """Broadcast every bucket from this process (global rank `src`); returns the bytes sent."""
    sent = 0
    for bucket in buckets:
        for meta in bucket:
            if tuple(named[meta.name].shape) != meta.shape or named[meta.name].dtype != meta.dtype:
                raise ValueError(f"send_buckets: {meta.name} is {tuple(named[meta.name].shape)} "
                                 f"{named[meta.name].dtype}, but the receivers expect {meta.shape} {meta.dtype}")
        flat = torch.cat([named[meta.name].detach().reshape(-1) for meta in bucket])     # [sum of numel]
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_buckets(buckets: list[list[TensorMeta]], src: int, group=None, device="cpu") -> list[tuple[str, Tensor]]:
    """Receive every bucket broadcast by global rank `src`; the named tensors, as views of the flat buffers."""
    named = []
    for bucket in buckets:
        flat = torch.empty(sum(meta.numel for meta in bucket), dtype=bucket[0].dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        for meta, piece in zip(bucket, flat.split([meta.numel for meta in bucket]), strict=True):
            named.append((meta.name, piece.view(meta.shape)))
    return named

# %% [markdown]
# On the driver's side a sync is an object with stage 1's `push(named_weights, engine,
# version) -> SyncReport`. `rl_step` calls it with `roles.actor.named_weights()`; for an
# actor on workers that is only a handle (`RemoteWeights`, section 7): the weights never pass
# through the driver.

# %%
# | export minirl/controller/weight_sync.py
"""Weight syncs between workers, behind stage 1's `WeightSync` protocol.

`push(named_weights, engine, version) -> SyncReport`, as in stage 1; `named_weights` is the
actor group's `RemoteWeights` handle and `engine` the rollout group's `EngineGroup` proxy,
so the weights move from worker to worker and never through the driver:

- `CollectiveSync` (disaggregated, per-role): trainer rank 0 broadcasts, bucketed, over a
  torch.distributed group spanning it and the rollout workers (gloo; NCCL on GPUs);
- `ObjectStoreSync` (for comparison): trainer rank 0 puts its weights in Ray's object store
  once; each rollout worker gets them from there;
- `LocalSync` (colocated): each worker copies its own actor's weights into its own engine.

Every push ends with stage 1's check: each engine reports the version pushed.
"""

import time

from minirl.controller.worker_group import gather
from minirl.sync.base import SyncReport, check_pushed
from minirl.sync.broadcast import plan_buckets


class CollectiveSync:
    """Bucketed broadcast from trainer rank 0 to every rollout worker over the "sync" process group."""

    def __init__(self, actor_group, engine_group, bucket_bytes: int = 32 << 20):
        self.actor_group, self.engine_group = actor_group, engine_group
        metadata = actor_group.run("weight_metadata", [()] + [None] * (len(actor_group) - 1))[0]
        self.buckets = plan_buckets(metadata, bucket_bytes)
        self.tensors, self.bytes = len(metadata), sum(meta.nbytes for meta in metadata)
        self.src = actor_group.world_ranks[0]

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        sender = (self.actor_group, 0, self.actor_group.workers[0].send_weights.remote(self.buckets, self.src))
        receivers = [(self.engine_group, rank, worker.recv_weights.remote(self.buckets, self.src, version))
                     for rank, worker in enumerate(self.engine_group.workers)]
        results = gather([sender, *receivers], "sync (broadcast)")
        engine.confirm(results[1:])
        check_pushed(engine, version)
        return SyncReport(version, self.tensors, self.bytes, time.perf_counter() - start)

# %% [markdown]
# The other two: through Ray's object store (for comparison: no process group, but the
# weights are serialized and copied), and in-process on every worker when the actor and the
# rollout share it (colocated).

# %%
# | export minirl/controller/weight_sync.py
class ObjectStoreSync:
    """Trainer rank 0 puts its weights in Ray's object store; every rollout worker gets them from there."""

    def __init__(self, actor_group, engine_group):
        self.actor_group, self.engine_group = actor_group, engine_group

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        put = self.actor_group.run("put_weights", [()] + [None] * (len(self.actor_group) - 1))[0]
        versions = self.engine_group.run("receive", [(put["ref"], version)] * len(self.engine_group))
        engine.confirm(versions)
        check_pushed(engine, version)
        return SyncReport(version, put["tensors"], put["bytes"], time.perf_counter() - start)


class LocalSync:
    """Colocated: every worker copies its own actor's weights into its own engine, in-process."""

    def __init__(self, group):
        self.group = group

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        reports = self.group.run("local_sync", [(version,)] * len(self.group))
        engine.confirm([r.version for r in reports])
        check_pushed(engine, version)
        return SyncReport(version, reports[0].tensors, reports[0].bytes, time.perf_counter() - start)

# %% [markdown]
# ## 6. Placement: which pool hosts each role
#
# A placement maps every role to a pool. Roles that map to the same pool share its workers:
# one process per device hosts all of them, and they take turns on the device (that is what
# colocation means here, as in veRL's fused workers). Three placements cover the source's
# designs, and the `--pools` flag of the chapter script sizes them (`actor=2,rollout=1+1`:
# the pool hosting the actor gets 2 devices on one node, the rollout's pool one device on
# each of two nodes):
#
# | placement | pools | who shares a worker | weight sync |
# |---|---|---|---|
# | colocated | `shared` | all five roles | in-process copy on every worker |
# | disaggregated | `train`, `rollout` | actor + reference + critic; rollout + reward | broadcast (or object store) |
# | per-role | one per role | nobody: each role its own Ray actors (OpenRLHF) | broadcast (or object store) |
#
# A placement is checked against the run's config before any actor starts: every role the
# algorithm needs (a reference only with a KL penalty, a critic only for PPO) must have a
# pool, and the batch must split into whole groups across each pool's data-parallel ranks.
# The three layouts are names the chapter's `--placement` takes, so they join the light module:

# %%
# | export minirl/controller/names.py
LAYOUTS = {
    "colocated": {role: "shared" for role in ROLES},
    "disaggregated": {"actor": "train", "reference": "train", "critic": "train", "rollout": "rollout",
                      "reward": "rollout"},
    "per-role": {role: role for role in ROLES},
}
PLACEMENTS = tuple(LAYOUTS)

# %%
# | export minirl/controller/placement.py
"""Placement: which pool hosts each role; three layouts, one Driver.

Roles mapped to one pool share its workers (one process per device hosts them all and they
take turns on it); roles on different pools run in different processes, on different
devices. `make_placement(kind, sizes, device)` builds one of three layouts:

| kind | pools | roles |
|---|---|---|
| colocated | shared | every role (veRL's hybrid engine: actor and rollout on the same devices) |
| disaggregated | train, rollout | actor, reference, critic on train; rollout and reward on rollout |
| per-role | one per role | each role its own group of Ray actors (OpenRLHF) |

`check_placement(placement, config)` runs before any actor starts: every role the
algorithm needs has a pool, and the batch splits into whole groups across every pool's
ranks. Errors name the role, the pool and the numbers.
"""

from dataclasses import dataclass

from minirl.controller.names import LAYOUTS, PLACEMENTS, ROLES
from minirl.controller.resource_pool import ResourcePool
from minirl.runtime.validate import ConfigError, check_choice

SPLIT_ROLES = ("actor", "critic", "reference", "rollout")   # roles whose pool splits the batch by rank


@dataclass
class Placement:
    """A pool for every role: `roles` maps role -> pool name, `pools` pool name -> ResourcePool."""

    name: str
    pools: dict[str, ResourcePool]
    roles: dict[str, str]

    def roles_on(self, pool: str, needed=ROLES) -> list[str]:
        return [role for role in needed if self.roles.get(role) == pool]

    def describe(self, needed=ROLES) -> str:
        pools = dict.fromkeys(self.roles[r] for r in needed if r in self.roles)
        return f"{self.name}: " + "; ".join(f"{pool} {self.pools[pool].devices_per_node} {self.pools[pool].device} "
                                            f"({', '.join(self.roles_on(pool, needed))})"
                                            for pool in pools if pool in self.pools)

# %% [markdown]
# Which roles a configuration needs, and the --pools flag parsed into each role's devices per
# node.

# %%
# | export minirl/controller/placement.py
def needed_roles(config) -> list[str]:
    """The roles a run of `config` uses: actor, rollout, reward; a reference with beta > 0; a critic for PPO."""
    roles = ["actor", "rollout", "reward"]
    if config.algorithm.beta > 0:
        roles.append("reference")
    if config.algorithm.algo == "ppo":
        roles.append("critic")
    return roles


def parse_pools(text: str | None) -> dict[str, list[int]]:
    """"actor=2,rollout=1+1" -> {"actor": [2], "rollout": [1, 1]}: devices per node of each role's pool."""
    sizes = {}
    for item in filter(None, (text or "").split(",")):
        role, _, counts = item.partition("=")
        try:
            sizes[role.strip()] = [int(c) for c in counts.split("+")]
        except ValueError:
            raise ConfigError("pools", text, f"{item!r} is not role=N or role=N+M (devices on each node), "
                                             "e.g. actor=2,rollout=1+1") from None
        if min(sizes[role.strip()]) < 1:
            raise ConfigError("pools", text, f"role {role.strip()!r} is given 0 devices; a pool needs at least 1 "
                                             "on each node it spans: use N >= 1, or leave the role out (1 device)")
    return sizes

# %% [markdown]
# One of the three placements built from the --pools sizes, and a placement checked against
# a configuration before anything starts: every role it needs has a pool, and the batch
# splits into whole groups across each pool's ranks.

# %%
# | export minirl/controller/placement.py
def make_placement(kind: str, sizes: dict[str, list[int]] | None = None, device: str = "cpu",
                   cpus_per_device: float = 0.25) -> Placement:
    """The `kind` layout with one device per pool unless `sizes` ({role: devices per node}) says otherwise.

    Roles that share a pool must be given the same size (or only one of them a size). A pool
    that hosts only the reward stays on CPUs: a verifier needs no GPU.
    """
    check_choice("placement", kind, PLACEMENTS)
    layout, sizes = LAYOUTS[kind], dict(sizes or {})
    unknown = sorted(set(sizes) - set(ROLES))
    if unknown:
        raise ConfigError("pools", unknown[0], f"not a role; the roles are {', '.join(ROLES)}")
    pools = {}
    for pool in dict.fromkeys(layout.values()):
        roles = [role for role in ROLES if layout[role] == pool]
        given = {role: sizes[role] for role in roles if role in sizes}
        if len({tuple(v) for v in given.values()}) > 1:
            raise ConfigError("pools", given, f"the roles {', '.join(given)} share the pool {pool!r} in the {kind} "
                                              "placement; give them one size")
        pool_device = "cpu" if roles == ["reward"] else device
        pools[pool] = ResourcePool(next(iter(given.values()), [1]), pool_device, cpus_per_device)
    return Placement(kind, pools, dict(layout))


def check_placement(placement: Placement, config) -> dict[str, list[str]]:
    """{pool name: the roles it hosts} for the roles `config` needs; raises ConfigError first if a role
    has no pool, or if the batch does not split across a pool's ranks."""
    needed = needed_roles(config)
    for role in needed:
        pool = placement.roles.get(role)
        if pool is None or pool not in placement.pools:
            why = "no pool" if pool is None else f"pool {pool!r}, which the placement does not define"
            raise ConfigError("placement", placement.name,
                              f"role {role!r} (needed by algo={config.algorithm.algo!r}, beta={config.algorithm.beta}) "
                              f"has {why}; map it to one of {sorted(placement.pools)}")
    used = {}
    for role in needed:
        used.setdefault(placement.roles[role], []).append(role)
    B = config.run.prompts_per_step
    for pool, roles in used.items():
        n = placement.pools[pool].size
        if any(r in SPLIT_ROLES for r in roles) and B % n:
            raise ConfigError("prompts_per_step", B,
                              f"{B} prompts per step (groups of {config.sampling.num_generations} completions) do "
                              f"not split into equal parts of whole groups across the {n} workers of pool {pool!r} "
                              f"({', '.join(roles)}); use a prompts_per_step that is a multiple of {n}, or a pool "
                              f"whose size divides {B}")
    return used

# %% [markdown]
# ## 7. The Driver
#
# ### 7.1 The roles as the driver sees them
#
# Stage 1's `rl_step` takes `roles` (an actor with `logprobs`, `update`, `named_weights`; a
# reference; a critic), an `engine` (`version`, `generate`, `load_weights`) and a `sync`
# (`push`). The driver gives it objects with exactly those methods, each forwarding the call
# to the workers that host the role with an explicit dispatch mode. That is the whole trick
# of the single controller: the algorithm is written once, as if everything ran here, and
# the proxies decide where it runs.
#
# | proxy | stage 1's methods | how the call goes out |
# |---|---|---|
# | `ActorGroup` | `logprobs`, `update`, `named_weights`, `state_dict`, `load_state_dict`, `.model` | split by rank and concatenate; split and reduce the metrics; a handle; rank 0; to all |
# | `ReferenceGroup` | `logprobs` | split by rank, concatenate |
# | `CriticGroup` | `values`, `update`, `state_dict`, `load_state_dict` | as the actor |
# | `EngineGroup` | `version`, `generate`, `load_weights` | prompts split by rank, Rollouts concatenated |
# | `RemoteReward` | a reward function, TRL's signature | completions split across the reward workers |
#
# Two details keep the results equal to stage 1's. **Sampling seeds:** a stage-1 engine
# draws one seed from the loop's generator per `generate`. `EngineGroup` hands rollout worker
# r a copy of the generator in the state it has after r draws and then advances the driver's
# generator by as many draws as there are workers: with one rollout worker the completions
# are exactly stage 1's, with more each worker's shard has its own seed and the driver's
# generator still moves by a fixed amount per step (so a resumed run draws the same prompts).
# **The driver's copy of the policy** (`ActorGroup.model`): evaluation and checkpoints use
# a copy of the weights in the driver, fetched from rank 0 whenever the workers have updated
# since it was last read; stage 1's `restore_checkpoint` loads a checkpoint into that copy
# and then calls `load_state_dict`, which sends the copy's weights and the optimizer state
# to every rank.

# %%
# | export minirl/controller/proxies.py
"""The roles as the driver sees them: stage 1's methods, run on WorkerGroups.

`rl_step` calls `roles.actor.update(exp)`, `engine.generate(...)`, `reward(prompts,
completions, **columns)`; the objects here forward each call to the workers that host the
role, with an explicit dispatch mode, and return what stage 1's objects return:

- `ActorGroup`: logprobs (DP_COMPUTE), update (DP_UPDATE: the ranks reduce their metrics
  together, stage 4's `reduce_metrics`, and return one record), named_weights (a
  `RemoteWeights` handle), state_dict (RANK_ZERO), load_state_dict (every rank), `.model`
  (the driver's copy);
- `ReferenceGroup`: logprobs (DP_COMPUTE);
- `CriticGroup`: values (DP_COMPUTE), update (DP_UPDATE), state_dict, load_state_dict;
- `EngineGroup`: version, generate (prompts split by rank, one generator per rank),
  load_weights (every rank);
- `RemoteReward`: a reward function with TRL's signature (completions split across the
  reward workers).

Sampling: rollout worker r gets a copy of the loop's generator as it is after r seed draws,
and the driver's generator advances by one draw per worker; with one rollout worker the
completions are stage 1's. The driver keeps a copy of the policy (`ActorGroup.model`),
refreshed from rank 0 when the workers have updated since it was last read: evaluation,
checkpoints and `restore_checkpoint` use it.
"""

import copy

import ray

from minirl.controller.worker_group import DP_COMPUTE, DP_UPDATE, RANK_ZERO, split_by_rank
from minirl.data import Batch
from minirl.rollout.base import VersionMismatchError, draw_seed


class RemoteWeights:
    """The actor's named weights, left on its workers: a sync between workers moves them without the
    driver; iterating fetches rank 0's (for a sync that needs them in the driver's process)."""

    def __init__(self, group):
        self.group = group

    def __iter__(self):
        return iter(self.group.run("named_weights", [("actor",)] + [None] * (len(self.group) - 1))[0])

# %% [markdown]
# The actor's proxy: data-parallel logprobs and updates, a handle for its weights, and the
# driver's copy of the policy, fetched from rank 0 only when it is read after an update.

# %%
# | export minirl/controller/proxies.py
class ActorGroup:
    """The actor role on a WorkerGroup, with stage 1's Actor methods."""

    def __init__(self, group, model):
        self.group, self._model, self._fresh = group, model, True

    @property
    def model(self):
        """The driver's copy of the policy, refreshed from rank 0 if the workers have updated since."""
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

    def state_dict(self) -> dict:
        return self.group.execute(RANK_ZERO, "actor", "state_dict")

    def load_state_dict(self, state: dict) -> None:
        """The optimizer state, and the driver's copy's weights, into every rank."""
        weights = ray.put(self.model.state_dict())
        self.group.run("restore", [("actor", weights, state)] * len(self.group))

# %% [markdown]
# The other roles' proxies, first the reference and the critic: data-parallel like the actor.

# %%
# | export minirl/controller/proxies.py
class ReferenceGroup:
    def __init__(self, group):
        self.group = group

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "reference", "logprobs", rollout)


class CriticGroup:
    def __init__(self, group):
        self.group = group

    def values(self, rollout):
        return self.group.execute(DP_COMPUTE, "critic", "values", rollout)

    def update(self, exp) -> dict:
        return self.group.execute(DP_UPDATE, "critic", "update", exp)

    def state_dict(self) -> dict:
        return self.group.execute(RANK_ZERO, "critic", "state_dict")

    def load_state_dict(self, state: dict) -> None:
        self.group.run("restore", [("critic", {}, state)] * len(self.group))

# %% [markdown]
# The rollout workers as one engine (prompts split by rank, each worker its own copy of the
# generator, as 7.1 says), and each reward function as a callable that splits the completions
# across the reward workers.

# %%
# | export minirl/controller/proxies.py
class EngineGroup:
    """The rollout workers as one RolloutEngine: prompts split by rank, Rollouts concatenated."""

    def __init__(self, group):
        self.group, self.version = group, 0

    def generate(self, prompts, sampling, expected_version=None, generator=None):
        calls = []
        for (part,) in split_by_rank(len(self.group), list(prompts)):
            calls.append(("rollout", "generate", part, sampling, expected_version, copy.deepcopy(generator)))
            draw_seed(generator)                  # the driver's generator moves on by the draw that worker makes
        return Batch.concat(self.group.run("call", calls))

    def load_weights(self, named_tensors, version: int) -> None:
        ref = ray.put(list(named_tensors))
        self.confirm(self.group.run("receive", [(ref, version)] * len(self.group)))

    def confirm(self, versions: list[int]) -> None:
        """The versions the workers report after a sync: all equal, or VersionMismatchError."""
        if len(set(versions)) != 1:
            raise VersionMismatchError(f"rollout workers of {self.group.name} hold versions {versions} after a sync; "
                                       "each must load every push")
        self.version = versions[0]


class RemoteReward:
    """Reward function `index` of the reward workers, callable with TRL's signature from the driver."""

    def __init__(self, group, index: int, name: str):
        self.group, self.index, self.__name__ = group, index, name

    def __call__(self, prompts, completions, **columns) -> list[float]:
        N, n = len(completions), len(self.group)
        bounds = [(r * N // n, (r + 1) * N // n) for r in range(n)]      # contiguous, as equal as N allows
        calls = [("reward", "score", self.index, prompts[a:b], completions[a:b],
                  {k: v[a:b] for k, v in columns.items()}) if b > a else None for a, b in bounds]
        return [x for part in self.group.run("call", calls) for x in part]

# %% [markdown]
# ### 7.2 The Driver
#
# The Driver builds everything from a config and a placement, in an order that fails early:
# check the placement against the config, plan it against the cluster's nodes, and only then
# reserve devices and start workers; if anything goes wrong after that, every worker and
# reservation made so far is removed before the error reaches you. It joins the workers that
# hold models into one torch.distributed world (gloo, or NCCL when every such pool is on
# GPUs), with a data-parallel group per pool and a sync group for the trainer's rank 0 and
# the rollout workers. It puts the policy in Ray's object store once; every worker builds
# its roles from it.
#
# Its step is stage 1's `stage1_step` (draw the prompts, then `rl_step`), and its run is
# stage 1's `run_in_dir`, the very function under stage 1's `train`: the run directory,
# resume, evaluator, JSON-lines logger, checkpointer, progress bar. One check is added after each step: a worker that died while its failure
# was absorbed (a reward worker's, under `reward_errors="zero"`) still stops the run. Its
# weight sync between separate workers is one of section 5's two, by name (the chapter's
# `--sync`):

# %%
# | export minirl/controller/names.py
SYNCS = ("collective", "object_store")   # a bucketed torch.distributed broadcast, or Ray's object store

# %%
# | export minirl/controller/driver.py
"""The Driver: one process runs stage 1's step on role proxies backed by WorkerGroups.

`Driver(config, placement, model, tokenizer, reward_funcs)` checks the placement against
the config (`check_placement`) and the cluster (`plan_placement`) before any actor starts,
reserves each pool's devices, starts one `RoleWorker` per device, joins the workers that
hold models into one torch.distributed world (a data-parallel group per pool, a sync group
spanning trainer rank 0 and the rollout workers), builds the roles on the workers from one
copy of the policy in Ray's object store, and hands `rl_step` the proxies of
`controller/proxies.py` and a weight sync. If any of that fails, whatever was started is
stopped before the error propagates. reward_weights: one per reward function, as stage 1's
(a task's `reward_funcs` and `reward_weights` give the records stage 1 gives for it:
`rewards/<name>` unweighted, the reward trained on weighted). `Driver.train(rows, ...)` is stage 1's `train` with
the Driver's step: stage 1's `run_in_dir` (run directory, callbacks, checkpoints, resume).

The source writes the Driver's loop as sync -> generate -> score -> values -> advantages ->
update actor -> update critic; `rl_step` runs generate -> ... -> update -> sync. It is the
same cycle cut one stage later: the sync that ends step k is the first stage of the source's
iteration k + 1 (`driver_cycles` re-cuts a run's records that way).

Simplified vs veRL's RayPPOTrainer: batches pass through the driver (veRL too, as futures of
`DataProto`); no tensor or pipeline parallelism inside a role; one world for all workers.
"""

import uuid

import ray
import torch

from minirl.controller.names import SYNCS
from minirl.controller.placement import Placement, check_placement
from minirl.controller.proxies import ActorGroup, CriticGroup, EngineGroup, ReferenceGroup, RemoteReward
from minirl.controller.resource_pool import PlacementError, cluster_nodes, plan_placement, release, reserve
from minirl.controller.roles import RoleWorker
from minirl.controller.weight_sync import CollectiveSync, LocalSync, ObjectStoreSync
from minirl.controller.worker_group import WorkerDiedError, WorkerGroup, gather
from minirl.runtime.model_loading import check_prompts
from minirl.runtime.validate import check_choice
from minirl.tasks.rewards import reward_name
from minirl.train.run import RunState, run_in_dir, stage1_step
from minirl.train.step import Roles

MODEL_ROLES = ("actor", "critic", "reference", "rollout")      # roles whose workers join the torch.distributed world
SOURCE_ORDER = ("sync", "generate", "score", "reference", "advantages", "update", "update_critic")  # the source's

# %% [markdown]
# Building a run's workers, in the order just described (check, plan, reserve, start, join the
# world, set up the roles, build the proxies), and tearing them down.

# %%
# | export minirl/controller/driver.py
class DriverSetup:
    """Pools, workers, the torch.distributed world, role proxies and a weight sync for one run (Driver's half
    that builds and tears down; `Driver` adds the loop)."""

    def __init__(self, config, placement: Placement, model, tokenizer, reward_funcs, *, sync: str = "collective",
                 bucket_bytes: int = 32 << 20, threads: int = 1, name: str | None = None,
                 reserve_timeout: float = 60.0, reward_weights: list[float] | None = None):
        check_choice("sync", sync, SYNCS)
        if reward_weights is not None and len(reward_weights) != len(reward_funcs):
            raise ValueError(f"reward_weights has {len(reward_weights)} weights for {len(reward_funcs)} reward "
                             "functions: give one weight per function")
        self.config, self.placement, self.tokenizer = config, placement, tokenizer
        self.reward_weights = None if reward_weights is None else list(reward_weights)   # stage 1's score weighs
        self.name = name or f"minirl-{uuid.uuid4().hex[:6]}"                 # workers are named "<name>/<pool>-<rank>"
        self.used = check_placement(placement, config)                      # {pool: roles}, before anything starts
        self.nodes = cluster_nodes()
        pools = {pool: placement.pools[pool] for pool in self.used}
        try:
            self.plan = plan_placement(pools, self.nodes)
        except PlacementError as err:
            raise PlacementError(f"{err}; the placement was {placement.describe(list(self.roles_needed()))}") from None
        self.groups, self._reserved = {}, []
        try:
            for pool, roles in self.used.items():
                groups = reserve(pool, pools[pool], [self.nodes[i]["node_id"] for i in self.plan[pool]],
                                 reserve_timeout)
                self._reserved += groups
                self.groups[pool] = WorkerGroup(pool, pools[pool], groups, roles, RoleWorker, prefix=f"{self.name}/",
                                                nodes=self.plan[pool], threads=threads)
            self._join_world()
            self.model = model.to("cpu").eval()                              # the driver's copy of the policy
            shared = ray.put(self.model)
            gather([(group, rank, worker.setup.remote(group.roles, config, shared, tokenizer, reward_funcs))
                    for group in self.groups.values() for rank, worker in enumerate(group.workers)], "setup")
            self._build_proxies(reward_funcs, sync, bucket_bytes)
        except BaseException:
            self.shutdown()
            raise

    def roles_needed(self):
        return [role for roles in self.used.values() for role in roles]

    def group_of(self, role: str) -> WorkerGroup:
        return self.groups[self.placement.roles[role]]

# %% [markdown]
# The world and the proxies. The workers whose roles hold a model join one torch.distributed
# world (NCCL only when all of them are on GPUs), with a data-parallel group per pool and, when
# the actor and the rollout live apart, a sync group of trainer rank 0 and the rollout
# workers; then come the role proxies and the weight syncs the placement allows.

# %%
# | export minirl/controller/driver.py
@add_to_class(DriverSetup)
def _join_world(self) -> None:
    members = [g for g in self.groups.values() if any(r in MODEL_ROLES for r in g.roles)]
    world = [(group, rank) for group in members for rank in range(len(group))]
    backend = "nccl" if all(g.pool.device == "gpu" for g in members) else "gloo"
    address = gather([(world[0][0], 0, world[0][0].workers[0].free_address.remote())], "free_address")[0]
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
    self.roles = Roles(ActorGroup(actor, self.model),
                       ReferenceGroup(self.group_of("reference")) if "reference" in needed else None,
                       CriticGroup(self.group_of("critic")) if "critic" in needed else None)
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
# What the pictures of 7.3 draw, read from the workers: the node and device of every rank of
# every role, and the calls each worker ran.

# %%
# | export minirl/controller/driver.py
@add_to_class(DriverSetup)
def where(self) -> dict[str, list[str]]:
    """role -> "node<i>/<device><j>" for each of its ranks (roles on one worker share a device)."""
    slots, devices = {}, {}
    for group in self.groups.values():
        for rank, info in enumerate(group.run("where", [()] * len(group))):
            node = group.node_of[rank]
            if info["device"] == "cpu":
                slots[node] = slots.get(node, -1) + 1
                devices[group.name, rank] = f"node{node}/cpu{slots[node]}"
            else:
                devices[group.name, rank] = f"node{node}/{info['device']}"
    return {role: [devices[group.name, rank] for rank in range(len(group))]
            for group in self.groups.values() for role in group.roles}


@add_to_class(DriverSetup)
def timeline(self) -> dict[str, list[tuple[str, float, float]]]:
    """"<pool>[rank]" -> the (what, start, end) calls that worker ran, wall-clock seconds."""
    return {f"{group.name}[{rank}]": events for group in self.groups.values()
            for rank, events in enumerate(group.run("timeline", [()] * len(group)))}

# %% [markdown]
# Teardown: every worker stopped and every reservation released, safe to call twice (the
# constructor calls it when the setup fails halfway); in a `with` block, at its end.

# %%
# | export minirl/controller/driver.py
@add_to_class(DriverSetup)
def shutdown(self) -> None:
    """Stop every worker and release every reservation (safe to call twice)."""
    for group in getattr(self, "groups", {}).values():
        group.shutdown()
    release(getattr(self, "_reserved", []))
    self.groups, self._reserved = {}, []


@add_to_class(DriverSetup)
def __enter__(self):
    return self


@add_to_class(DriverSetup)
def __exit__(self, *exc):
    self.shutdown()

# %% [markdown]
# The Driver's loop, on what `DriverSetup` built: stage 1's step, with the check for a dead
# worker after it, and stage 1's run (`run_in_dir`) with that step.

# %%
# | export minirl/controller/driver.py
class Driver(DriverSetup):
    """The single controller: stage 1's step and run on the workers, proxies and sync that DriverSetup built."""

    def step(self, state: RunState) -> dict:
        """Stage 1's step (prompts, then rl_step). A worker that died during it stops the run with a
        WorkerDiedError, also when the step wrapped the failure (a reward function's error) or absorbed
        it (reward_errors="zero")."""
        try:
            record = stage1_step(state)
        except Exception as err:
            self._stop_if_dead(state, err)
            raise
        self._stop_if_dead(state)
        return record

    def _stop_if_dead(self, state: RunState, cause: BaseException | None = None) -> None:
        for group in self.groups.values():
            if group.dead is not None:
                what = group.death.what if group.death is not None else f"{group.describe(group.dead)} died"
                raise WorkerDiedError(f"{what}, in step {state.step + 1}") from cause

    def train(self, rows: list[dict], *, eval_fn=None, out_dir=None, resume: bool = False, overwrite: bool = False,
              progress: bool = True, stop_after: int | None = None, extra_callbacks: tuple = (),
              run_info: dict | None = None) -> list[dict]:
        """Stage 1's `train` on this Driver's workers: config.run.steps steps; one record per step.

        eval_fn(model) -> accuracy 0..1 runs on the driver's copy of the policy; out_dir: run.json,
        metrics.jsonl, checkpoints/ and final/ there, as in stage 1 (resume=True continues the
        run from its newest intact checkpoint). The driver's model holds the final weights after.
        """
        config = self.config
        if not rows or "prompt" not in rows[0]:
            raise ValueError("rows: pass dataset rows like {'prompt': '27+35=', 'answer': 62}")
        check_prompts(self.tokenizer, [r["prompt"] for r in rows], getattr(self.model.config,
                      "max_position_embeddings", None), config.sampling.max_completion_length)   # as stage 1's train
        state = RunState(config, self.roles, self.engine, self.sync, torch.Generator().manual_seed(config.run.seed),
                         list(rows), self.reward_funcs, self.reward_weights)
        info = {"placement": self.placement.name, **(run_info or {})}
        records = run_in_dir(state, self.step, self.tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite,
                             eval_fn=eval_fn, progress=progress, label=self.placement.name,
                             extra_callbacks=extra_callbacks, stop_after=stop_after, run_info=info)
        self.roles.actor.model                                           # noqa: B018 -- refresh the driver's copy
        return records

# %% [markdown]
# The source's order and `rl_step`'s are the same cycle, cut at different places: the
# weights `rl_step` pushes at the end of step k are what the source's iteration k + 1 starts
# by synchronizing. The third exercise (6.3) re-cuts a run's records into the source's
# iterations, so that a table of stage times reads in the source's order.

# %%
# | export minirl/controller/driver.py
def driver_cycles(records: list[dict]) -> list[dict[str, float]]:
    """A run's per-step records re-cut into the source's Driver iterations, stage seconds in SOURCE_ORDER.

    records: the records of a run in step order; records without "time/generate" (the
    step-0 evaluation record) are skipped. rl_step's step k ends with the sync that makes
    the weights of step k + 1, which the source counts as the first stage of its iteration
    k + 1. So iteration k's "sync" is step k-1's "time/sync" (0.0 for the first iteration:
    the weights it uses were loaded before the run), and its other stages are step k's
    "time/<stage>" values. Returns one dict per step whose keys follow SOURCE_ORDER and
    include only the stages present in the records ("update_critic" only for PPO; "sync"
    always). The last step's sync starts an iteration that never ran and is left out.
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

# %%
# | export minirl/controller/driver.py
def source_stage_shares(records: list[dict]) -> dict[str, float]:
    """stage -> its share (0..1) of the steps' total time, in SOURCE_ORDER; "other" is what no stage timed."""
    steps = [r for r in records if "time/generate" in r]
    total = sum(r["time/step"] for r in steps) or 1.0
    shares = {stage: sum(r.get(f"time/{stage}", 0.0) for r in steps) / total for stage in SOURCE_ORDER
              if any(f"time/{stage}" in r for r in steps)}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares

# %% [markdown]
# ### 7.3 Where the roles ran, and when they were busy
#
# Two pictures tell a placement apart: which node and device each role landed on, and a
# timeline of every worker's calls, colored by role. Both come from the workers themselves
# (`Driver.where()`, `Driver.timeline()`).

# %%
# | export minirl/controller/plots.py
"""Pictures of a placement: role -> node -> device, and timelines of what each worker ran (stages 6 and 7)."""

import matplotlib.pyplot as plt

ROLE_COLORS = {"actor": "tab:blue", "rollout": "tab:orange", "reward": "tab:green", "reference": "tab:purple",
               "critic": "tab:red", "sync": "tab:gray"}


def last_steps_of(timelines: dict[str, list[tuple[str, float, float]]], steps: int) -> dict:
    """The calls that started after the `steps`-th last generate of the first rollout worker (all of them when
    it generated fewer times)."""
    generates = next(([s for what, s, _ in events if what == "rollout.generate"]
                      for events in timelines.values() if any(w == "rollout.generate" for w, _, _ in events)), [])
    since = sorted(generates)[-steps] if len(generates) >= steps else float("-inf")
    return {worker: [e for e in events if e[1] >= since] for worker, events in timelines.items()}


def plot_timelines(panels: dict[str, dict[str, list[tuple[str, float, float]]]], colors: dict[str, str], path=None,
                   *, first: str | None = None, max_rows: int | None = None, panel_height: float | None = None,
                   xlabel: str = "seconds"):
    """The one timeline plot (stages 6 and 7): a panel per timeline ({title: {worker: [(what, start, end)]}}),
    a row per worker, a bar per event colored by `colors[what before its first "."]` ("actor.update" -> the
    actor's color, "train" -> train's; black if unnamed).

    first: the worker on the top row (the others follow in their order); max_rows: at most this many rows per
    panel; panel_height: inches per panel (default 0.2 + 0.45 per row). Time starts at each panel's first bar.
    """
    rows_of = {title: ([first] if first is not None else []) + [w for w in workers if w != first]
               for title, workers in panels.items()}
    rows_of = {title: names[:max_rows] if max_rows else names for title, names in rows_of.items()}
    height = 1.2 + sum(panel_height or 0.2 + 0.45 * len(names) for names in rows_of.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height), squeeze=False)
    for ax, (title, workers) in zip(axes[:, 0], panels.items(), strict=True):
        names = rows_of[title]
        t0 = min((s for w in names for _, s, _ in workers.get(w, [])), default=0.0)
        seen = set()
        for y, who in enumerate(names):
            for what, start, end in workers.get(who, []):
                kind = what.split(".")[0]
                ax.barh(y, max(end - start, 1e-4), left=start - t0, height=0.6, color=colors.get(kind, "black"),
                        label=None if kind in seen else kind)
                seen.add(kind)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set(title=title, xlabel=xlabel)
        if seen:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig

# %% [markdown]
# The placement picture: nodes side by side, a column per device, the roles it hosts stacked
# in it.

# %%
# | export minirl/controller/plots.py
def plot_placement(where: dict[str, list[str]], path=None, title: str = "placement"):
    """Nodes side by side, their devices as columns, each device listing the roles it hosts."""
    devices = sorted({d for ds in where.values() for d in ds}, key=lambda d: (d.split("/")[0], d))
    hosted = {d: [role for role, ds in where.items() if d in ds] for d in devices}
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(devices), 2.8))
    nodes = sorted({d.split("/")[0] for d in devices})
    for x, device in enumerate(devices):
        node = nodes.index(device.split("/")[0])
        ax.add_patch(plt.Rectangle((x - 0.45, -0.5), 0.9, 4.6, fill=False, ec="black", lw=0.8))
        ax.text(x, 4.25, device.split("/")[1], ha="center", va="center", fontsize=9)
        ax.add_patch(plt.Rectangle((x - 0.5, -0.6), 1.0, 5.3, fill=True, alpha=0.06, color=f"C{node}"))
        for y, role in enumerate(hosted[device]):
            ax.add_patch(plt.Rectangle((x - 0.4, 3.2 - 0.8 * y), 0.8, 0.65, color=ROLE_COLORS.get(role, "black"),
                                       alpha=0.8))
            ax.text(x, 3.52 - 0.8 * y, role, ha="center", va="center", color="white", fontsize=9)
    for node in nodes:
        xs = [x for x, d in enumerate(devices) if d.startswith(node + "/")]
        ax.text((xs[0] + xs[-1]) / 2, 4.95, node, ha="center", fontsize=10, weight="bold")
    ax.set(xlim=(-0.7, len(devices) - 0.3), ylim=(-0.8, 5.3), title=title)
    ax.axis("off")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig

# %% [markdown]
# ## 8. Same algorithm, different placement
#
# The claim of the single controller: placement decides where the roles run, never what
# they compute. We run the same configuration with the same seed in one process (stage 1's
# `train`) and on the workers in three placements, and compare every metric of every step.
# With one rollout worker the engines draw the same seeds, so the samples are the same; the
# updates then run the same arithmetic in other processes. The per-role run also places its
# actor on a pool that **spans both nodes**: two data-parallel ranks, one per node, whose
# gradients DDP all-reduces over gloo. There the update is the same up to the order of float
# sums; without the token-share weighting of section 4 it would be another update. The
# colocated run uses PPO with a KL penalty, so all five roles (critic and reference
# included) share its one worker.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.controller.driver import Driver  # noqa: E402
from minirl.controller.placement import make_placement  # noqa: E402
from minirl.controller.weight_sync import CollectiveSync  # noqa: E402
from minirl.train.run import train  # noqa: E402

STEPS = 3 if SMOKE else 10
rows = task.rows("train")
grpo = RLConfig.from_flat(steps=STEPS, prompts_per_step=8, num_generations=8, eval_every=0)
ppo = grpo.replace(algo="ppo", beta=0.04)


def fresh_policy():
    """A new copy of the warm-started policy (every run trains its own)."""
    return load_default_policy(progress=False)[0]


reference = {"grpo": train(grpo, fresh_policy(), tokenizer), "ppo": train(ppo, fresh_policy(), tokenizer)}
runs = {}
plans = [("colocated", ppo, make_placement("colocated")),
         ("disaggregated", grpo, make_placement("disaggregated")),
         ("per-role", grpo, make_placement("per-role", {"actor": [1, 1]}))]
sync_times = {}
for name, config, placement in plans:
    started = time.perf_counter()
    print(f"{name}: starting its workers ...", flush=True)
    with Driver(config, placement, fresh_policy(), tokenizer, rewards) as driver:
        up = time.perf_counter() - started
        records = driver.train(rows)
        runs[name] = {"records": records, "timeline": driver.timeline(), "where": driver.where(), "config": config,
                      "workers": sum(len(g) for g in driver.groups.values()), "startup": up}
        if name == "disaggregated":      # section 5's comparison, on these workers: interleaved pushes
            actor_group, rollout_group = driver.group_of("actor"), driver.group_of("rollout")
            syncs = {"broadcast, 32 MiB buckets": driver.syncs["collective"],
                     "broadcast, 64 KiB buckets": CollectiveSync(actor_group, rollout_group, 64 << 10),
                     "object store": driver.syncs["object_store"]}
            for _ in tqdm(range(5 if SMOKE else 30), desc="the three syncs, in turn"):
                for label, sync in syncs.items():
                    report = sync.push(driver.roles.actor.named_weights(), driver.engine, driver.roles.version)
                    sync_times.setdefault(label, []).append((report.seconds, report.bytes))
            buckets = {label: len(sync.buckets) for label, sync in syncs.items() if hasattr(sync, "buckets")}


def max_difference(records, expected) -> float:
    """The largest |difference| over every numeric metric of every step (timings excluded)."""
    return max(abs(r[k] - e[k]) for r, e in zip(records, expected, strict=True) for k in e
               if not k.startswith("time/") and isinstance(e[k], (int, float)))


print(f"{'placement':>14} | algo | workers | start-up | steps | max |metric - stage 1|")
for name, result in runs.items():
    algo = result["config"].algorithm.algo
    diff = max_difference(result["records"], reference[algo])
    print(f"{name:>14} | {algo:>4} | {result['workers']:7d} | {result['startup']:6.1f} s | {len(result['records']):5d} | "
          f"{diff:.2e} {'(identical)' if diff == 0 else '(float rounding)' if diff < 1e-4 else 'DIFFERS'}")
assert all(max_difference(result["records"], reference[result["config"].algorithm.algo]) < 1e-4 for result in runs.values())

# %% [markdown]
# Every metric of every step agrees with the single-process run: the same rewards, losses,
# KL and clip ratios, in every placement (a difference of 0 means bit for bit; the
# data-parallel actor of the per-role run differs at most by float rounding, because two
# ranks add their gradients in another order). The start-up column is what a placement
# costs before its first step: one Python process per worker, each importing torch and
# transformers and building its roles; a Ray cluster reuses its workers for a whole run.
#
# Now the weight syncs of section 5, timed on the disaggregated placement's workers, each
# push of each kind in turn (interleaved, so a busy machine slows all of them alike):

# %%
print(f"{'sync':>26} | buckets | MiB  | median ms | MiB/s")
medians = {}
for label, samples in sync_times.items():
    seconds = sorted(s for s, _ in samples)
    medians[label] = seconds[len(seconds) // 2]
    mib = samples[0][1] / 2**20
    print(f"{label:>26} | {buckets.get(label, '-'):>7} | {mib:4.2f} | {1e3 * medians[label]:9.2f} | "
          f"{mib / medians[label]:6.0f}")
fast, slow = medians["broadcast, 32 MiB buckets"], medians["object store"]
print(f"object store / broadcast: {slow / fast:.1f}x the time; small buckets / large: "
      f"{medians['broadcast, 64 KiB buckets'] / fast:.1f}x")
for name, result in runs.items():
    steps = [r for r in result["records"] if "time/sync" in r]
    share = sum(r["time/sync"] for r in steps) / sum(r["time/step"] for r in steps)
    print(f"sync share of the step, {name}: {100 * share:.1f} %: {'above' if share > 0.05 else 'at or below'} the "
          "source's 5 % threshold for a slow sync")

# %% [markdown]
# Both ways move the same bytes (the policy's float32 tensors); the table says which is
# faster here and by how much. On this machine the three processes share two CPUs, so a
# "network" transfer is a copy between processes through the loopback (gloo) or shared
# memory (Ray's object store); on GPUs NCCL's broadcast runs over NVLink or InfiniBand at
# tens to hundreds of GB/s, and the object store would first copy every tensor to host
# memory, which is why veRL and OpenRLHF synchronize with NCCL collectives. Many small
# buckets pay the collective's fixed cost once per message; the bucket limit trades that
# against the memory of the flat copy. The last lines give the sync's share of each
# placement's step: the colocated sync is a copy inside one process, the others cross
# processes. Compare them with the source's 5 % threshold with care: the tiny policy makes
# every other stage short too, so a share measured here says more about the ratio of copying
# to computing at this size than about a production run.
#
# ## 9. Where the roles ran, and when
#
# The placement of each run, role → node → device. The per-role run's actor spans both
# nodes; the colocated run stacks all five roles on one device.

# %%
from minirl.controller.driver import SOURCE_ORDER, driver_cycles, source_stage_shares  # noqa: E402
from minirl.controller.plots import ROLE_COLORS, last_steps_of, plot_placement, plot_timelines  # noqa: E402

for name, result in runs.items():
    print(f"{name:>14}:", {role: devices for role, devices in result["where"].items()})
    plot_placement(result["where"], title=f"{name}: role -> node -> device")
    plt.show()

# %% [markdown]
# And which role was busy when, on every worker, for the same runs. Colocated, one worker
# does everything in turn; its engine sleeps after generating and wakes in the sync.
# Disaggregated and per-role, each worker waits for the others: the synchronous loop keeps
# one stage busy at a time, which is the idle time that asynchronous RL (notebook 07) goes
# after.

# %%
for name, result in runs.items():
    plot_timelines({f"{name}: which role was busy when, last 2 steps": last_steps_of(result["timeline"], 2)},
                   ROLE_COLORS, xlabel="seconds (wall clock)")
    plt.show()
first = {name: [what for what, _, _ in sorted((e for events in result["timeline"].values() for e in events),
                                               key=lambda e: e[1])] for name, result in runs.items()}
order = [what for what in first["disaggregated"] if what in ("rollout.generate", "reward.score", "actor.update",
                                                              "sync.send")][:4]
print("disaggregated, the first step's calls in order of start:", " -> ".join(order))

# %% [markdown]
# The time of each stage as a share of the step, per placement, in the source's Driver order
# (`other`: the driver's own work between stages, such as sampling prompts):

# %%
print(f"{'placement':>14} | " + " | ".join(f"{s:>9}" for s in (*SOURCE_ORDER, "other")))
for name, result in runs.items():
    shares = source_stage_shares(result["records"])
    print(f"{name:>14} | " + " | ".join(f"{100 * shares[s]:8.1f}%" if s in shares else f"{'-':>9}"
                                       for s in (*SOURCE_ORDER, "other")))

# %% [markdown]
# Two rows of the source's claims can now be checked against what ran:
#
# - **Row 1, the loop order**, generate → reward → update → synchronize: the calls of the
#   disaggregated run's first step, in the order they started on the workers.
# - **Row 7, the Driver's loop**, sync → sample → score → values → advantages → update actor
#   → update critic: the colocated PPO run's records, re-cut into the source's iterations
#   with `driver_cycles` (exercise 6.3). `rl_step`'s "reference" stage is the source's
#   "values": it asks the actor, the reference and the critic for what the update needs,
#   the critic's values among them.

# %%
cycles = driver_cycles(runs["colocated"]["records"])
source_row1 = ["generate", "reward", "update", "synchronize"]
ours_row1 = [{"rollout.generate": "generate", "reward.score": "reward", "actor.update": "update",
              "sync.send": "synchronize"}[w] for w in order]
source_row7 = ["sync", "sample", "score", "values", "advantages", "update actor", "update critic"]
ours_row7 = list(cycles[-1])
row7_agrees = len(ours_row7) == len(source_row7) and ours_row7[0] == "sync" and ours_row7[-1] == "update_critic"
print("row 1, the loop order")
print("  source:", " -> ".join(source_row1))
print("  minirl:", " -> ".join(ours_row1), "|", "agree" if ours_row1 == source_row1 else "DIFFER")
print("row 7, the Driver's stages")
print("  source:", " -> ".join(source_row7))
print("  minirl:", " -> ".join(ours_row7), "|", "agree (rl_step's 'reference' stage computes the values)"
      if row7_agrees else "DIFFER")
print("the colocated run's iterations in the source's order (ms):")
for k, cycle in enumerate(cycles, 1):
    print(f"  iteration {k}: " + ", ".join(f"{stage} {1e3 * seconds:.1f}" for stage, seconds in cycle.items()))

# %% [markdown]
# ## 10. Four orchestration styles, side by side
#
# The source's framework table sorts RL systems by how they orchestrate the loop. All four
# styles run here, on the same step function (`rl_step`) with the same configuration:
#
# 1. **Single process** (TRL): stage 1's `train`, the reference of section 8.
# 2. **Multiple controllers** (NeMo-Aligner): SPMD under `torchrun`. There is no driver;
#    every rank runs the whole loop on its share of the batch, and the ranks meet only in
#    collectives (here DDP's all-reduce inside the update of notebook 04's
#    `DistributedActor`, the very actor of a data-parallel pool in section 4). The script
#    below is notebook 04's run (`setup_spmd`, `spmd_step`) with DDP (zero 0), launched by
#    `minirl.runtime.launch.torchrun`.
# 3. **Single controller** (veRL / HybridFlow): one Driver, WorkerGroups on ResourcePools:
#    the disaggregated run of section 8.
# 4. **Single controller with Ray actor isolation** (OpenRLHF): one Driver, every role its
#    own group of Ray actors: the per-role run of section 8.

# %%
from minirl.runtime.launch import torchrun  # noqa: E402

SPMD = '''
"""Multiple controllers: every rank runs the loop on its share of each batch (launched by torchrun)."""
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
config = RLConfig.from_flat(steps=int(sys.argv[1]), prompts_per_step=8, num_generations=8, eval_every=0)
model, tokenizer, _ = load_default_policy(progress=False)
task = make_task()
state = setup_spmd(config, ParallelConfig(zero=0), model, tokenizer, task.rows("train"), [task.reward], ctx)
for record in run(state, spmd_step, [], config.run.steps):   # DistributedActor (DDP) and rl_step on every rank
    if ctx.is_main:
        print(json.dumps({"step": record["step"], "reward": record["reward"], "time/step": record["time/step"]}))
shutdown()
leave(0)                                                     # exit without the teardown where gloo can abort a rank
'''
spmd_path = RUNS / "06_spmd.py"
spmd_path.parent.mkdir(parents=True, exist_ok=True)
spmd_path.write_text(SPMD)
started = time.perf_counter()
RANKS = 2
proc = torchrun(spmd_path, RANKS, [STEPS], timeout=600)
assert proc.returncode == 0, proc.stdout[-3000:]
spmd = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
spmd_seconds = time.perf_counter() - started
# the source's framework table (facts about other systems), beside the minirl run of each style
SOURCE_STYLES = {"TRL": "single process", "NeMo-Aligner": "multiple controllers",
                 "veRL (HybridFlow)": "single controller", "OpenRLHF": "single controller, Ray actor per role"}
styles = [("TRL", "train(config, model, tokenizer)", 1, reference["grpo"])]
styles.append(("NeMo-Aligner", f"torchrun x{RANKS} -> every rank: rl_step on its shard", RANKS, spmd))
for framework, placement in (("veRL (HybridFlow)", "disaggregated"), ("OpenRLHF", "per-role")):
    run_ = runs[placement]                 # the section-8 run of that placement, and its measured figures
    styles.append((framework, f"Driver({run_['config'].algorithm.algo}, {placement!r}).train(rows)",
                   1 + run_["workers"], run_["records"]))
print(f"{'framework':>17} | {'orchestration':>37} | {'minirl run':>46} | processes | steps | mean reward | s / step")
mean_reward = {}
for framework, code, processes, records in styles:
    mean_reward[framework] = sum(r["reward"] for r in records) / len(records)
    per_step = sum(r["time/step"] for r in records) / len(records)
    print(f"{framework:>17} | {SOURCE_STYLES[framework]:>37} | {code:>46} | {processes:9d} | {len(records):5d} | "
          f"{mean_reward[framework]:11.3f} | {per_step:8.3f}")
all_ran = all(len(records) == STEPS for *_, records in styles)
same_draws = ("TRL", "veRL (HybridFlow)", "OpenRLHF")          # one sampler, the same seeds: the same rewards
spread = max(mean_reward[f] for f in same_draws) - min(mean_reward[f] for f in same_draws)
print(f"row 8, the four orchestration styles: {'agree' if all_ran and spread < 1e-6 else 'DIFFER'} (all four ran "
      f"{STEPS} steps: {all_ran}; mean reward of the single-process and single-controller runs spread by "
      f"{spread:.1e}, rule: < 1e-6; the multiple-controller run samples other draws)")

# %% [markdown]
# The last line is row 8's verdict, computed: all four styles run the one algorithm, and the
# single-process run and both single-controller runs, which draw the same samples (section
# 8), must end with the same mean reward. The multiple-controller run is left out of that
# rule, and should be: its two ranks each sample their half of the prompts from seeds of
# their own (notebook 04), so its completions are other draws. Processes count the driver
# (the torchrun run has none: its ranks). The seconds per step
# say little about the styles themselves at this size: the tiny policy makes every transfer
# between processes a visible share of a step that takes a fraction of a second in one
# process. What the styles change is who holds the loop (one process, every rank, or a driver)
# and how the weights and batches move, which is what the timelines above show.
#
# ## 11. When a worker dies, and when the input is wrong
#
# A worker can die mid-step (a GPU falls off the bus, the kernel kills a process that ran
# out of memory). The driver learns it at once: the worker's pending calls fail, and
# `gather` reports the first failure as it happens, naming the worker's roles, pool and
# rank. The run stops without a checkpoint of the half-done step, every other worker and
# reservation is released, and `resume=True` continues from the last checkpoint, exactly.
# Here a reward function kills its own worker with `ray.kill` on its third call, in the middle
# of step 3 of section 8's GRPO run, now checkpointing every 2 steps; then a new Driver
# resumes the run.

# %%
import shutil  # noqa: E402

from minirl.controller.worker_group import WorkerDiedError  # noqa: E402
from minirl.runtime.io import read_jsonl  # noqa: E402
from minirl.tasks.rewards import reward_name  # noqa: E402

crash = grpo.replace(checkpoint_every=2)                # section 8's GRPO run, with checkpoints
out = RUNS / "06_crash"
shutil.rmtree(out, ignore_errors=True)


def reward_that_kills(kill_at: int):
    """The task's reward, but call `kill_at` kills the worker it runs in (the record of when goes to a file)."""
    calls = []

    def reward(prompts, completions, answer, **columns):
        calls.append(1)
        if len(calls) == kill_at:
            (out / "killed_at").write_text(str(time.time()))
            ray.kill(ray.get_runtime_context().current_actor)
        return task.reward(prompts, completions, answer)
    reward.__name__ = reward_name(rewards[0])          # the records' `rewards/<name>` as the other runs'
    return reward


out.mkdir(parents=True)
try:
    with Driver(crash, make_placement("colocated"), fresh_policy(), tokenizer, [reward_that_kills(3)]) as driver:
        driver.train(rows, out_dir=out, progress=False)
except WorkerDiedError as err:
    noticed = time.time() - float((out / "killed_at").read_text())
    print(f"WorkerDiedError after {noticed:.2f} s: {err}")
print("steps logged before the crash:", [r["step"] for r in read_jsonl(out / "metrics.jsonl")])
print("workers still alive:", ray.util.list_named_actors())
with Driver(crash, make_placement("colocated"), fresh_policy(), tokenizer, rewards) as driver:
    driver.train(rows, out_dir=out, resume=True, progress=False)
resumed = read_jsonl(out / "metrics.jsonl")
uninterrupted = reference["grpo"]                     # section 8's single-process run: the same config, no crash
print("step | reward, resumed run | reward, one uninterrupted process")
for r, u in zip(resumed, uninterrupted, strict=True):
    print(f"{r['step']:4d} | {r['reward']:19.4f} | {u['reward']:.4f}")
gap = max_difference(resumed, uninterrupted)
print(f"max |metric difference|: {gap:.2e}: {'the same records' if gap < 1e-4 else 'DIFFERENT records'} "
      "(section 8's rule: < 1e-4)")
assert gap < 1e-4, "a resumed run must repeat the uninterrupted one"

# %% [markdown]
# The death was reported within the time printed above, naming the worker; the two steps
# before it were kept (their checkpoint), step 3 was neither logged nor saved, and the
# resumed run continued from step 2; the last line compares its records with those of an
# uninterrupted process (the assert holds it to the same records: nothing lost, nothing done
# twice).
#
# Bad input fails before any worker starts (none is left behind either), naming the role, the
# pool and the numbers:

# %%
from minirl.controller.resource_pool import probe  # noqa: E402
from minirl.runtime.validate import ConfigError  # noqa: E402


def attempt(label, fn):
    try:
        fn()
        print(f"{label}: no error?!")
    except (PlacementError, ConfigError, ConnectionError) as err:
        print(f"{label}: {type(err).__name__}: {err}\n")


model_small = fresh_policy()
attempt("a pool larger than the cluster", lambda: Driver(
    grpo.replace(prompts_per_step=9), make_placement("per-role", {"actor": [1, 1, 1]}), model_small, tokenizer,
    rewards))
attempt("a placement that overcommits", lambda: Driver(
    grpo, make_placement("per-role", {"actor": [2], "rollout": [2]}, cpus_per_device=1.0), model_small,
    tokenizer, rewards))
no_critic = make_placement("per-role")
del no_critic.roles["critic"]
attempt("a role with no pool", lambda: Driver(ppo, no_critic, model_small, tokenizer, rewards))
attempt("a batch that does not split", lambda: Driver(
    grpo.replace(prompts_per_step=6), make_placement("per-role", {"actor": [2, 2]}), model_small, tokenizer,
    rewards))
attempt("an address where no cluster listens", lambda: probe("127.0.0.1:9", timeout=2.0))   # what connect() does first
print("workers alive after all that:", ray.util.list_named_actors())

# %% [markdown]
# ## 12. Beyond one machine
#
# Everything above ran on two Ray nodes: the placement plan chose between them, a pool
# spanned both, and the per-role actor's two ranks all-reduced their gradients across them.
# On a real cluster only the start changes. Start Ray on every machine, then run the driver
# on any of them; it joins the cluster and reserves GPUs instead of CPU slots:
#
# ```
# ray start --head --port 6379                      # on the head machine; prints its address
# ray start --address HEAD_IP:6379                  # on every other machine
# python chapters/06_ray.py --address auto --device cuda --placement disaggregated \
#     --pools actor=4+4,rollout=4 --model Qwen/Qwen2.5-0.5B --out runs/06-cluster
# ```
#
# With `--device cuda` every pool that hosts a model reserves one GPU per device (and
# `--cpus-per-device` CPUs beside it), the workers' world uses NCCL, and the reward pool
# stays on CPUs. Every machine needs the same Python environment (minirl installed); the
# driver ships the policy's weights through the object store once, so the model must fit the
# driver's host memory (a production system loads the weights on each worker from shared
# storage). `--address` also accepts the `host:port` that `ray start --head` printed. In full
# mode the cell below runs the chapter script against this notebook's two-node cluster, once
# per placement, for 300 steps (the chapter's default is stage 1's 1000): long enough for
# the held-out accuracy to rise. A bar follows each run's step lines as the script prints them.

# %%
import threading  # noqa: E402


def follow_chapter(cmd: list[str], total: int, desc: str, timeout: float) -> str:
    """Run a chapter script (stdout and stderr together), a tqdm bar following its lines "step N ...";
    returns its whole output. Fails with the output's end if the script failed or ran past `timeout` s."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        with tqdm(total=total, desc=desc) as bar:
            for line in proc.stdout:
                lines.append(line)
                words = line.split()
                if len(words) > 5 and words[0] == "step" and words[1].isdigit():   # step N  T s  reward R ...
                    bar.n = int(words[1])
                    bar.set_postfix_str(" ".join(words[4:6]))
    finally:
        timer.cancel()
    output = "".join(lines)
    why = f"exit {proc.wait()}" + (f", killed after {timeout:.0f} s" if proc.returncode == -9 else "")
    assert proc.returncode == 0, f"{cmd[1]} failed ({why}):\n{output[-3000:]}"
    return output


if SMOKE:
    print("smoke mode: the chapter runs (300 steps per placement) are skipped; the runs of section 8 stand in")
    chapter = {}
else:
    chapter = {}
    for name in ("colocated", "disaggregated", "per-role"):
        target = RUNS / f"06_{name}"
        output = follow_chapter([sys.executable, str(ROOT / "chapters" / "06_ray.py"), "--address", cluster.address,
                                 "--placement", name, "--out", str(target), "--overwrite", "--compare-syncs", "10",
                                 "--steps", "300"],            # of the default 1000: enough to see it learn
                                total=300, desc=name, timeout=1800)
        print(next(line for line in output.splitlines() if "held-out greedy accuracy" in line))
        chapter[name] = json.loads((target / "summary.json").read_text())
    print(f"{'placement':>14} | accuracy before | after | steps | seconds | sync ms | " +
          " | ".join(f"{s:>10}" for s in (*SOURCE_ORDER, "other")))
    for name, summary in chapter.items():
        shares = summary["stage_shares"]
        print(f"{name:>14} | {summary['accuracy_before']:15.3f} | {summary['accuracy_after']:5.3f} | "
              f"{summary['steps']:5d} | {summary['seconds']:7.0f} | {1e3 * summary['sync_seconds']:7.1f} | "
              + " | ".join(f"{100 * shares[s]:9.1f}%" if s in shares else f"{'-':>10}"
                           for s in (*SOURCE_ORDER, "other")))
    assert all(s["accuracy_after"] > s["accuracy_before"] for s in chapter.values()), "every placement learns"
    same = len({s["accuracy_after"] for s in chapter.values()}) == 1
    print("the three placements end at", "the same accuracy" if same else "different accuracies")

# %% [markdown]
# In full mode the table above shows each placement learning from the same warm start (the
# held-out accuracy rises in all three), with its stage shares and the sync's milliseconds
# per step. The last line says whether the three runs also end at the same accuracy: they
# should, since each reproduces the single-process run step for step (section 8), so their
# policies are the same; what differs between them is only the time, and where it goes.
#
# ## What to take away
#
# - One algorithm, written once (`rl_step`), runs in one process, under torchrun, or from a
#   driver on Ray workers; the driver only hands it proxies with the same methods.
# - A placement is a map from roles to pools, planned against the cluster before anything
#   starts. Colocated roles take turns on the same devices (the engine frees its memory while
#   the trainer works); disaggregated roles run in their own processes and pay a weight sync.
# - The pieces are reusable, and notebook 07 (asynchronous RL) builds on them: rollout
#   workers that produce continuously into a bounded queue, and weights pushed while they
#   generate. What it can take as is: `WorkerGroup.run` / `execute` with a dispatch mode and
#   `gather` (which reports a dead worker at once); `RoleWorker.call(role, method, ...)` for
#   any role method, with its timeline; `EngineGroup.generate`, which gives each rollout
#   worker its own generator; and the syncs' `push`, which moves the weights worker to worker.
#   What it must add: a Ray actor runs one method at a time, so a rollout worker that keeps
#   generating while new weights arrive needs a second thread (Ray's `max_concurrency`) or
#   a generation loop that checks for new weights between batches; and the driver's loop
#   becomes a consumer of the queue instead of `stage1_step`.
#
# ## Exercises
#
# Your stubs are in `exercises/06_ray_controller.py`; grade them with
#
# ```
# python -m minirl.grade --only 06
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 6.1 | `plan_placement` | first fit in order, distinct nodes per pool, what earlier pools took, fractional CPUs, GPUs |
# | 6.2 | `split_by_rank` | contiguous equal parts, whole groups, the batch back by concatenation, errors |
# | 6.3 | `driver_cycles` | the sync moved to the next iteration, the source's order, skipped evaluation records |
#
# Questions to think about (not graded): on the per-role placement the rollout worker waits
# while the actor trains, and the actor waits while the rollout generates. How would you
# change the driver's loop so that both stay busy, and what does the batch lose (notebook 07)?
# The object-store sync copies the weights once per receiver: how does its time grow with the
# number of rollout workers, and how would a broadcast's?

# %%
ray.shutdown()
cluster.shutdown()
