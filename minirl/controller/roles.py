# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The five roles of the RL loop as Ray workers: stage 1's own objects, built as stage 1 does.

A `RoleWorker` hosts the roles of its pool and answers `call(role, method, *args)`, so a change
of placement cannot change what is computed. Simplified: a data-parallel rank holds a full
replica (stage 4's DDP roles; no FSDP sharding inside a pool).
"""

__all__ = ["RewardRole", "build_role", "RoleWorker"]

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
