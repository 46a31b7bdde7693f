# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Atomic, exactly resumable checkpoints of the stage-1 loop.

A checkpoint is `checkpoints/step-000010/`: the policy in Hugging Face format
(`save_pretrained`, tokenizer included) and `training_state.pt` (optimizers, critic, RNG
states, generator, step, version, metrics). It is written to a temporary directory and
renamed into place. Simplified vs TRL/Accelerate: one process, one file for the state; the
frozen reference is not saved (it is the initial policy, rebuilt from the model you pass).
"""

import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

PREFIX = "step-"


def save_checkpoint(root, state, metrics: list[dict], config, keep: int = 2) -> Path:
    """Write `root/step-{state.step:06d}` atomically; keep the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    state.model.save_pretrained(tmp)
    state.tokenizer.save_pretrained(tmp)
    training = {
        "step": state.step, "version": state.version, "config": asdict(config), "metrics": metrics,
        "optimizer": state.optimizer.state_dict(), "generator": state.generator.get_state(),
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "extra": state.extra,
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "value_model": state.value_model.state_dict() if state.value_model is not None else None,
        "value_optimizer": state.value_optimizer.state_dict() if state.value_optimizer is not None else None,
    }
    torch.save(training, tmp / "training_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)                                   # atomic: all of it or none of it
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "training_state.pt").exists()) if root.exists() else []
    return done[-1] if done else None


def restore_state(path, state) -> list[dict]:
    """Load a checkpoint into a freshly `setup` state, in place; returns the metrics logged so far."""
    from safetensors.torch import load_file

    path = Path(path)
    training = torch.load(path / "training_state.pt", weights_only=False)
    weights = load_file(path / "model.safetensors", device=str(next(state.model.parameters()).device))
    state.model.load_state_dict(weights, strict=False)       # tied weights are saved once
    state.optimizer.load_state_dict(training["optimizer"])
    if state.value_model is not None:
        state.value_model.load_state_dict(training["value_model"])
        state.value_optimizer.load_state_dict(training["value_optimizer"])
    state.generator.set_state(training["generator"])
    torch.set_rng_state(training["torch_rng"])
    random.setstate(training["python_rng"])
    if training["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(training["cuda_rng"])
    state.step, state.version, state.extra = training["step"], training["version"], training["extra"]
    state.rollout.load_weights(state.model.state_dict(), state.version)
    return training["metrics"]
