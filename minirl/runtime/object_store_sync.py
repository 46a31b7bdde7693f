"""Stage 6's weight sync through Ray's object store: the comparison beside the bucketed broadcast.

Hand-written (notebook 06 teaches the broadcast, `minirl.controller.weight_sync.CollectiveSync`,
and times this one beside it). Trainer rank 0 puts its weights in Ray's object store once;
every rollout worker gets them from there (Ray copies them between nodes). No process group
to set up, but every tensor is serialized and copied through shared memory and the network
stack (on GPUs, first to host memory), which is why veRL and OpenRLHF sync with NCCL.

- `ObjectStoreEnds`, a base of stage 6's `RoleWorker`: `put_weights()` on trainer rank 0,
  `receive(named_tensors, version)` on a rollout worker (also how the driver's
  `EngineGroup.load_weights` hands a worker weights).
- `ObjectStoreSync(actor_group, engine_group)`: stage 1's `push(named_weights, engine, version)`
  -> `SyncReport`, ending with stage 1's check that every engine holds the version pushed.
"""

import time

import ray

from minirl.sync.base import SyncReport, check_pushed


class ObjectStoreEnds:
    """A worker's two ends of the object-store sync (its `roles` hold an "actor" or a "rollout")."""

    def put_weights(self) -> dict:
        """Trainer rank 0: the actor's weights into Ray's object store; {"ref", "tensors", "bytes"}.

        The ref travels inside a dict, so Ray hands it over as a ref (a top-level ref argument
        would be resolved to the weights in the receiving worker)."""
        with self.record("sync.put"):
            named = [(name, t.detach().cpu()) for name, t in self.roles["actor"].named_weights()]
            return {"ref": ray.put(named), "tensors": len(named),
                    "bytes": sum(t.numel() * t.element_size() for _, t in named)}

    def receive(self, named_tensors, version: int) -> int:
        """A rollout worker: load these weights (resolved from the object store by Ray); the engine's version."""
        with self.record("sync.receive"):
            self.roles["rollout"].load_weights(named_tensors, version)
            return self.roles["rollout"].version


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
