"""Atomic, verified, exactly resumable checkpoints of a run.

A checkpoint is `checkpoints/step-000010/`: the policy in Hugging Face format
(`save_pretrained`, tokenizer included, so any tool can load it) and `training_state.pt`
with what the weights do not say: the run's config, the optimizers, the critic, the
prompt/sampling generator, torch's and Python's RNG states, the step, the policy version,
the metrics so far, and what a later stage's state adds (`RunState.extra_state`: notebook
07's queued trajectories and tickets). It is written to a temporary directory and renamed into place, so a
crash mid-write never leaves a half checkpoint (and a failed write, a full disk say, deletes it and
names the checkpoint it was for: `minirl.runtime.io.writing`). Before a resume each candidate is verified
(both files load); a broken one is reported by name and the previous intact one is used.

Simplified vs TRL/Accelerate: one process writes one file of state (notebook 04 writes
sharded checkpoints with torch.distributed.checkpoint); the frozen reference is not saved
(it is the initial policy, rebuilt from the model the run starts from).

Hand-written bookkeeping (it teaches no RL): `minirl.runtime.callbacks.Checkpointer` saves
checkpoints during a run, and `run_in_dir` restores the newest intact one when resuming.
"""

__all__ = ["PREFIX", "TMP_PREFIX", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "remove_stale_temporaries", "restore_checkpoint"]

import dataclasses
import os
import random
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minirl.runtime.io import temporary_beside, writing

PREFIX = "step-"
TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names its directory and the broken file."""


def save_checkpoint(root, state, config, tokenizer, keep: int = 2) -> Path:
    """Write `root/step-{state.step:06d}` atomically; keep the newest `keep` checkpoints of this run."""
    root = Path(root)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = temporary_beside(final, TMP_PREFIX)
    roles = state.roles
    with writing(final, tmp):                                # a failure (a full disk) deletes tmp, names `final`
        roles.actor.model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        training = {
            "step": state.step, "version": roles.version, "config": dataclasses.asdict(config),
            "metrics": state.metrics, "actor": roles.actor.state_dict(),
            "critic": roles.critic.state_dict() if roles.critic is not None else None,
            "generator": state.generator.get_state(), "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "extra": state.extra_state(),    # what a later stage adds (notebook 07: its queue); {} here
        }
        torch.save(training, tmp / "training_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)                               # atomic: all of it or none of it
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path) -> tuple[dict, dict]:
    """(training state, model weights) of one checkpoint; CheckpointError names what is broken."""
    path = Path(path)
    for name in ("training_state.pt", "model.safetensors"):
        if not (path / name).is_file() or (path / name).stat().st_size == 0:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or empty")
    try:
        training = torch.load(path / "training_state.pt", weights_only=False, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: training_state.pt does not load "
                              f"({type(err).__name__}: {err})") from err
    try:
        weights = load_file(path / "model.safetensors")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: model.safetensors does not load ({err})") from err
    return training, weights


def latest_checkpoint(root) -> tuple[Path, dict, dict] | None:
    """The newest intact checkpoint under `root` as (path, training state, weights), or None.

    A newer checkpoint that does not load is skipped with a warning naming it, so a crash
    that damaged the last one costs the steps since the one before, never the run.
    """
    root = Path(root)
    candidates = sorted(root.glob(f"{PREFIX}*"), reverse=True) if root.is_dir() else []
    for path in candidates:
        try:
            return (path, *load_checkpoint(path))
        except CheckpointError as err:
            warnings.warn(f"{err}; falling back to the previous checkpoint", stacklevel=2)
    return None


def remove_stale_temporaries(root) -> list[Path]:
    """Delete half-written `.tmp-step-*` directories left by a crash during a save; returns them."""
    root = Path(root)
    stale = sorted(root.glob(f"{TMP_PREFIX}{PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def restore_checkpoint(training: dict, weights: dict, state) -> None:
    """Load a checkpoint (from `load_checkpoint`) into a freshly built run state, in place.

    The engine is then handed the restored weights at the restored version.
    """
    roles = state.roles
    model = roles.actor.model
    device = next(model.parameters()).device
    try:
        result = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    except RuntimeError as err:                  # shapes differ: another model than the run's
        raise CheckpointError(f"the checkpoint's weights do not fit the model ({str(err).splitlines()[1].strip()}"
                              "...); resume with the model the run started from") from None
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]   # tied weights are saved once
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint weights do not fit the model: missing {missing[:3]}, unexpected "
                              f"{result.unexpected_keys[:3]}; resume with the model the run started from")
    roles.actor.load_state_dict(training["actor"])
    if roles.critic is not None:
        roles.critic.load_state_dict(training["critic"])
    state.generator.set_state(training["generator"])
    torch.set_rng_state(training["torch_rng"])
    random.setstate(training["python_rng"])
    if training["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(training["cuda_rng"])
    state.step, roles.version, state.metrics = training["step"], training["version"], training["metrics"]
    state.load_extra_state(training.get("extra", {}))
    state.sync.push(roles.actor.named_weights(), state.engine, roles.version)
