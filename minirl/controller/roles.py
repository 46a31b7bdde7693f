# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The five roles of the RL loop as Ray workers: Actor, Rollout, Critic, Reference, Reward.

A `RoleWorker` is one process on one device of a pool. It hosts the roles its pool was
given and answers `call(role, method, *args)` with stage 1's own objects, built as stage 1
builds them: `Actor`, `Reference`, `Critic` (minirl.roles), any engine behind the
`RolloutEngine` protocol (`build_engine`), and the reward functions (`RewardRole`). So a
change of placement cannot change what is computed.

Around the roles a worker adds data parallelism (`DataParallelActor`/`DataParallelCritic`:
DDP over the group's process group, each rank's gradient weighted by its share of the
batch's tokens so that W ranks update as one process does), colocation (`SleepingEngine`:
an engine that shares a worker with the actor frees its weights after generating and gets
them back from the next sync), and the worker side of the weight syncs (send, receive, put
in the object store, copy in-process).

Simplified: a data-parallel rank holds a full replica (no FSDP sharding, notebook 04); a
non-finite loss on one rank makes that rank skip its backward while the others wait in the
all-reduce until the world's timeout, which then stops the run with an error.
"""

__all__ = ["ROLES", "rank_share", "Share", "weighted_all_reduce", "wrap_ddp", "DataParallelActor",
           "DataParallelCritic", "SleepingEngine", "RewardRole", "moved", "build_role",
           "RoleWorker"]

import contextlib
import copy

import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minirl.controller.worker import Worker
from minirl.data import Batch
from minirl.models.critic import ValueModel
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.base import Colocated
from minirl.sync.base import InProcessSync
from minirl.sync.broadcast import recv_buckets, send_buckets, tensor_metadata
from minirl.train.run import build_engine
from minirl.utils.seeding import seed_everything

ROLES = ("actor", "rollout", "reward", "reference", "critic")


def rank_share(mask: torch.Tensor, loss_type: str, group) -> float:
    """This rank's weight in the sum of the ranks' gradients.

    "dapo" divides by the tokens of the whole batch (TRL's `num_items_in_batch`): the weight
    is this rank's tokens / all ranks' tokens. The others average equal shares, 1 / world
    size: "grpo" and "dr_grpo" normalize per row (every rank holds as many rows), and "bnpo"
    by each rank's own tokens (TRL's definition, which is where bnpo and dapo part).
    """
    if loss_type != "dapo":
        return 1.0 / dist.get_world_size(group)
    tokens = mask.sum().to(torch.float64).reshape(1)                          # [1], on the mask's device (NCCL)
    total = tokens.clone()
    dist.all_reduce(total, group=group)
    return (tokens / total.clamp(min=1)).item()


class Share:
    """The state of the communication hook: this rank's weight for the next backward."""

    def __init__(self, group):
        self.group, self.weight = group, None


def weighted_all_reduce(share: Share, bucket):
    """DDP communication hook: sum over ranks of (this rank's share x its gradient), not their mean."""
    buffer = bucket.buffer().mul_(share.weight)
    work = dist.all_reduce(buffer, group=share.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model, group) -> tuple[DistributedDataParallel, Share]:
    share = Share(group)
    ddp = DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(share, weighted_all_reduce)
    return ddp, share


class DataParallelActor(Actor):
    """Stage 1's Actor on one data-parallel rank: the model in DDP, the gradient weighted by this rank's share."""

    def __init__(self, model, algorithm, optimizer, sampling, group):
        super().__init__(model, algorithm, optimizer, sampling)
        self.module = model                                     # the plain model: its weights have the usual names
        self.model, self.share = wrap_ddp(model, group)

    def update(self, exp) -> dict:
        self.share.weight = rank_share(exp.rollout.completion_mask, self.algorithm.loss_type, self.share.group)
        return super().update(exp) | {"dp/tokens": exp.rollout.completion_mask.sum().item()}

    def named_weights(self):
        return self.module.state_dict().items()


class DataParallelCritic(Critic):
    """Stage 1's Critic on one data-parallel rank, the same way."""

    def __init__(self, value_model, algorithm, optimizer, group):
        super().__init__(value_model, algorithm, optimizer)
        self.module = value_model
        self.model, self.share = wrap_ddp(value_model, group)

    def update(self, exp) -> dict:
        self.share.weight = rank_share(exp.rollout.completion_mask, self.algorithm.loss_type, self.share.group)
        return super().update(exp) | {"dp/tokens": exp.rollout.completion_mask.sum().item()}

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class SleepingEngine:
    """A colocated engine: it sleeps after every generate and wakes when the next weights arrive.

    With the engine's own `sleep()`/`wake_up()` (the `Colocated` protocol, e.g. vLLM's), those
    are used. Otherwise the engine's `.model` drops its weights (`to("meta")`, as vLLM's
    level-2 sleep discards them) and gets empty ones back on wake-up, which the load that
    follows fills; non-persistent buffers (rotary frequencies) are kept aside meanwhile.
    `freed_bytes` is what the last sleep released. `record(what)`: a context manager that
    times the sleeps and wake-ups (the worker's timeline).
    """

    def __init__(self, engine, record=None):
        self.engine, self.record = engine, record or (lambda what: contextlib.nullcontext())
        self.asleep, self.freed_bytes, self._buffers = False, 0, {}

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, *args, **kwargs):
        if self.asleep:
            raise RuntimeError("generate: the colocated engine is asleep; push the trainer's weights first "
                               "(its next load_weights wakes it)")
        rollout = self.engine.generate(*args, **kwargs)
        self.sleep()
        return rollout

    def sleep(self) -> None:
        with self.record("rollout.sleep"):
            self._sleep()
        self.asleep = True

    def wake_up(self) -> None:
        with self.record("rollout.wake_up"):
            self._wake_up()
        self.asleep = False

    def _sleep(self) -> None:
        if isinstance(self.engine, Colocated):
            self.engine.sleep()
        else:
            model = self.engine.model
            self.freed_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            self._device = next(model.parameters()).device
            self._buffers = {name: b.clone() for name, b in model.named_buffers()}
            model.to("meta")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()                   # hand the freed blocks back to the device

    def _wake_up(self) -> None:
        if isinstance(self.engine, Colocated):
            self.engine.wake_up()
        else:
            model = self.engine.model
            model.to_empty(device=self._device)            # uninitialized: the next load_weights fills them
            for name, buffer in self._buffers.items():
                model.get_buffer(name).copy_(buffer)
            if hasattr(model, "tie_weights"):
                model.tie_weights()                        # to("meta") unties shared embeddings

    def load_weights(self, named_tensors, version: int) -> None:
        if self.asleep:
            self.wake_up()
        self.engine.load_weights(named_tensors, version)

    def named_weights(self):
        return self.engine.named_weights()


class RewardRole:
    """The reward functions (TRL signature), where the reward worker runs."""

    def __init__(self, reward_funcs):
        self.funcs = list(reward_funcs)

    def score(self, index: int, prompts: list, completions: list, columns: dict) -> list[float]:
        return list(self.funcs[index](prompts=prompts, completions=completions, **columns))


def moved(value, device):
    """`value` with every tensor (inside Batches, dicts, lists and tuples too) on `device`.

    Batches arrive from the driver on the CPU and results go back on the CPU: the driver may
    have no GPU, and a CUDA tensor cannot be unpickled without one.
    """
    if isinstance(value, (torch.Tensor, Batch)):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    return value


def build_role(name: str, config, model, tokenizer, reward_funcs, group=None):
    """One role, as stage 1 builds it; `group`: the data-parallel process group when the pool has > 1 rank."""
    algo, opt, sampling = config.algorithm, config.optimizer, config.sampling
    if name == "actor":
        return DataParallelActor(model, algo, opt, sampling, group) if group else Actor(model, algo, opt, sampling)
    if name == "critic":
        value = ValueModel.from_policy(model)
        return DataParallelCritic(value, algo, opt, group) if group else Critic(value, algo, opt)
    if name == "reference":
        return Reference(model, sampling.temperature)
    if name == "rollout":
        return build_engine(config, model, tokenizer)
    if name == "reward":
        return RewardRole(reward_funcs)
    raise ValueError(f"role {name!r}: the roles are {', '.join(ROLES)}")


class RoleWorker(Worker):
    """A worker that hosts roles of the RL loop; roles on one worker share its process and device."""

    def setup(self, roles: list[str], config, model, tokenizer, reward_funcs=()) -> dict[str, str]:
        seed_everything(config.run.seed)
        self.torch_device = torch.device(config.run.device)
        model = copy.deepcopy(model).to(self.torch_device).eval()
        group = self.groups.get(f"dp:{self.group}") if self.size > 1 else None
        order = ("reference", "critic", "actor", "rollout", "reward")   # the copies first, then the actor trains
        self.roles = {name: build_role(name, config, model, tokenizer, reward_funcs, group)
                      for name in order if name in roles}
        if "actor" in self.roles and "rollout" in self.roles:              # colocated: take turns on the device
            self.roles["rollout"] = SleepingEngine(self.roles["rollout"], self.record)
        return {name: type(role).__name__ for name, role in self.roles.items()}

    def call(self, role: str, method: str, *args, **kwargs):
        """`self.roles[role].method(*args, **kwargs)`, recorded in the timeline as "role.method".

        Tensor arguments move to this worker's device, tensor results back to the CPU.
        """
        with self.record(f"{role}.{method}"):
            result = getattr(self.roles[role], method)(*moved(args, self.torch_device), **kwargs)
            return moved(result, "cpu")

    def named_weights(self, role: str = "actor") -> list:
        """The role's weights by name, on the CPU (what the driver's copy and a checkpoint hold)."""
        with self.record(f"{role}.named_weights"):
            return [(name, t.detach().cpu()) for name, t in self.roles[role].named_weights()]

    def restore(self, role: str, weights: dict, state: dict) -> None:
        """Load a checkpoint's weights and optimizer state into the actor (weights {} for other roles)."""
        target = self.roles[role]
        if weights:
            getattr(target, "module", target.model).load_state_dict(weights)
        target.load_state_dict(state)

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

        The ref travels inside a dict, so Ray hands it over as a ref; passed on as a top-level
        argument, it is resolved to the weights in the receiving worker.
        """
        with self.record("sync.put"):
            named = [(name, t.detach().cpu()) for name, t in self.roles["actor"].named_weights()]
            return {"ref": ray.put(named), "tensors": len(named),
                    "bytes": sum(t.numel() * t.element_size() for _, t in named)}

    def receive(self, named_tensors, version: int) -> int:
        """A rollout worker: load these weights (resolved from the object store by Ray); the engine's version."""
        with self.record("sync.receive"):
            self.roles["rollout"].load_weights(named_tensors, version)
            return self.roles["rollout"].version

    def local_sync(self, version: int):
        """Colocated: copy this worker's actor weights into this worker's engine (stage 1's InProcessSync)."""
        with self.record("sync.local"):
            return InProcessSync().push(self.roles["actor"].named_weights(), self.roles["rollout"], version)
