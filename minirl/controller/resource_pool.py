# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
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

__all__ = ["DEVICES", "PlacementError", "ResourcePool", "cluster_nodes", "plan_placement",
           "reserve", "release", "probe", "START_ENV", "AUTH_HINT", "raise_start_waits",
           "token_available", "started", "connect", "local_cluster"]

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
