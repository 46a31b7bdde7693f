# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
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

__all__ = ["MODEL_ROLES", "SOURCE_ORDER", "DriverSetup", "Driver", "driver_cycles",
           "source_stage_shares"]

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

    def timeline(self) -> dict[str, list[tuple[str, float, float]]]:
        """"<pool>[rank]" -> the (what, start, end) calls that worker ran, wall-clock seconds."""
        return {f"{group.name}[{rank}]": events for group in self.groups.values()
                for rank, events in enumerate(group.run("timeline", [()] * len(group)))}

    def shutdown(self) -> None:
        """Stop every worker and release every reservation (safe to call twice)."""
        for group in getattr(self, "groups", {}).values():
            group.shutdown()
        release(getattr(self, "_reserved", []))
        self.groups, self._reserved = {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


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


def source_stage_shares(records: list[dict]) -> dict[str, float]:
    """stage -> its share (0..1) of the steps' total time, in SOURCE_ORDER; "other" is what no stage timed."""
    steps = [r for r in records if "time/generate" in r]
    total = sum(r["time/step"] for r in steps) or 1.0
    shares = {stage: sum(r.get(f"time/{stage}", 0.0) for r in steps) / total for stage in SOURCE_ORDER
              if any(f"time/{stage}" in r for r in steps)}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares
