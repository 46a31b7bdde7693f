# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Weight sync from a sharded trainer: gathered layer by layer, LoRA merged or the adapter alone.

Modes: full (every tensor, Hugging Face names), merged (W + (alpha / r) B A under the base
names), adapter (only LoRA's A and B). Simplified vs TRL / veRL: buckets are whole decoder
layers, no CUDA IPC handles; one LoRA adapter; no DoRA.
"""

__all__ = ["PEFT_PREFIX", "LORA", "engine_name", "full_tensor", "gather_by_layer", "merge_lora",
           "engine_tensors", "ShardedSync"]

import re
import time
from typing import Iterable, Iterator

import torch
from torch import Tensor

from minirl.runtime.buckets import gather_buckets, layer_key
from minirl.runtime.sync_meter import CountedStream, LiveBytes, ShardedSyncReport, check_fresh
from minirl.runtime.sync_meter import full_tensor_storage as storage_of
from minirl.sync.base import check_pushed
from minirl.sync.modes import SYNC_MODES

PEFT_PREFIX = "base_model.model."
LORA = re.compile(r"^(?P<stem>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


def engine_name(name: str) -> str:
    """A trainer tensor's Hugging Face name: peft's prefix and ".base_layer" removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (an all-gather: every rank calls it), or `tensor`."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gather_by_layer(named_weights: Iterable[tuple[str, Tensor]]
                    ) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainer's tensors, whole, one layer at a time.

    named_weights: (name, tensor) pairs in state_dict order, DTensor shards or plain tensors.
    Yields lists of (name, whole tensor), names unchanged: consecutive names with the same
    `layer_key` form one list, any other tensor a list of its own. Shards are gathered with
    `full_tensor` (a collective), plain tensors passed on detached. A layer is gathered only
    when the consumer asks for it, and no reference to a yielded layer is kept.
    """
    layer, key = [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, full_tensor(tensor)))
    if layer:
        yield layer


def merge_lora(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """The weight an adapted linear layer computes with: W + scaling * B @ A.

    weight: [out, in] (the frozen base); lora_A: [r, in]; lora_B: [out, r]; scaling: peft's
    `scaling`, alpha / r. The product is computed in float32 and the result returned in
    weight's dtype, [out, in], a new tensor (weight is not modified). Raises ValueError when
    the shapes do not fit together.
    """
    r, d_in = lora_A.shape
    if d_in != weight.shape[1] or tuple(lora_B.shape) != (weight.shape[0], r):
        raise ValueError(f"merge_lora: weight {tuple(weight.shape)}, A {tuple(lora_A.shape)} and B "
                         f"{tuple(lora_B.shape)} do not fit: need A [r, in], B [out, r]")
    merged = torch.addmm(weight.float(), lora_B.float(), lora_A.float(), alpha=scaling)  # W + s BA
    return merged.to(weight.dtype)


def engine_tensors(layer: list[tuple[str, Tensor]], mode: str, scaling: float | None = None
                   ) -> list[tuple[str, Tensor]]:
    """What the engine loads from one gathered layer in `mode`; adapter keeps peft's names (the
    engine holds a peft copy), full and merged give Hugging Face names; merged needs `scaling`."""
    if mode == "adapter":
        return [(name, t) for name, t in layer if LORA.match(name)]
    lora = {(m["stem"], m["which"]): t for name, t in layer if (m := LORA.match(name))}
    out = []
    for name, tensor in layer:
        if LORA.match(name):
            continue
        stem = name.removesuffix(".base_layer.weight")
        if mode == "merged" and stem != name and (stem, "A") in lora:
            if scaling is None:
                raise ValueError("engine_tensors(mode='merged') needs the LoRA scaling alpha / r")
            tensor = merge_lora(tensor, lora[(stem, "A")], lora[(stem, "B")], scaling)
        out.append((engine_name(name), tensor))
    return out


class ShardedSync:
    """Stage 4's weight sync, in one of three modes; lora_scaling: alpha / r for "merged". packed:
    one all-gather per bucket of layers (else per tensor); verify: notebook 02's stale check."""

    def __init__(self, mode: str = "full", lora_scaling: float | None = None, verify: bool = False,
                 packed: bool = True, bucket_bytes: int = 0):
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode {mode!r}: use one of {SYNC_MODES}")
        if mode == "merged" and lora_scaling is None:
            raise ValueError("sync mode 'merged' needs lora_scaling (alpha / r)")
        self.mode, self.lora_scaling, self.verify = mode, lora_scaling, verify
        self.packed, self.bucket_bytes = packed, bucket_bytes
        self.last_report = None

    def _source(self, named_weights) -> list[tuple[str, Tensor]]:
        named = list(named_weights)                       # references to shards: nothing gathered
        if self.mode == "adapter":
            named = [(n, t) for n, t in named if LORA.match(n)]
            if not named:
                raise ValueError("sync mode 'adapter': the trainer holds no LoRA tensors; "
                                 "train with LoRA, or use mode 'full'")
        elif self.mode == "full":                         # a LoRA model's base weights, unmerged
            named = [(n, t) for n, t in named if not LORA.match(n)]
        return named

    def push(self, named_weights, engine, version: int) -> ShardedSyncReport:
        """Stream the trainer's weights into `engine` as `version`; check the version (and all)."""
        start = time.perf_counter()
        named, meter = self._source(named_weights), LiveBytes()
        pairs = CountedStream(self.stream(named, meter))  # counts tensors and bytes as they go
        engine.load_weights(pairs, version)
        pairs.finish(engine)                              # every rank joins every gather, even now
        check_pushed(engine, version)
        if self.verify:
            check_fresh(self, named, engine)              # notebook 02's stale-parameter check
        seconds = time.perf_counter() - start
        self.last_report = ShardedSyncReport(version, pairs.tensors, pairs.bytes, seconds,
                                             peak_bytes=meter.peak, mode=self.mode)
        return self.last_report

    def stream(self, named: list[tuple[str, Tensor]], meter: LiveBytes | None = None
               ) -> Iterator[tuple[str, Tensor]]:
        """(engine name, whole tensor) pairs, one layer (or bucket) gathered at a time; new ones
        tracked by `meter`."""
        own = {storage_of(t) for _, t in named}
        if self.packed:
            layers = gather_buckets(named, self.bucket_bytes, meter)
        else:
            layers = gather_by_layer(named)
        for layer in layers:
            for name, tensor in engine_tensors(layer, self.mode, self.lora_scaling):
                if meter is not None and tensor.untyped_storage().data_ptr() not in own:
                    meter.track(tensor)                    # gathered or merged here
                yield name, tensor
            del layer
