"""A stage-6 worker's ends of the broadcast sync and of the colocated in-process copy.

Hand-written (worker-side plumbing; notebook 06 teaches the wire, `minirl.sync.broadcast`'s
`plan_buckets`, `send_buckets` and `recv_buckets`, and the driver's side of both syncs,
`minirl.controller.weight_sync`). `SyncEnds` is a base of stage 6's `RoleWorker`, whose
`roles` hold an "actor" and/or a "rollout", whose `groups` hold the "sync" subgroup (trainer
rank 0 and every rollout worker) and whose `record` adds a call to the worker's timeline:

- `weight_metadata()`: name, shape and dtype of every actor weight (both ends plan the same
  buckets from it).
- `send_weights(buckets, src)` on trainer rank 0: checks the weights still match the plan,
  then broadcasts them bucket by bucket over the sync group; the bytes sent.
- `recv_weights(buckets, src, version)` on a rollout worker: receives the broadcast and loads
  it into the engine; the engine's version (the driver checks they all agree).
- `local_sync(version)`, colocated: copies this worker's actor weights into its own engine
  (stage 1's `InProcessSync`); its `SyncReport`.

`one_version(group_name, versions)`: the one version every rollout worker reports after a sync
(the driver's `EngineGroup.confirm`), or `VersionMismatchError` naming them all.

The driver's end: `RemoteWeights(group)`, what the driver's `ActorGroup.named_weights()` returns
and hands to a sync's `push`. It leaves the weights on the workers (a sync between workers moves
them without the driver); only iterating it fetches trainer rank 0's weights to the driver.
"""

from minirl.rollout.base import VersionMismatchError
from minirl.sync.base import InProcessSync
from minirl.sync.broadcast import recv_buckets, send_buckets, tensor_metadata


def check_matches(named: dict, buckets: list) -> None:
    """Every tensor has the shape and dtype the receivers planned with, or ValueError naming it."""
    for bucket in buckets:
        for meta in bucket:
            x = named[meta.name]
            if tuple(x.shape) != meta.shape or x.dtype != meta.dtype:
                raise ValueError(f"send_weights: {meta.name} is {tuple(x.shape)} {x.dtype}, but "
                                 f"the receivers expect {meta.shape} {meta.dtype}")


class SyncEnds:
    """A worker's ends of the broadcast and of the in-process copy (see the module docstring)."""

    def weight_metadata(self) -> list:
        return tensor_metadata(self.roles["actor"].named_weights())

    def send_weights(self, buckets, src: int) -> int:
        """Trainer rank 0: broadcast the actor's weights, bucket by bucket, to the sync group."""
        with self.record("sync.send"):
            named = dict(self.roles["actor"].named_weights())
            check_matches(named, buckets)
            return send_buckets(named, buckets, src, self.groups["sync"])

    def recv_weights(self, buckets, src: int, version: int) -> int:
        """A rollout worker: receive the broadcast, load it into the engine; the engine's version."""
        with self.record("sync.recv"):
            device = "cuda" if self.device == "gpu" else "cpu"
            named = recv_buckets(buckets, src, self.groups["sync"], device)
            self.roles["rollout"].load_weights(named, version)
            return self.roles["rollout"].version

    def local_sync(self, version: int):
        """Colocated: copy this worker's actor weights into its own engine, in-process."""
        with self.record("sync.local"):
            named = self.roles["actor"].named_weights()
            return InProcessSync().push(named, self.roles["rollout"], version)


class RemoteWeights:
    """The actor's named weights, left on its workers; iterating fetches rank 0's."""

    def __init__(self, group):
        self.group = group

    def __iter__(self):
        rank0 = [("actor",)] + [None] * (len(self.group) - 1)
        return iter(self.group.run("named_weights", rank0)[0])


def one_version(group_name: str, versions: list[int]) -> int:
    """The version all rollout workers hold after a sync, or VersionMismatchError."""
    if len(set(versions)) != 1:
        raise VersionMismatchError(f"rollout workers of {group_name} hold versions {versions} "
                                   "after a sync; each must load every push")
    return versions[0]
