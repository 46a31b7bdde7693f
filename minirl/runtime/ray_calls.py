"""Ray worker plumbing: waiting on workers (a worker that died named at once), and where a worker runs.

Hand-written (it teaches nothing about RL; notebook 06 teaches the workers and groups this
serves). `WorkerInfo` is a base of stage 6's `Worker`: `where()` (its group, rank, node,
device, process id) and `free_address()` (a free port on its node, where the torch.distributed
world of all workers meets). `moved(value, device)` is what crosses between the driver and a
worker: batches arrive on the CPU and go to the worker's device, results go back on the CPU
(the driver may have no GPU, and a CUDA tensor cannot be unpickled without one).

Every `ray.get` of stage 6's driver on a worker goes through `gather(calls, what)`: it takes
the calls as they finish, so a worker that dies is reported at once, even while its peers
are still blocked in a collective waiting for it (they are killed when the driver shuts the
groups down).

- A dead worker: Ray raises one of several errors when the process behind a call is gone
  (`DEATHS`: killed, crashed, its node lost, or killed by Ray's memory monitor); `died` turns
  each into a `WorkerDiedError` that names the worker's roles, group, rank and node (from its
  group's `describe(rank)`), and says so when Ray's memory monitor killed it. The group keeps
  the rank (`group.dead`) and the error (`group.death`), so the driver can stop the run after
  a step that absorbed the failure.
- An exception raised in a worker raises as itself, with a note saying where it was raised.
"""

import os
import socket

import ray
import torch

from minirl.data import Batch


def moved(value, device):
    """`value` with every tensor (inside Batches, dicts, lists and tuples too) on `device`."""
    if isinstance(value, (torch.Tensor, Batch)):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    return value


class WorkerInfo:
    """Where a worker (a Ray actor with `group` and `rank`) runs, and an address its world can meet at."""

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


def gather(calls: list[tuple], what: str) -> list:
    """The results of (group, rank, ref) calls (group: a WorkerGroup) in the order given; the first failure
    raises when it happens.

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
