# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Sharded checkpoints of a data-parallel run: torch.distributed.checkpoint, atomic, exactly resumable.

`save_sharded` writes `root/step-000010/`: every rank's model and optimizer shards with DCP
(`get_state_dict` covers DDP, FSDP2 and peft models), ZeRO-1's per-rank optimizer state
(ZeroRedundancyOptimizer is not a DCP optimizer), each rank's RNG and sampling generator
(`rank-N.pt`), and on rank 0 `training_state.pt` (step, version, records, the shared
generator, the settings, the world size). Written to a temporary directory that rank 0
renames into place once every rank is done. `latest_sharded` finds the newest intact one;
`load_sharded` restores it into a freshly built state and pushes the weights to the engine.
`ShardedCheckpoints` hands both to notebook 01's `run_in_dir`.

Simplified vs torchtitan: synchronous saves (no async staging), same world size on resume.
"""

__all__ = ["PREFIX", "TMP", "save_sharded", "intact", "latest_sharded", "load_sharded",
           "ShardedCheckpointer", "ShardedCheckpoints"]

import dataclasses
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from minirl.train.run import Callback
from minirl.utils.rundir import RunDirError
from minirl.utils.validate import ConfigError

PREFIX, TMP = "step-", ".tmp-step-"


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _model_and_optimizer(state):
    """What DCP saves: the model's state, and the optimizer's unless it is ZeRO-1's (saved per rank)."""
    actor = state.roles.actor
    if actor.zero == 1:
        return {"model": get_state_dict(actor.module, [])[0]}
    model_state, optim_state = get_state_dict(actor.module, actor.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _rank_state(state) -> dict:
    actor = state.roles.actor
    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "sampling_generator": state.sampling_generator.get_state(),
            "zero1_optimizer": actor.optimizer.optim.state_dict() if actor.zero == 1 else None}


def save_sharded(root, state, keep: int = 2) -> Path:
    """Every rank: write checkpoint `root/step-{state.step:06d}` (a collective); returns its path."""
    root = Path(root)
    rank = dist.get_rank()
    final, tmp = root / f"{PREFIX}{state.step:06d}", root / f"{TMP}{state.step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_model_and_optimizer(state), checkpoint_id=str(tmp))
    torch.save(_rank_state(state), tmp / f"rank-{rank}.pt")
    dist.barrier()                                        # every rank's files are on disk
    if rank == 0:
        torch.save({"step": state.step, "version": state.roles.version, "metrics": state.metrics,
                    "generator": state.generator.get_state(), "world_size": dist.get_world_size(),
                    "config": dataclasses.asdict(state.config), "pconfig": dataclasses.asdict(state.pconfig)},
                   tmp / "training_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)                            # all of it or none of it
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def intact(path: Path, world_size: int) -> bool:
    """A checkpoint directory with DCP's metadata, the training state and every rank's file."""
    needed = [".metadata", "training_state.pt", *(f"rank-{r}.pt" for r in range(world_size))]
    return all((path / name).is_file() and (path / name).stat().st_size > 0 for name in needed)


def latest_sharded(root, world_size: int) -> Path | None:
    """The newest intact checkpoint under `root` (decided on rank 0, the same on every rank), or None."""
    found = None
    if dist.get_rank() == 0:
        root = Path(root)
        candidates = sorted(root.glob(f"{PREFIX}*"), reverse=True) if root.is_dir() else []
        found = next((str(p) for p in candidates if intact(p, world_size)), None)
    found = _broadcast(found)
    return None if found is None else Path(found)


def load_sharded(path, state) -> None:
    """Restore checkpoint `path` into a freshly built state (every rank), then push the weights to the engine."""
    path = Path(path)
    training = torch.load(path / "training_state.pt", weights_only=False)
    if training["world_size"] != dist.get_world_size():
        raise ConfigError("nproc_per_node", dist.get_world_size(),
                          f"the checkpoint {path} was written by {training['world_size']} ranks; resume with "
                          f"torchrun --nproc_per_node {training['world_size']}")
    actor = state.roles.actor
    target = _model_and_optimizer(state)
    dcp.load(target, checkpoint_id=str(path))
    if actor.zero == 1:
        set_state_dict(actor.module, [], model_state_dict=target["model"], optim_state_dict={})
    else:
        set_state_dict(actor.module, actor.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    mine = torch.load(path / f"rank-{dist.get_rank()}.pt", weights_only=False)
    if actor.zero == 1:
        actor.optimizer.optim.load_state_dict(mine["zero1_optimizer"])
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    state.sampling_generator.set_state(mine["sampling_generator"])
    state.generator.set_state(training["generator"])
    state.step, state.roles.version, state.metrics = training["step"], training["version"], training["metrics"]
    state.sync.push(actor.named_weights(), state.engine, state.roles.version)


class ShardedCheckpointer(Callback):
    """A sharded checkpoint every `every` steps and at a normal end (every rank takes part)."""

    def __init__(self, root, every: int, keep: int):
        self.root, self.every, self.keep = Path(root), every, keep
        self.saved_step = None

    def on_start(self, state):
        if dist.get_rank() == 0 and self.root.is_dir():
            for stale in self.root.glob(f"{TMP}*"):       # half-written by a crash
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    def on_step(self, state, record):
        if self.every and state.step % self.every == 0:
            save_sharded(self.root, state, self.keep)
            self.saved_step = state.step

    def on_end(self, state):
        if not state.interrupted and self.saved_step != state.step:
            save_sharded(self.root, state, self.keep)


class ShardedCheckpoints:
    """Sharded checkpoints as notebook 01's `run_in_dir` takes them (the protocol of its `LocalCheckpoints`).

    `callback()` is a ShardedCheckpointer under `out_dir/checkpoints`; `restore(state)` loads
    the newest intact one on every rank (RunDirError, on every rank alike, if there is none).
    """

    def __init__(self, out_dir, config):
        self.root, self.config = Path(out_dir) / "checkpoints", config

    def callback(self) -> ShardedCheckpointer:
        return ShardedCheckpointer(self.root, self.config.run.checkpoint_every, self.config.run.keep_checkpoints)

    def restore(self, state) -> None:
        found = latest_sharded(self.root, dist.get_world_size())
        if found is None:
            raise RunDirError(f"--resume: {self.root.parent} holds no intact checkpoint (the run stopped before its "
                              "first one); start it again with --overwrite")
        load_sharded(found, state)
