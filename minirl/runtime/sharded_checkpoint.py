"""Sharded checkpoints of a data-parallel run: torch.distributed.checkpoint, atomic, verified, exactly resumable.

Hand-written plumbing for stage 4 (notebook 04 names it; the chapter script uses it).

`save_sharded` writes `root/step-000010/`: every rank's model and optimizer shards with DCP
(`get_state_dict` covers DDP, FSDP2 and peft models), ZeRO-1's per-rank optimizer state
(ZeroRedundancyOptimizer is not a DCP optimizer), each rank's RNG and sampling generator
(`rank-N.pt`), and on rank 0 `training_state.pt` (step, version, records, the shared
generator, the settings, the world size). Written to a temporary directory that rank 0
renames into place once every rank is done (a failed write on any rank stops every rank,
and nothing is renamed). Stage 1's rule for reading them back (notebook 01): newest intact
first, a broken one named and skipped. `sharded_problem` checks a checkpoint's files without
loading the shards (the training state loads, DCP's metadata loads, every shard file is as
long as the metadata says, every rank's file is there); `newest_intact` applies it, in one
process; `ShardedCheckpoints.restore` also falls back when loading fails on any rank.

Simplified vs torchtitan: synchronous saves (no async staging), same world size on resume, no
checksums (a shard overwritten with garbage of the same length loads as garbage weights).
"""

import dataclasses
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from minirl.runtime.checkpoint import PREFIX, TMP_PREFIX, CheckpointError
from minirl.runtime.io import as_write_error
from minirl.runtime.ranks import RankFailed, agree
from minirl.runtime.rundir import RunDirError
from minirl.runtime.stops import deferred_signals
from minirl.runtime.validate import ConfigError
from minirl.train.run import Callback

TMP = TMP_PREFIX + PREFIX           # .tmp-step-000010: a checkpoint being written


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


def _dcp_error(err: CheckpointException, what: str) -> Exception:
    """DCP's CheckpointException (a BaseException, raised on every rank with each failed rank's error) as the first
    failed rank's error, marked `agreed` (every rank has it): an OSError stays one (a full disk names its file)."""
    rank, (first, _) = min(err.failures.items(), key=lambda item: item[0])
    error = first if isinstance(first, OSError) else \
        CheckpointError(f"{what}: rank {rank} failed with {type(first).__name__}: {first}")
    error.agreed = True
    return error


def _rank_state(state) -> dict:
    actor = state.roles.actor
    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "sampling_generator": state.sampling_generator.get_state(),
            "zero1_optimizer": actor.optimizer.optim.state_dict() if actor.zero == 1 else None}


def save_sharded(root, state, keep: int = 2) -> Path:
    """Every rank: write checkpoint `root/step-{state.step:06d}` (a collective); returns its path.

    An error while writing on any rank (a full disk, say) is raised on every rank (`agree`):
    the temporary directory is then deleted, never renamed into place.
    """
    root = Path(root)
    rank = dist.get_rank()
    final, tmp = root / f"{PREFIX}{state.step:06d}", root / f"{TMP}{state.step:06d}"

    def promote():                                        # rank 0, once every rank's files are on disk
        torch.save({"step": state.step, "version": state.roles.version, "metrics": state.metrics,
                    "generator": state.generator.get_state(), "world_size": dist.get_world_size(),
                    "config": dataclasses.asdict(state.config), "pconfig": dataclasses.asdict(state.pconfig)},
                   tmp / "training_state.pt")
        with deferred_signals():                          # Ctrl-C waits: all of it or none of it
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        agree(f"creating {tmp}", lambda: tmp.mkdir(parents=True) if rank == 0 else None)
        try:
            dcp.save(_model_and_optimizer(state), checkpoint_id=str(tmp))
        except CheckpointException as err:                # on every rank alike
            raise _dcp_error(err, f"writing {tmp}") from None
        agree(f"writing {tmp}", lambda: torch.save(_rank_state(state), tmp / f"rank-{rank}.pt"))
        agree(f"writing {tmp}", promote if rank == 0 else lambda: None)
    except Exception as err:
        error = as_write_error(err, final, tmp)           # a full disk, however reported: an OSError naming `final`
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)        # nothing half-written stays (and the space comes back)
        if error is None or error is err:
            raise
        error.agreed = getattr(err, "agreed", False) or isinstance(err, RankFailed)
        raise error from err
    return final


def sharded_problem(path) -> str | None:
    """What is wrong with checkpoint `path`, naming the file, or None when it is intact (one process, no collectives).

    Checked without loading the shards: training_state.pt loads and names the world size;
    every rank-N.pt is there and not empty; DCP's .metadata loads, and every shard file it
    lists holds at least the bytes it records there (a truncated .distcp is caught).
    """
    path = Path(path)
    name = path / "training_state.pt"
    try:
        training = torch.load(name, weights_only=False, map_location="cpu")
        world = int(training["world_size"])
    except FileNotFoundError:
        return f"{name} is missing"
    except Exception as err:
        return f"{name} does not load ({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''})"
    for r in range(world):
        own = path / f"rank-{r}.pt"
        if not own.is_file() or own.stat().st_size == 0:
            return f"{own} is missing or empty"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        return f"{path / '.metadata'} does not load ({type(err).__name__}: {err})"
    needed = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        have = shard.stat().st_size if shard.is_file() else None
        if have is None:
            return f"{shard} is missing"
        if have < size:
            return f"{shard} is truncated ({have} of {size} bytes)"
    return None


def checkpoints_in(root) -> list[Path]:
    """The checkpoint directories under `root`, newest first (half-written `.tmp-step-*` ones excluded)."""
    root = Path(root)
    return sorted(root.glob(f"{PREFIX}*"), reverse=True) if root.is_dir() else []


def newest_intact(root) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `root` whose files are intact, or None; what is wrong with each newer one)."""
    problems = []
    for path in checkpoints_in(root):
        problem = sharded_problem(path)
        if problem is None:
            return path, problems
        problems.append(problem)
    return None, problems


def latest_sharded(root, world_size: int | None = None) -> Path | None:
    """The newest intact checkpoint under `root` (decided on rank 0, the same on every rank), or None."""
    found = str(newest_intact(root)[0] or "") if dist.get_rank() == 0 else None
    found = _broadcast(found)
    return Path(found) if found else None


def load_sharded(path, state, push: bool = True) -> None:
    """Restore checkpoint `path` into a freshly built state (every rank), then (push=True) push the weights
    to the engine.

    ConfigError when it was written by another number of ranks; CheckpointError naming the file
    that does not load.
    """
    path = Path(path)
    try:
        training = torch.load(path / "training_state.pt", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{path / 'training_state.pt'} does not load ({type(err).__name__}: {err})") from None
    if training["world_size"] != dist.get_world_size():
        raise ConfigError("nproc_per_node", dist.get_world_size(),
                          f"the checkpoint {path} was written by {training['world_size']} ranks; resume with "
                          f"torchrun --nproc_per_node {training['world_size']}")
    actor = state.roles.actor
    target = _model_and_optimizer(state)
    try:
        dcp.load(target, checkpoint_id=str(path))
    except CheckpointException as err:
        raise _dcp_error(err, f"{path}: the shards do not load") from None
    except Exception as err:
        raise CheckpointError(f"{path}: the shards do not load ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0] if str(err) else ''})") from None
    if actor.zero == 1:
        set_state_dict(actor.module, [], model_state_dict=target["model"], optim_state_dict={})
    else:
        set_state_dict(actor.module, actor.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    own = path / f"rank-{dist.get_rank()}.pt"
    try:
        mine = torch.load(own, weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{own} does not load ({type(err).__name__}: {err})") from None
    if actor.zero == 1:
        actor.optimizer.optim.load_state_dict(mine["zero1_optimizer"])
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    state.sampling_generator.set_state(mine["sampling_generator"])
    state.generator.set_state(training["generator"])
    state.step, state.roles.version, state.metrics = training["step"], training["version"], training["metrics"]
    if push:
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
    the newest intact one on every rank: a checkpoint whose files are broken, or that fails to
    load on any rank, is named on rank 0's stderr and the one before it is tried (RunDirError,
    on every rank alike, when none is left).
    """

    def __init__(self, out_dir, config):
        self.root, self.config = Path(out_dir) / "checkpoints", config

    def callback(self) -> ShardedCheckpointer:
        return ShardedCheckpointer(self.root, self.config.run.checkpoint_every, self.config.run.keep_checkpoints)

    def restore(self, state) -> None:
        main, problems = dist.get_rank() == 0, []
        for path in map(Path, _broadcast([str(p) for p in checkpoints_in(self.root)] if main else None)):
            problem = _broadcast(sharded_problem(path) if main else None)
            if problem is None:
                try:
                    agree(f"restoring {path}", lambda path=path: load_sharded(path, state, push=False))
                except ConfigError:
                    raise
                except Exception as err:                  # on every rank alike: this rank's or another's error
                    problem = str(err)
                else:
                    state.sync.push(state.roles.actor.named_weights(), state.engine, state.roles.version)
                    return
            if main:
                print(f"warning: checkpoint {path} is broken: {problem}; falling back to the one before it",
                      file=sys.stderr, flush=True)
            problems.append(problem)
        if problems:
            error = RunDirError(f"--resume: no checkpoint in {self.root} is intact (each is named above); put the "
                                "files back from a copy, or start the run again with --overwrite")
        else:
            error = RunDirError(f"--resume: {self.root.parent} holds no checkpoint yet (the run stopped before its "
                                "first one); start it again with --overwrite")
        error.agreed = True                               # every rank raises it (see `agree`)
        raise error
