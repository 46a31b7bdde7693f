# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""An in-process engine sharing the trainer's device: weights streamed in, released while it waits.

Simplified vs vLLM's sleep mode: no KV cache released (the HF engines build it per call), and
level 2 only; level 1 (offload to host memory) has nowhere to go on a CPU.
"""

__all__ = ["release_storage", "restore_storage", "ColocatedEngine"]

import contextlib
import time
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.runtime.push_checks import EngineNotReady, StreamedLoads, refuse_older


def release_storage(tensors: Iterable[Tensor]) -> int:
    """Resize the storage behind each tensor to 0 (shared ones once), keeping shapes; bytes freed"""
    released, seen = 0, set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        released += storage.nbytes()
        storage.resize_(0)
    return released


def restore_storage(tensors: Iterable[Tensor]) -> None:
    """Allocate each released storage again, as large as its tensor needs (contents undefined)."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
        if storage.nbytes() < needed:
            storage.resize_(needed)


class ColocatedEngine(StreamedLoads):
    """Loads pushes into an engine (streamed, or by its own load_weights); colocate: sleeps between.

    engine: an in-process engine with `.model`, `.version`, `generate` and `load_weights`.
    adapter_only: pushes bring only the LoRA tensors, the base stays resident. record(what): a
    context manager around every "sleep" and "wake_up" (a Ray worker's timeline).
    """

    def __init__(self, engine, colocate: bool = True, adapter_only: bool = False,
                 stream: bool = True, record=None):
        if adapter_only and not stream:
            raise ValueError("ColocatedEngine(adapter_only=True, stream=False): the engine's own "
                             "load_weights takes every tensor, not the adapter; pass stream=True")
        self.engine, self.colocate, self.adapter_only = engine, colocate, adapter_only
        self.stream = stream
        self.record = record or (lambda what: contextlib.nullcontext())
        state = engine.model.state_dict(keep_vars=True)
        self.names = [n for n in state if not adapter_only or "lora_" in n]
        if not self.names:
            raise ValueError("ColocatedEngine(adapter_only=True): the engine's model holds no LoRA "
                             "tensors; build it from the peft model")
        self.asleep, self.ready = False, True
        self.stats = {"sleep_seconds": 0.0, "wake_seconds": 0.0, "released_bytes": 0}

    def generate(self, prompts: list[str], sampling: SamplingConfig,
                 expected_version: int | None = None, generator: torch.Generator | None = None
                 ) -> Rollout:
        """The inner engine's `generate`; then, when colocated, sleep until the next push."""
        if self.asleep or not self.ready:
            state = "asleep" if self.asleep else "half-loaded"
            raise EngineNotReady(f"{type(self.engine).__name__} is {state}: push the trainer's "
                                 "weights (sync.push / load_weights) before generating")
        rollout = self.engine.generate(prompts, sampling, expected_version, generator)
        if self.colocate:
            self.sleep()
        return rollout

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Wake if asleep, then load the push (streamed, or by the engine's own) as `version`;
        after an error the engine refuses to generate until a complete push."""
        refuse_older(version, self.engine.version, type(self.engine).__name__)
        if self.asleep:
            self.wake_up()
        self.ready = False
        if self.stream:
            self._stream(named_tensors, version)
            self.engine.version = version
        else:
            self.engine.load_weights(named_tensors, version)     # it sets its version
        self.ready = True

    def sleep(self) -> None:
        """Release the storage of every tensor a push refills; keep their shapes."""
        if self.asleep:
            return
        with self.record("sleep"):
            start = time.perf_counter()
            released = release_storage(self._tensors().values())
            self.asleep = True
            self.stats.update(sleep_seconds=time.perf_counter() - start, released_bytes=released)

    def wake_up(self) -> None:
        """Allocate the storage again (contents undefined until the push that follows fills it)."""
        if not self.asleep:
            return
        with self.record("wake_up"):
            start = time.perf_counter()
            restore_storage(self._tensors().values())
            self.asleep, self.ready = False, False              # awake, stale until pushed
            self.stats["wake_seconds"] = time.perf_counter() - start
