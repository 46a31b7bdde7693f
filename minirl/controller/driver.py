# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The Driver: one process runs stage 1's step on role proxies backed by WorkerGroups.

Simplified vs veRL's RayPPOTrainer: batches pass through the driver (veRL too, as futures of
`DataProto`); no tensor or pipeline parallelism inside a role; one world for all workers.
"""

__all__ = ["MODEL_ROLES", "SOURCE_ORDER", "DriverSetup", "Driver", "driver_cycles"]

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


def driver_cycles(records: list[dict]) -> list[dict[str, float]]:
    """A run's per-step records re-cut into the source's Driver iterations, seconds in SOURCE_ORDER.

    Records (in step order) without "time/generate" (the step-0 evaluation) are skipped. Step
    k ends with the sync the source counts as the start of iteration k + 1: iteration k's
    "sync" is step k-1's "time/sync" (0.0 for the first), its other stages step k's
    "time/<stage>". One dict per step, keys in SOURCE_ORDER, only the stages present ("sync"
    always; "update_critic" only for PPO). The last step's sync is left out.
    """
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
