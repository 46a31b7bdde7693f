"""The paged forward pass's CPU kernels (`paged_kernels.c`): compiled at first use, called through ctypes.

`build()` compiles the C file beside this one with the system's C compiler (`$CC`, else `cc`)
into `$MINIRL_CACHE/kernels/`, once per source, flags and CPU (the library is built for this
CPU's vector instructions; PLAIN_FLAGS where the compiler lacks OpenMP or x86 options), and
returns it; None where it cannot (no compiler, not Linux or macOS, or MINIRL_KERNELS=0), with
the reason in `why_not()` and one warning. `usable(x)` says whether a tensor can go through them:
float32 on a CPU. Everything else (a GPU, bf16, no compiler) runs torch's own kernels
(`paged_ops`), the same math; tests/test_paged_kernels.py checks each kernel against torch and the
forward pass against HF's. `recorded()` makes the calls visible to torch.profiler.

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
import subprocess
import tempfile
import warnings
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import SimpleNamespace

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
_why_not = ""
_recording = None                                  # a SimpleNamespace of profiled kernels inside `recorded()`
_warned = False


def why_not() -> str:
    """Why `build()` returned None ('' when it did not)."""
    return _why_not


def cpu_tag() -> str:
    """What the compiled library depends on besides its source: the machine and its CPU's feature flags."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.system()} {platform.machine()} {flags}"


def load():
    """The compiled kernels (a ctypes library), or None (see `why_not`); inside `recorded()`, the same
    kernels as torch.profiler ranges."""
    return _recording or build()


@contextmanager
def recorded():
    """Inside, every kernel call is a torch.profiler range named `minirl::<kernel>` (the profiler sees
    no ctypes call otherwise); engine_measure.decode_step_breakdown sorts the step's time with them."""
    global _recording
    lib = build()

    def ranged(name):
        def call(*args):
            with torch.profiler.record_function(f"minirl::{name}"):
                getattr(lib, name)(*args)
        return call

    _recording = None if lib is None else SimpleNamespace(**{name: ranged(name) for name in SIGNATURES})
    try:
        yield
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
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        _why_not = ""
        return lib
    return None


def usable(x: Tensor) -> bool:
    """Whether x can go through the kernels: float32 on a CPU, and the kernels loaded (warns once if not)."""
    if x.dtype != torch.float32 or not x.is_cpu:
        return False
    if build() is None:
        global _warned
        if not _warned and _why_not != "MINIRL_KERNELS=0":
            warnings.warn(f"paged engine: {_why_not}; the forward pass runs torch's kernels instead (slower, "
                          "the same results)", stacklevel=3)
            _warned = True
        return False
    return True
