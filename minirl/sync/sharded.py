# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Weight sync from a sharded trainer: gather layer by layer, merge LoRA or ship only the adapter.

Under FSDP2 each rank holds 1/W of every tensor (a DTensor shard); the engine needs whole
tensors under its own names. `ShardedSync.push` walks the trainer's state one decoder layer
at a time: gathers that layer's full tensors (an all-gather every rank joins, in the same
order), turns them into what the engine loads, and streams them into the engine before it
gathers the next layer, so the gathered copy stays about one layer (`peak_bytes`, measured).
Packed (the default), whole layers travel together: one flat buffer per rank and one
all-gather per bucket of layers (`gather_buckets`, `gather_packed`), instead of one per
tensor (`gather_by_layer`); the gathered copy is then about two buckets.
Three modes:
  full:    every tensor, under the engine's (Hugging Face) names;
  merged:  LoRA folded into the base weights, W + (alpha / r) B A, under the base names;
  adapter: only LoRA's A and B (the engine keeps the frozen base and applies the adapter).
It ends with the version check every sync makes (`check_pushed`) and, on request, the
stale-parameter check of notebook 02, within the engine dtype's rounding.

Simplified vs TRL / veRL: buckets are decoder layers (no byte-sized buckets spanning layers,
no CUDA IPC handles); one LoRA adapter ("default"); no DoRA, no modules_to_save.
"""

__all__ = ["PEFT_PREFIX", "LAYER", "LORA", "engine_name", "layer_key", "full_tensor",
           "gather_by_layer", "merge_lora", "engine_tensors", "shard_numels", "packable",
           "gather_packed", "split_by_layer", "layer_buckets", "gather_buckets", "LiveBytes",
           "ShardedSyncReport", "ShardedSync", "SinkEngine", "full_tensor_storage"]

import functools
import math
import re
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from minirl.sync.base import SyncReport, check_pushed
from minirl.sync.checks import dtype_name, rounding_tolerance, stale_parameters
from minirl.sync.modes import SYNC_MODES

PEFT_PREFIX = "base_model.model."
LAYER = re.compile(r"\.layers\.\d+\.")
LORA = re.compile(r"^(?P<stem>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


def engine_name(name: str) -> str:
    """A trainer tensor's Hugging Face name: peft's "base_model.model." prefix and ".base_layer" removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def layer_key(name: str) -> str:
    """The decoder layer a tensor belongs to ("...layers.3."), or the name itself outside the layers."""
    match = LAYER.search(name)
    return name[:match.end()] if match else name


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (an all-gather: every rank must call it), else the tensor."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gather_by_layer(named_weights: Iterable[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainer's tensors, whole, one layer at a time.

    named_weights: (name, tensor) pairs in state_dict order; a tensor is a DTensor (an FSDP2
    shard) or a plain tensor. Yields lists of (name, whole tensor), names unchanged:
    consecutive names with the same `layer_key` form one list (a decoder layer's tensors),
    any other tensor is a list of its own. Shards are gathered with `full_tensor` (a
    collective: every rank gathers the same tensors in the same order); plain tensors are
    passed on detached. A layer is gathered only when the consumer asks for it, and this
    generator keeps no reference to a layer once it has yielded it: a consumer that drops
    each list before asking for the next holds at most one layer.
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
    if lora_A.shape[1] != weight.shape[1] or lora_B.shape[0] != weight.shape[0] or lora_B.shape[1] != lora_A.shape[0]:
        raise ValueError(f"merge_lora: weight {tuple(weight.shape)}, A {tuple(lora_A.shape)} and B "
                         f"{tuple(lora_B.shape)} do not fit: need A [r, in], B [out, r] for weight [out, in]")
    merged = torch.addmm(weight.float(), lora_B.float(), lora_A.float(), alpha=scaling)   # W + s B A, one op
    return merged.to(weight.dtype)


def engine_tensors(layer: list[tuple[str, Tensor]], mode: str, scaling: float | None = None
                   ) -> list[tuple[str, Tensor]]:
    """What the engine loads from one gathered layer: see the module docstring for the three modes.

    full and merged give Hugging Face names (`engine_name`); adapter keeps peft's names (the
    engine holds a peft copy). merged needs `scaling` (alpha / r).
    """
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


@functools.lru_cache(maxsize=4096)
def shard_numels(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    """Elements of every rank's local shard of a tensor of `shape` sharded on dim 0 over `world` ranks.

    FSDP2 and DTensor split dim 0 as `torch.chunk` does: ceil(n / W) rows per rank, the last
    ranks fewer or none. Computed from the global shape alone, so every rank knows every
    rank's share without asking (and once per shape: the answer is cached).
    """
    rows = [len(chunk) for chunk in torch.empty(shape[0], device="meta").chunk(world)]
    rows += [0] * (world - len(rows))
    per_row = math.prod(shape[1:])
    return tuple(r * per_row for r in rows)


def packable(tensor: Tensor) -> bool:
    """A DTensor sharded on dim 0 over a one-dimensional mesh: what FSDP2 holds, and what packing handles."""
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.dim() > 0
            and tuple(tensor.placements) == (Shard(0),))


def gather_packed(layer: list[tuple[str, Tensor]], meter=None) -> list[tuple[str, Tensor]]:
    """One layer's tensors, whole, with one all-gather per dtype instead of one per tensor.

    layer: (name, tensor) pairs, one decoder layer's (as `gather_by_layer` groups them); a
    tensor is a DTensor shard on dim 0 (FSDP2's), another DTensor, or a plain tensor.
    Returns (name, whole tensor) in the same order, names unchanged: bit for bit what
    `full_tensor` gives. Every rank copies its local shards of the layer's dim-0 DTensors,
    flat, into one buffer padded to the largest rank's size, all-gathers the buffers in one
    collective (every rank must call it, for the same layer), and cuts each whole tensor out:
    rank r's rows of a tensor sit in row r of the result, at that tensor's offset on rank r.
    Other DTensors are gathered one by one (`full_tensor`); plain tensors pass through,
    detached. `meter` (a LiveBytes) counts the gathered buffer, freed once the layer is cut out,
    and each whole tensor from the moment it is cut: at the end both are alive.
    """
    out = [(name, full_tensor(t)) if not packable(t) else None for name, t in layer]
    by_dtype = {}
    for i, (_, t) in enumerate(layer):
        if packable(t):
            by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, items in by_dtype.items():
        mesh = layer[items[0]][1].device_mesh
        rank, world = mesh.get_local_rank(), mesh.size()
        numels = [shard_numels(tuple(layer[i][1].shape), world) for i in items]   # [tensors][ranks]
        width = max(sum(n[r] for n in numels) for r in range(world))
        device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        pad = torch.zeros(width - sum(n[rank] for n in numels), dtype=dtype, device=device)
        mine = torch.cat([layer[i][1].to_local().reshape(-1).to(device) for i in items] + [pad])   # [width]
        rows = torch.empty(world * width, dtype=dtype, device=device)
        dist.all_gather_single(rows, mine, group=mesh.get_group())
        rows = rows.view(world, width)                                           # [W, width]
        if meter is not None:
            meter.track(rows)
        offsets = [0] * world
        for i, n in zip(items, numels, strict=True):
            parts = [rows[r, offsets[r]:offsets[r] + n[r]] for r in range(world)]
            out[i] = (layer[i][0], torch.cat(parts).view(layer[i][1].shape))
            offsets = [o + k for o, k in zip(offsets, n, strict=True)]
            if meter is not None:
                meter.track(out[i][1])                                           # alive beside the buffer
        del rows, mine
    return out


def split_by_layer(named_weights: Iterable[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
    """`gather_by_layer`'s lists, ungathered: consecutive names with the same `layer_key` form one list."""
    layer, key = [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, tensor))
    if layer:
        yield layer


def layer_buckets(named_weights: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """The trainer's (name, tensor) pairs, ungathered, in buckets of whole layers of at most `bucket_bytes`.

    Consecutive layers (`split_by_layer`) share a bucket while its whole tensors (global
    sizes: a DTensor's numel is the whole tensor's) stay within `bucket_bytes`. A layer is
    never split: one larger than the cap, or any layer when bucket_bytes is 0, is a bucket alone.
    """
    bucket, size = [], 0
    for layer in split_by_layer(named_weights):
        nbytes = sum(t.numel() * t.element_size() for _, t in layer)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket, size = bucket + layer, size + nbytes
    if bucket:
        yield bucket


def gather_buckets(named_weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = 0,
                   meter=None) -> Iterator[list[tuple[str, Tensor]]]:
    """`gather_by_layer`, packed: lists of whole tensors, one all-gather per bucket of layers (`gather_packed`).

    bucket_bytes=0 gathers one layer per collective (the extra memory stays about two
    layers); a larger cap puts several layers in one collective (fewer round trips, more
    memory: the buffer and the whole tensors of a bucket). Each list holds whole layers, so
    a LoRA layer's W, A and B always arrive together (what `engine_tensors` needs to merge).
    """
    for bucket in layer_buckets(named_weights, bucket_bytes):
        yield gather_packed(bucket, meter)


class LiveBytes:
    """Bytes of the tracked tensors still alive, and their peak (each tensor counted until it is freed).

    A storage is counted once: tracking a tensor whose storage is already counted (it was
    tracked where it was made, and is tracked again where it is handed on) adds nothing.
    """

    def __init__(self):
        self.live = self.peak = 0
        self.alive = set()                     # data pointers of the storages counted now

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.alive.discard(key)

    def track(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.alive:
            return
        self.alive.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, key, storage.nbytes())


@dataclass
class ShardedSyncReport(SyncReport):
    """A SyncReport with the peak of gathered bytes alive at once and the mode."""

    peak_bytes: int = 0
    mode: str = "full"


class ShardedSync:
    """Stage 4's weight sync: gathered layer by layer from a sharded trainer, in one of three modes.

    mode: "full", "merged" or "adapter" (module docstring); lora_scaling: alpha / r for
    "merged". packed=True gathers whole layers in one all-gather per bucket of at most
    `bucket_bytes` (`gather_buckets`; 0: one layer per all-gather), packed=False one per
    tensor (`gather_by_layer`). verify=True compares every tensor the engine holds with a
    second gathering of the trainer's, within the engine dtype's rounding (notebook 02's
    check; twice the traffic). The last report is kept in `last_report`.
    """

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
        named = list(named_weights)                       # references to shards: nothing is gathered yet
        if self.mode == "adapter":
            named = [(n, t) for n, t in named if LORA.match(n)]
            if not named:
                raise ValueError("sync mode 'adapter': the trainer holds no LoRA tensors (lora_A / lora_B); "
                                 "train with LoRA, or use mode 'full'")
        elif self.mode == "full":                         # a LoRA model's base weights, unmerged: no adapter
            named = [(n, t) for n, t in named if not LORA.match(n)]
        return named

    def push(self, named_weights, engine, version: int) -> ShardedSyncReport:
        """Stream the trainer's weights into `engine` as `version`; check the version (and the weights)."""
        start = time.perf_counter()
        named = self._source(named_weights)
        meter, counts = LiveBytes(), [0, 0]

        def counted():
            for name, tensor in self.stream(named, meter):
                counts[0] += 1
                counts[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        pairs = counted()
        engine.load_weights(pairs, version)
        left = sum(1 for _ in pairs)                      # every rank must join every gather, even now
        if left:
            raise RuntimeError(f"{type(engine).__name__}.load_weights stopped {left} tensors early: an engine must "
                               "consume every tensor it is handed")
        check_pushed(engine, version)
        if self.verify:
            stale = self.stale_tensors(named, engine)
            if stale:
                raise RuntimeError(f"weight sync left the engine stale: {len(stale)} tensors differ beyond "
                                   f"{dtype_name(engine)} rounding (first: {stale[0]})")
        self.last_report = ShardedSyncReport(version, counts[0], counts[1], time.perf_counter() - start,
                                             peak_bytes=meter.peak, mode=self.mode)
        return self.last_report

    def stream(self, named: list[tuple[str, Tensor]], meter: LiveBytes | None = None) -> Iterator[tuple[str, Tensor]]:
        """(engine name, whole tensor) pairs, one layer (or bucket) gathered at a time; new ones tracked by `meter`."""
        own = {full_tensor_storage(t) for _, t in named}
        layers = gather_buckets(named, self.bucket_bytes, meter) if self.packed else gather_by_layer(named)
        for layer in layers:
            for name, tensor in engine_tensors(layer, self.mode, self.lora_scaling):
                if meter is not None and tensor.untyped_storage().data_ptr() not in own:
                    meter.track(tensor)                    # gathered or merged here, not the trainer's own
                yield name, tensor
            del layer

    def stale_tensors(self, named: list[tuple[str, Tensor]], engine) -> list[str]:
        """Names whose engine copy differs from the trainer's beyond the engine dtype's rounding (gathers again)."""
        held = dict(engine.named_weights())
        dtype, stale = dtype_name(engine), []
        for name, tensor in self.stream(named):
            amax = tensor.abs().max().item() if tensor.numel() else 1.0
            stale += stale_parameters({name: tensor}, {name: held[name]} if name in held else {},
                                      *rounding_tolerance(dtype, amax))
        return stale


class SinkEngine:
    """A stand-in engine for timing a sync: copies each tensor it is handed into a buffer of its own.

    Takes any names (allocating a buffer the first time it sees one), so one sync can be timed
    in every mode; what an engine does with the weights afterwards is not part of the sync.
    """

    def __init__(self):
        self.version, self.buffers, self.dtype = 0, {}, "float32"

    def load_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape:
                buffer = self.buffers[name] = torch.empty_like(tensor)
            buffer.copy_(tensor)
        self.version = version

    def named_weights(self):
        return self.buffers.items()


def full_tensor_storage(tensor: Tensor) -> int:
    """The data pointer of the storage a rank holds for `tensor` (its local shard for a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()
