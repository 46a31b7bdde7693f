# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Rollout producers: a weight store, and sampling with in-flight weight updates.

The producer threads are in `minirl/runtime/async_run.py`, Ray actors in `async_ray.py`.
Simplified vs AReaL / PipelineRL: the KV cache is not recomputed after an in-flight switch.
"""

__all__ = ["Producer"]

import dataclasses
import threading

import torch

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.shared_prefix import SharedPrefixEngine
from minirl.runtime.async_bookkeeping import WeightStore
from minirl.sync.base import InProcessSync


class Producer:
    """One rollout worker: an engine, its environment, and the store it pulls weights from.

    make_env: a callable returning a fresh environment (one per session); env_timeout: seconds
    a session may take; in_flight: pick up new weights between decoding steps (else between
    engine calls only; needs a SharedPrefixEngine, whose loop takes the hook). Thread-safe:
    generation holds the producer's lock, sessions do not.
    """

    def __init__(self, name: str, engine, store: WeightStore, make_env, sampling: SamplingConfig,
                 env_timeout: float = 5.0, max_turns: int = 1, in_flight: bool = False):
        if in_flight and not isinstance(engine, SharedPrefixEngine):
            raise TypeError("Producer(in_flight=True) needs a SharedPrefixEngine (its decoding "
                            f"loop takes new weights between tokens), not {type(engine).__name__}")
        self.name, self.engine, self.store, self.make_env = name, engine, store, make_env
        self.sampling, self.env_timeout, self.max_turns = sampling, env_timeout, max_turns
        self.in_flight, self.sync, self.lock = in_flight, InProcessSync(), threading.Lock()
        self.switches = 0              # weight loads in the middle of a sequence

    def refresh(self, mid_sequence: bool = False) -> None:
        """Load the store's weights when they are newer than the engine's."""
        version, weights = self.store.latest()
        if version > self.engine.version:
            self.sync.push(weights.items(), self.engine, version)
            self.switches += int(mid_sequence)

    def policy(self, prompt: str) -> str:
        """One completion of `prompt` with the current weights: a later turn of a session."""
        one = dataclasses.replace(self.sampling, num_generations=1)
        with self.lock:
            return self.engine.generate([prompt], one).completions[0]

    def sample(self, prompts: list[str], generator: torch.Generator) -> Rollout:
        """G completions per prompt in one engine call, with `token_versions` [N, C] and the
        oldest token's version.

        With in_flight the engine's loop calls `refresh` before every forward pass but the first,
        so each token records the version that sampled it (one per decoding step, shared by
        the rows) and its behaviour log-prob is the one it was sampled with.
        """
        self.refresh()
        if not self.in_flight:
            rollout = self.engine.generate(prompts, self.sampling, generator=generator)
            rollout.token_versions = torch.full_like(rollout.completion_ids, rollout.version)
            return rollout
        versions = []                                       # the version of each decoding step

        def before_forward():
            if versions:
                self.refresh(mid_sequence=True)             # new weights between decoding steps
            versions.append(self.engine.version)
        rollout = self.engine.generate(prompts, self.sampling, generator=generator,
                                       before_forward=before_forward)
        steps = torch.tensor(versions, device=rollout.completion_ids.device)           # [C]
        rollout.token_versions = steps.expand_as(rollout.completion_ids).clone()       # [N, C]
        rollout.version = versions[0]                       # every row's first token is oldest
        return rollout
