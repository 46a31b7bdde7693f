"""Packing a weight sync: whole decoder layers in one all-gather per bucket, instead of one per tensor.

Hand-written for notebook 04's `minirl.sync.sharded.ShardedSync` (packed=True): the source's
remedy for a sync whose collectives are many and small. `gather_packed` copies every rank's
shards of a layer, flat, into one buffer, all-gathers the buffers in one collective and cuts
every whole tensor out (bit for bit what `full_tensor` gives); `gather_buckets` does it per
bucket of whole layers. FSDP2 and DTensor split dim 0 as `torch.chunk` does, so
`shard_numels` gives every rank's share of a tensor from its global shape alone (no rank
needs to ask); `packable` says whether a tensor is such a shard; `split_by_layer` groups a
state dict's tensors by decoder layer, ungathered, and `layer_buckets` groups whole layers
into buckets of at most a number of bytes (a layer is never split, so a LoRA layer's W, A
and B arrive together).
"""

import functools
import math
import re
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

LAYER = re.compile(r"\.layers\.\d+\.")


def layer_key(name: str) -> str:
    """The decoder layer a tensor belongs to ("...layers.3."), or the name itself outside the layers."""
    match = LAYER.search(name)
    return name[:match.end()] if match else name


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
    from minirl.sync.sharded import full_tensor  # noqa: PLC0415 (it imports this module)

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
