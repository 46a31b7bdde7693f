# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Weight syncs between workers, behind stage 1's `push(named_weights, engine, version)`:
a bucketed broadcast, or (colocated) an in-process copy on every worker; the weights move
worker to worker, never through the driver (the object store: `runtime.object_store_sync`).
"""

__all__ = ["CollectiveSync", "LocalSync"]

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
