# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Bucketed broadcast of named tensors over a torch.distributed group: the wire of stage 6's sync.

Both ends plan the same buckets from the same metadata, so only flat buffers travel, one
`broadcast` per bucket. Simplified: the sender holds full tensors (an FSDP trainer gathers its
shards first, notebook 04); tensors travel in the trainer's dtype.
"""

__all__ = ["TensorMeta", "tensor_metadata", "plan_buckets", "send_buckets", "recv_buckets"]

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to rebuild one tensor from a flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_metadata(named_tensors) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in named_tensors]


def plan_buckets(metadata: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors in buckets of one dtype and at most `bucket_bytes` bytes (a larger tensor
    goes alone). Sender and receivers agree on the buckets without sending them."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1 (e.g. 32 << 20 for 32 MiB)")
    buckets, current, size = [], [], 0
    for meta in metadata:
        if current and (meta.dtype != current[0].dtype or size + meta.nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def send_buckets(named: dict[str, Tensor], buckets: list[list[TensorMeta]], src: int,
                 group=None) -> int:
    """Broadcast every bucket from this process (global rank `src`); returns the bytes sent."""
    sent = 0
    for bucket in buckets:
        flat = torch.cat([named[meta.name].detach().reshape(-1) for meta in bucket])   # [numel]
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_buckets(buckets: list[list[TensorMeta]], src: int, group=None,
                 device="cpu") -> list[tuple[str, Tensor]]:
    """Every bucket broadcast by global rank `src`; the named tensors, as views of the buffers."""
    named = []
    for bucket in buckets:
        flat = torch.empty(sum(meta.numel for meta in bucket), dtype=bucket[0].dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        for meta, piece in zip(bucket, flat.split([meta.numel for meta in bucket]), strict=True):
            named.append((meta.name, piece.view(meta.shape)))
    return named
