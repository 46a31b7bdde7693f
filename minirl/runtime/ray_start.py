"""Starting Ray, or joining a cluster, on a machine that may be busy: the plumbing under stage 6's clusters.

Hand-written (it teaches nothing about RL; notebook 06 teaches what runs on the cluster):

- `connect(address)` starts a local cluster of our own (address None), or joins the cluster at
  "auto" or "host:port". An address where nothing listens fails within seconds (`probe`; a bare
  `ray.init` keeps trying much longer). Since Ray 2.60 `ray start --head` turns token
  authentication on, and a driver without the token is refused after about 20 s with a bare
  "Failed to connect": `connect` then tries once more with `RAY_AUTH_MODE=token` when a token
  is at hand (`token_available`), and otherwise names token auth (`AUTH_HINT`).
- `local_cluster(num_nodes, cpus_per_node)` starts Ray's multi-node test cluster on this
  machine: every node a real raylet with its own resources, only the network the loopback.
- `cluster_nodes()`: the alive nodes of the connected cluster, head first, with their total
  CPUs and GPUs: what stage 6's placement plan places pools on.
- Why starting is hard on a busy machine: a raylet gives its dashboard agent (a Python process)
  15 s to write each of its port files and then aborts (fixed in Ray 2.60), and at load 15-20
  on two cores the agent's imports alone take longer. So both starts raise the waits that are
  settings (`START_ENV`, `raise_start_waits`), run Ray's workers at nice 0 instead of Ray's 15
  (beside other work they would get a sliver of a CPU), and retry a failed start (`started`):
  each try at a raised CPU priority where the OS allows it, a failed one cleaned up (what it
  left running killed), after a wait that doubles (2, 4, 8 s).
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


def cluster_nodes() -> list[dict]:
    """The alive nodes of the connected cluster, head first: {"node_id", "CPU", "GPU"} (totals)."""
    nodes = sorted((n for n in ray.nodes() if n["Alive"]),
                   key=lambda n: "node:__internal_head__" not in n["Resources"])
    return [{"node_id": n["NodeID"], "CPU": n["Resources"].get("CPU", 0.0),
             "GPU": n["Resources"].get("GPU", 0.0)} for n in nodes]
