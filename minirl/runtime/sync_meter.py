"""Measuring a weight sync: bytes alive at once, a stand-in engine that only receives, the stale-tensor check,
and the table that times a push in every mode.

Hand-written measurement harness for notebook 04's `minirl.sync.sharded.ShardedSync`.
`LiveBytes` counts the gathered tensors a push holds at once (each from its creation until
it is freed) and keeps the peak; `SinkEngine` copies each tensor it is handed into a buffer,
so that a sync can be timed alone, in any mode; `CountedStream` counts a push's tensors and
bytes as the engine takes them; `stale_tensors` and `check_fresh` are `verify=True`'s check
(notebook 02's stale-parameter check within the engine dtype's rounding, on a second
gathering of the trainer's tensors); `ShardedSyncReport` is a push's report; `sync_table`
pushes a run's weights in every mode and transfer it can ship and divides by the run's
median step: the share the source's 5 % threshold applies to.
"""

import statistics
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from minirl.runtime.sync_checks import dtype_name, rounding_tolerance
from minirl.sync.base import SyncReport
from minirl.sync.checks import stale_parameters


@dataclass
class ShardedSyncReport(SyncReport):
    """A SyncReport with the peak of gathered bytes alive at once and the mode."""

    peak_bytes: int = 0
    mode: str = "full"


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


def stale_tensors(sync, named: list[tuple[str, Tensor]], engine) -> list[str]:
    """Names whose engine copy differs from the trainer's beyond the engine dtype's rounding (gathers again)."""
    held = dict(engine.named_weights())
    dtype, stale = dtype_name(engine), []
    for name, tensor in sync.stream(named):
        amax = tensor.abs().max().item() if tensor.numel() else 1.0
        stale += stale_parameters({name: tensor}, {name: held[name]} if name in held else {},
                                  *rounding_tolerance(dtype, amax))
    return stale


def check_fresh(sync, named: list[tuple[str, Tensor]], engine) -> None:
    """`ShardedSync(verify=True)`'s check: RuntimeError when the engine's copy is stale (`stale_tensors`)."""
    stale = stale_tensors(sync, named, engine)
    if stale:
        raise RuntimeError(f"weight sync left the engine stale: {len(stale)} tensors differ beyond "
                           f"{dtype_name(engine)} rounding (first: {stale[0]})")


class CountedStream:
    """The (name, tensor) pairs of a push as the engine takes them, counted in `tensors` and `bytes`."""

    def __init__(self, pairs):
        self.pairs, self.tensors, self.bytes = iter(pairs), 0, 0

    def __iter__(self):
        for name, tensor in self.pairs:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def finish(self, engine) -> None:
        """Drain what the engine left (every rank must join every gather), then RuntimeError if it left any."""
        left = sum(1 for _ in self.pairs)
        if left:
            raise RuntimeError(f"{type(engine).__name__}.load_weights stopped {left} tensors early: an engine must "
                               "consume every tensor it is handed")


def sync_table(state, metrics: list[dict], repeats: int = 5) -> list[dict]:
    """Seconds, bytes and share of the step of one sync in each mode and transfer this run can ship.

    Every rank calls it (the pushes are collectives). Each mode ("full"; with LoRA also
    "merged" and "adapter") is pushed into a `SinkEngine` three ways: one all-gather per
    tensor, one per layer (packed), and packed in buckets of the run's `sync_bucket_mb` (if > 0);
    once to allocate, then `repeats` times in turn (the machine's load hits every row alike),
    timed (median). "full" ships every tensor unmerged (for a LoRA run: the base weights, as
    full fine-tuning ships them). share = seconds / this run's median step (rank 0's clock).
    """
    from minirl.sync.sharded import ShardedSync  # noqa: PLC0415 (it imports this module)

    steps = [m["time/step"] for m in metrics if "time/step" in m]
    step_time = statistics.median(steps) if steps else float("nan")
    scaling = state.sync.lora_scaling
    modes = ("full", "merged", "adapter") if scaling is not None else ("full",)
    bucket = state.sync.bucket_bytes
    transfers = {"per tensor": (False, 0), "per layer": (True, 0)}
    if bucket:
        transfers[f"{bucket / 2**20:g} MiB buckets"] = (True, bucket)
    named = list(state.roles.actor.named_weights())
    syncs = {(mode, name): (ShardedSync(mode, scaling, packed=packed, bucket_bytes=cap), SinkEngine())
             for mode in modes for name, (packed, cap) in transfers.items()}
    reports = {key: [] for key in syncs}
    for sync, sink in syncs.values():
        sync.push(named, sink, 0)
    for _ in range(repeats):
        for key, (sync, sink) in syncs.items():
            reports[key].append(sync.push(named, sink, 0))
    rows = []
    for (mode, transfer), got in reports.items():
        seconds = statistics.median(r.seconds for r in got)
        rows.append({"mode": mode, "transfer": transfer, "seconds": seconds, "bytes": got[-1].bytes,
                     "tensors": got[-1].tensors, "peak_bytes": got[-1].peak_bytes, "share": seconds / step_time})
    return rows
