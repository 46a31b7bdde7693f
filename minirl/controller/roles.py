# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The five roles of the RL loop as Ray workers: stage 1's own objects, built as stage 1 builds them.

A `RoleWorker` hosts the roles of its pool and answers `call(role, method, *args)`, so a change
of placement cannot change what is computed. Simplified: a data-parallel rank holds a full
replica (stage 4's DDP roles; no FSDP sharding inside a pool).
"""

__all__ = ["RewardRole", "moved", "build_role", "RoleWorker"]

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
from minirl.runtime.role_checkpoints import RestoringWorker
from minirl.runtime.seeding import seed_everything
from minirl.sync.base import InProcessSync
from minirl.sync.broadcast import recv_buckets, send_buckets, tensor_metadata


class RewardRole:
    """The reward functions (TRL signature), where the reward worker runs."""

    def __init__(self, reward_funcs):
        self.funcs = list(reward_funcs)

    def score(self, index: int, prompts: list, completions: list, columns: dict) -> list[float]:
        return list(self.funcs[index](prompts=prompts, completions=completions, **columns))


def moved(value, device):
    """`value` with every tensor (inside Batches, dicts, lists, tuples too) on `device` (results go
    back on the CPU: the driver may have no GPU)."""
    if isinstance(value, (torch.Tensor, Batch)):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    return value


def build_role(name: str, config, model, tokenizer, reward_funcs, group: ProcessGroup | None = None):
    """One role, as stage 1 builds it; with `group` (the pool's ranks) stage 4's DDP actor and critic."""
    algo, opt, sampling = config.algorithm, config.optimizer, config.sampling
    if name == "actor":
        if group is None:
            return Actor(model, algo, opt, sampling)
        return DistributedActor(wrap_model(model, 0, group.device, process_group=group.group), algo, opt,
                                sampling, group)
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


class RoleWorker(Worker, RestoringWorker):
    """A worker that hosts roles of the RL loop; roles on one worker share its process and device.

    From `RestoringWorker` (minirl/runtime/role_checkpoints.py): `restore`, for checkpoints."""

    def setup(self, roles: list[str], config, model, tokenizer, reward_funcs=()) -> dict[str, str]:
        seed_everything(config.run.seed)
        self.torch_device = torch.device(config.run.device)
        model = copy.deepcopy(model).to(self.torch_device).eval()
        ranks = self.groups.get(f"dp:{self.group}") if self.size > 1 else None   # pools holding models
        group = ProcessGroup(self.torch_device, ranks) if ranks is not None else None
        order = ("reference", "critic", "actor", "rollout", "reward")   # the copies first, then the actor
        self.roles = {name: build_role(name, config, model, tokenizer, reward_funcs, group)
                      for name in order if name in roles}
        if "actor" in self.roles and "rollout" in self.roles:              # colocated: take turns
            self.roles["rollout"] = ColocatedEngine(self.roles["rollout"], stream=False,
                                                    record=lambda what: self.record(f"rollout.{what}"))
        return {name: type(role).__name__ for name, role in self.roles.items()}

    def call(self, role: str, method: str, *args, **kwargs):
        """`self.roles[role].method(*args, **kwargs)`, recorded in the timeline as "role.method"."""
        with self.record(f"{role}.{method}"):
            result = getattr(self.roles[role], method)(*moved(args, self.torch_device), **kwargs)
            return moved(result, "cpu")

    def named_weights(self, role: str = "actor") -> list:
        """The role's weights by name, on the CPU (what the driver's copy and a checkpoint hold)."""
        with self.record(f"{role}.named_weights"):
            return [(name, t.detach().cpu()) for name, t in self.roles[role].named_weights()]

    def weight_metadata(self) -> list:
        return tensor_metadata(self.roles["actor"].named_weights())

    def send_weights(self, buckets, src: int) -> int:
        """Trainer rank 0: broadcast the actor's weights, bucket by bucket, to the sync group."""
        with self.record("sync.send"):
            return send_buckets(dict(self.roles["actor"].named_weights()), buckets, src, self.groups["sync"])

    def recv_weights(self, buckets, src: int, version: int) -> int:
        """A rollout worker: receive the broadcast, load it into the engine; the engine's version."""
        with self.record("sync.recv"):
            device = "cuda" if self.device == "gpu" else "cpu"
            self.roles["rollout"].load_weights(recv_buckets(buckets, src, self.groups["sync"], device), version)
            return self.roles["rollout"].version

    def put_weights(self) -> dict:
        """Trainer rank 0: the actor's weights into Ray's object store; {"ref", "tensors", "bytes"}.

        The ref travels inside a dict, so Ray hands it over as a ref (a top-level ref argument would
        be resolved to the weights in the receiving worker)."""
        with self.record("sync.put"):
            named = [(name, t.detach().cpu()) for name, t in self.roles["actor"].named_weights()]
            return {"ref": ray.put(named), "tensors": len(named),
                    "bytes": sum(t.numel() * t.element_size() for _, t in named)}

    def receive(self, named_tensors, version: int) -> int:
        """A rollout worker: load these weights (resolved from the object store by Ray); the version."""
        with self.record("sync.receive"):
            self.roles["rollout"].load_weights(named_tensors, version)
            return self.roles["rollout"].version

    def local_sync(self, version: int):
        """Colocated: copy this worker's actor weights into its own engine (stage 1's InProcessSync)."""
        with self.record("sync.local"):
            return InProcessSync().push(self.roles["actor"].named_weights(), self.roles["rollout"], version)
