"""The paged forward pass's CPU kernels (`paged_kernels.c`): compiled at first use, called through ctypes.

`build()` compiles the C file beside this one with the system's C compiler (`$CC`, else `cc`)
into `$MINIRL_CACHE/kernels/`, once per source, flags and CPU (the library is built for this
CPU's vector instructions; PLAIN_FLAGS where the compiler lacks OpenMP or x86 options), and
returns it; None where it cannot (no compiler, not Linux or macOS, or MINIRL_KERNELS=0), with
the reason in `why_not()` and one warning. `usable(x)` says whether a tensor can go through them:
float32 on a CPU. Everything else (a GPU, bf16, no compiler) runs torch's own kernels
(`paged_ops`), the same math; tests/test_paged_kernels.py checks each kernel against torch and the
forward pass against HF's. `call(name, ...)` runs one; inside `queued()` calls wait and run
together in one C call (`run_calls`), with no Python between them. `recorded()` makes the calls
visible to torch.profiler.

Why hand-written: torch has no paged attention on a CPU, and at a decode step's few rows its
products, norms and elementwise kernels cost more in dispatch and passes over memory than in
arithmetic (benchmarks/decode_step.py measures the step against HF's and the machine's limits).
Simplified vs vLLM's CPU backend: float32 only, no hand-written intrinsics (GCC/Clang vector
types), OpenMP only in the product and the attention.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
from array import array
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from minirl.runtime.policy_cache import cache_dir

SOURCE = Path(__file__).with_name("paged_kernels.c")
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
PLAIN_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-shared"]
N, P, F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float                 # C's int64_t, pointer, float
SIGNATURES = {"linear": [P, P, P, P, N, N, N, ctypes.c_int], "rms_norm": [P, P, P, N, N, F],
              "silu_mul": [P, P, N, N], "rotate": [P, N, P, P, N, N, N], "write_kv": [P, N, P, P, P, N, N, N, N, N],
              "decode_attention": [P, N, P, P, P, P, P, N, N, N, N, N, N, N, F]}
ARGS = 16                                          # slots per queued call: the kernel's number, its arguments
FLOATS = {name: [i for i, t in enumerate(sig) if t is F] for name, sig in SIGNATURES.items()}
KERNEL_NUMBER = {name: i for i, name in enumerate(SIGNATURES)}   # run_calls's numbering
_why_not = ""
_recording: dict | None = None                     # inside `recorded()`: seconds of each kernel run in queues
_warned = False


class Waiting(threading.local):
    """One thread's queue (`queued`): each thread of a process (a producer of notebook 07) has its own."""

    def __init__(self):
        self.queue: array | None = None            # inside `queued()`: the calls waiting, ARGS slots each
        self.keep: list = []                       # the tensors they read and write


_waiting = Waiting()


def why_not() -> str:
    """Why `build()` returned None ('' when it did not)."""
    return _why_not


def cpu_tag() -> str:
    """What the compiled library depends on besides its source: the machine and its CPU's feature flags."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.system()} {platform.machine()} {flags}"


def call(name: str, *args) -> None:
    """Run kernel `name` (tensors are passed as pointers, None as NULL); inside `queued()`, queue it instead."""
    pointers = [a.data_ptr() if isinstance(a, Tensor) else 0 if a is None else a for a in args]
    waiting = _waiting
    if waiting.queue is not None:
        for i in FLOATS[name]:
            pointers[i] = struct.unpack("<i", struct.pack("<f", pointers[i]))[0]    # the float's bits
        waiting.queue.extend([KERNEL_NUMBER[name], *pointers] + [0] * (ARGS - 1 - len(pointers)))
        waiting.keep.extend(a for a in args if isinstance(a, Tensor))              # alive until they run
    elif _recording is not None:
        with torch.profiler.record_function(f"minirl::{name}"):
            getattr(build(), name)(*pointers)
    else:
        getattr(build(), name)(*pointers)


def flush() -> None:
    """Run the calls queued so far (inside `queued()`; nothing outside): before torch reads what they write."""
    waiting = _waiting
    if not waiting.queue:
        return
    calls, waiting.queue = waiting.queue, array("q")
    if _recording is None:
        build().run_calls(calls.buffer_info()[0], len(calls) // ARGS, None)
    else:
        seconds = (ctypes.c_double * len(KERNEL_NUMBER))()
        with torch.profiler.record_function("minirl::queue"):
            build().run_calls(calls.buffer_info()[0], len(calls) // ARGS, seconds)
        for name, i in KERNEL_NUMBER.items():
            _recording[name] = _recording.get(name, 0.0) + seconds[i]
    waiting.keep.clear()


@contextmanager
def queued(enabled: bool = True):
    """Inside, kernel calls wait in a queue that one C call runs at the end (`run_calls`), so no Python
    runs between two kernels: on a GPU, launches are queued on a stream and vLLM replays a decode step
    as a CUDA graph for the same reason. Only kernels queue: torch must not read or write what a
    queued call writes until `flush()`; every op of paged_ops that takes torch's path flushes first
    (`usable`), but torch code between the ops does not. Nothing queues where `enabled` is False or
    the kernels are not built; an error inside drops the queue. Each thread queues its own calls."""
    waiting = _waiting
    if not enabled or waiting.queue is not None or build() is None:
        yield
        return
    waiting.queue = array("q")
    try:
        yield
        flush()
    finally:
        waiting.queue = None
        waiting.keep.clear()


@contextmanager
def recorded():
    """Inside, every kernel call is a torch.profiler range named `minirl::<kernel>` (the profiler sees
    no ctypes call otherwise), and a queue's run is one range, `minirl::queue`; yields a dict of the
    seconds each kernel took inside queues (engine_measure.decode_step_breakdown sorts the step's
    time with both)."""
    global _recording
    _recording = {}
    try:
        yield _recording
    finally:
        _recording = None


@cache
def build() -> ctypes.CDLL | None:
    """The compiled kernels, or None (see `why_not`); built into the cache once per source, flags and CPU."""
    global _why_not
    compiler = os.environ.get("CC", "cc")
    if os.environ.get("MINIRL_KERNELS", "1") == "0":
        _why_not = "MINIRL_KERNELS=0"
    elif platform.system() not in ("Linux", "Darwin"):
        _why_not = f"no C kernels on {platform.system()}"
    elif shutil.which(compiler) is None:
        _why_not = f"no C compiler ({compiler} not found): install gcc or clang, or set CC"
    if _why_not:
        return None
    for flags in (FLAGS, PLAIN_FLAGS):                  # PLAIN_FLAGS: a compiler without OpenMP or x86 options
        key = hashlib.sha256((SOURCE.read_text() + " ".join(flags) + cpu_tag()).encode()).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"paged_kernels-{key}.so"
        tmp = None
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
                os.close(fd)
                done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                    _why_not = f"{compiler} failed on {SOURCE.name} ({last})"
                    continue
                os.replace(tmp, path)                     # atomic: ranks compiling at once each get a whole file
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as err:
            _why_not = f"cannot build or load the kernels under {path.parent} ({err})"
            continue
        finally:
            if tmp is not None and os.path.exists(tmp):   # a failed or interrupted compile leaves nothing
                os.unlink(tmp)
        for name, argtypes in (SIGNATURES | {"run_calls": [P, N, P]}).items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        _why_not = ""
        return lib
    return None


def usable(x: Tensor, fits: bool = True) -> bool:
    """Whether x can go through the kernels: float32 on a CPU, the kernels loaded (warns once if not), and
    `fits` (the op's own conditions). When not, the calls queued so far run first (see `queued`)."""
    if fits and x.dtype == torch.float32 and x.is_cpu and build() is not None:
        return True
    flush()
    if x.dtype == torch.float32 and x.is_cpu and build() is None:
        global _warned
        if not _warned and _why_not != "MINIRL_KERNELS=0":
            warnings.warn(f"paged engine: {_why_not}; the forward pass runs torch's kernels instead (slower, "
                          "the same results)", stacklevel=3)
            _warned = True
    return False
