"""What MFU needs besides the FLOP count: the model's shape, the run's settings, and the device's peak FLOP/s.

Hand-written (bookkeeping for `minirl.profiling.mfu`).
- `FlopShape`: the numbers FLOPs per token depend on, counted from a `transformers` config on
  the meta device (no memory, no download): the weights a token is multiplied by (all but
  the input-embedding lookup; the output projection counts even when it shares the
  embedding's matrix; a MoE counts its active experts), the layers, the attention width.
  `FlopShape.from_run_dir` reads the model a run saved (final/ or its newest checkpoint).
- `flat_config`: run.json's nested settings as leaves.
- The peak: for NVIDIA GPUs the datasheets' dense peaks (`GPU_PEAK_TFLOPS`, without the 2:4
  sparsity the marketing figures often include); a CPU has no honest datasheet figure that
  matches what PyTorch reaches, so it is measured (`measure_cpu_peak`: the best square matmul
  at the run's dtype and thread count; the best, not the mean, since another process can only
  slow a matmul down). `peak_flops` picks: the user's figure first, then a measured CPU or a
  GPU looked up by name; otherwise `UnknownPeakError` asks for the peak (--peak-tflops).
  `matmul_rate` measures the best rate of one product of a given shape.
"""

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from minirl.models.moe import count_moe_parameters

COMPUTE_DTYPE = {"float8_e4m3fn": "bfloat16"}   # minirl's simulated FP8 rollout computes in bfloat16 (rollout/hf.py)


class FlopShapeError(ValueError):
    """No model configuration to count FLOPs from."""


@dataclass(frozen=True)
class FlopShape:
    """The numbers FLOPs per token depend on."""

    params: float        # weights a token is multiplied by: all but the input-embedding lookup (MoE: active experts)
    layers: int
    attn_dim: int        # query heads x head dim: the width of QK^T and AV
    total_params: float
    dtype: str = "float32"
    name: str = ""

    @classmethod
    def from_config(cls, config, name: str = "") -> "FlopShape":
        """Count a transformers config's weights on the meta device (no memory, no download)."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is embed
        params = total - embed.numel() + (embed.numel() if tied else 0)     # the output projection is a matmul
        if getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None):
            counts = count_moe_parameters(config)
            params -= counts["routed_experts"] * (1 - counts["top_k"] / counts["num_experts"])
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        settings = config.to_dict()
        dtype = str(settings.get("dtype") or settings.get("torch_dtype") or "float32")
        return cls(float(params), text.num_hidden_layers, heads * head_dim, float(total),
                   dtype.removeprefix("torch."), name)

    @classmethod
    def from_run_dir(cls, run_dir) -> "FlopShape":
        """The shape of the model a run trained: its final/ or newest checkpoint's config.json."""
        run_dir = Path(run_dir)
        candidates = [run_dir / "final", *sorted((run_dir / "checkpoints").glob("step-*"), reverse=True)]
        for path in candidates:
            if (path / "config.json").is_file():
                return cls.from_config(AutoConfig.from_pretrained(path), name=str(path))
        raise FlopShapeError(f"{run_dir} holds no model config.json (in final/ or checkpoints/step-*/): the run "
                              "stopped before saving; pass the model's shape (FlopShape.from_config)")


def flat_config(config: dict) -> dict:
    """A nested settings dict (run.json's "config": RLConfig as a dict, maybe with a stage's extra groups) as leaves."""
    flat = {}
    for key, value in config.items():
        flat |= flat_config(value) if isinstance(value, dict) else {key: value}
    return flat


# Dense peaks from NVIDIA's datasheets, TFLOP/s; the first name contained in the device's wins.
# The datasheets print the tensor-core rates with 2:4 structured sparsity; a dense matmul gets
# half: the H100 SXM and H200 SXM datasheets give BF16/FP16 1,979 and FP8 3,958 "with
# sparsity", so 989 and 1,979 dense, and FP32 67 (no sparsity); H100 NVL and H200 NVL give
# BF16 1,671 (835 dense), H100 PCIe 1,513 (756 dense). GH200 ("NVIDIA GH200 ...") matches
# "H200" and has the H100 SXM's figures, the same numbers.
GPU_PEAK_TFLOPS = (
    ("H100 NVL", {"float32": 60.0, "bfloat16": 835.0, "float16": 835.0, "float8_e4m3fn": 1671.0}),
    ("H100 PCIe", {"float32": 51.0, "bfloat16": 756.0, "float16": 756.0, "float8_e4m3fn": 1513.0}),
    ("H100", {"float32": 67.0, "bfloat16": 989.0, "float16": 989.0, "float8_e4m3fn": 1979.0}),       # SXM
    ("H200 NVL", {"float32": 60.0, "bfloat16": 835.0, "float16": 835.0, "float8_e4m3fn": 1671.0}),
    ("H200", {"float32": 67.0, "bfloat16": 989.0, "float16": 989.0, "float8_e4m3fn": 1979.0}),       # SXM
    ("A100", {"float32": 19.5, "bfloat16": 312.0, "float16": 312.0}),
    ("A10G", None),                        # AWS's variant of the A10: no datasheet figures of its own
    ("A10", {"float32": 31.2, "bfloat16": 125.0, "float16": 125.0}),
    ("L40S", {"float32": 91.6, "bfloat16": 362.0, "float16": 362.0, "float8_e4m3fn": 733.0}),
    ("L40", None),
    ("L4", {"float32": 30.3, "bfloat16": 121.0, "float16": 121.0, "float8_e4m3fn": 242.0}),
    ("V100-PCIE", {"float32": 14.0, "float16": 112.0}),
    ("V100", {"float32": 15.7, "float16": 125.0}),                                                   # SXM2
    ("T4", {"float32": 8.1, "float16": 65.0}),
)


class UnknownPeakError(LookupError):
    """No known peak FLOP/s for a device and dtype: pass the peak (peak_tflops / --peak-tflops)."""


def gpu_peak_flops(device_name: str, dtype: str) -> float:
    """The datasheet's dense peak FLOP/s of an NVIDIA GPU (by name) at `dtype`; UnknownPeakError otherwise.

    float32 is plain FP32: PyTorch runs float32 matmuls without TF32 unless told to.
    """
    dtype = COMPUTE_DTYPE.get(dtype, dtype)
    for key, peaks in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            if peaks is None or dtype not in peaks:
                break
            return peaks[dtype] * 1e12
    raise UnknownPeakError(f"no published {dtype} peak for {device_name!r} in minirl's table: pass the device's dense "
                           f"{dtype} peak in TFLOP/s (peak_tflops=..., --peak-tflops)")


@functools.cache
def measure_cpu_peak(dtype: str = "float32", threads: int = 1, seconds: float = 0.6,
                     sizes: tuple[int, ...] = (256, 512)) -> float:
    """The best FLOP/s of a square matmul (torch's CPU GEMM) at `dtype` on `threads` threads, over about `seconds`.

    Each size gets an equal share of the time; the best single product over all sizes is the
    peak (2 n^3 FLOPs each). Cached per arguments: measured once per process.
    """
    dtype = COMPUTE_DTYPE.get(dtype, dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        generator = torch.Generator().manual_seed(0)
        for n in sizes:
            a = torch.randn(n, n, generator=generator).to(getattr(torch, dtype))
            b = torch.randn(n, n, generator=generator).to(getattr(torch, dtype))
            a @ b                                                        # warm-up: allocation, kernel choice
            deadline = time.perf_counter() + seconds / len(sizes)
            while True:
                start = time.perf_counter()
                a @ b
                elapsed = time.perf_counter() - start
                best = max(best, 2 * n ** 3 / elapsed)
                if start + elapsed > deadline:
                    break
    finally:
        torch.set_num_threads(previous)
    return best


def peak_flops(device: str, dtype: str, threads: int = 1, peak_tflops: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s, how it was found) for a run's device ("cpu", "cuda", "cuda:1") and compute dtype.

    peak_tflops: given by the user (wins). A CPU is measured on this machine (analyse a CPU
    run on the machine it ran on, or pass the peak); a CUDA device is looked up by the name
    of this machine's GPU. UnknownPeakError when neither works.
    """
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops={peak_tflops}: must be > 0 (the device's dense peak in TFLOP/s)")
        return peak_tflops * 1e12, f"given: {peak_tflops:g} TFLOP/s"
    compute = COMPUTE_DTYPE.get(dtype, dtype)
    if device.startswith("cpu"):
        return measure_cpu_peak(compute, threads), f"measured: best {compute} matmul, {threads} thread(s), this CPU"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UnknownPeakError(f"the run used {device}, and this machine has no CUDA device to look up: pass the "
                                   f"GPU's dense {compute} peak in TFLOP/s (peak_tflops=..., --peak-tflops)")
        name = torch.cuda.get_device_name(torch.device(device))
        return gpu_peak_flops(name, compute), f"datasheet: {name}, dense {compute}"
    raise UnknownPeakError(f"device {device!r}: no way to know its peak; pass it in TFLOP/s (--peak-tflops)")


def matmul_rate(m: int, k: int, n: int, seconds: float = 0.15) -> float:
    """Best FLOP/s of an [m, k] x [k, n] product on this process's threads, over about `seconds`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best
