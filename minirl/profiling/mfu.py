# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""Model FLOPs utilization (MFU): the FLOPs a step's work needs, from the model's shape, over what the device could do.

MFU = model FLOPs / (peak FLOP/s x seconds). Model FLOPs count what the batch needs, not
what an implementation happens to run:
- a forward pass costs 2 FLOPs per weight per token plus causal attention: token t attends
  to t keys, and QK^T and AV cost 2 x (query heads x head dim) FLOPs each per (query, key)
  pair and layer, so 2 L A T (T + 1) per sequence of T tokens (`forward_flops`);
- a GRPO group's G completions share one prompt, which counts once (`group_forward_flops`);
- training costs three forwards (the backward costs two): 6 N per token (`training_flops`);
- KV-cached generation is the prompt's forward and one forward per fed-back token
  (`generation_flops`);
- gradient checkpointing recomputes the forward in the backward: the hardware does four
  forwards, the model needs three (`step_flops` returns both; MFU uses the model's).
Work an implementation repeats (a prompt recomputed for every row, recomputed activations)
or wastes (padding) is not counted, so it lowers MFU.

Peak FLOP/s: for a CPU, measured (the best rate of a square matmul at the run's dtype and
thread count, `measure_cpu_peak`); for NVIDIA GPUs, the datasheets' dense peaks
(`GPU_PEAK_TFLOPS`); otherwise `UnknownPeakError` asks for the peak (--peak-tflops).

Simplified vs PaLM's and veRL's counters: attention is counted causally (PaLM and veRL count
the whole T x T square, twice ours; it matters only when T approaches the model width); the
input embedding is a lookup and is not counted (veRL counts 2 V H per token for the
embedding and the head even when they share a matrix: on Qwen2.5-0.5B's shape its weight
term is 1.28x ours, notebook 09 computes both); the lengths are the step's means
(records hold totals), which undercounts the attention of uneven rows slightly; the
critic is counted with the policy's shape (its head is one
column, not a vocabulary).
"""

__all__ = ["COMPUTE_DTYPE", "TRAINER_STAGES", "ROLLOUT_STAGES", "FlopShapeError", "FlopShape",
           "forward_flops", "group_forward_flops", "training_flops", "generation_flops", "mfu",
           "step_flops", "flat_config", "MFUReport", "run_mfu", "GPU_PEAK_TFLOPS",
           "UnknownPeakError", "gpu_peak_flops", "measure_cpu_peak", "peak_flops"]

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from minirl.models.moe import count_moe_parameters

COMPUTE_DTYPE = {"float8_e4m3fn": "bfloat16"}   # minirl's simulated FP8 rollout computes in bfloat16 (rollout/hf.py)
TRAINER_STAGES = ("reference", "advantages", "update", "update_critic")
ROLLOUT_STAGES = ("generate",)


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


def forward_flops(params: float, layers: int, attn_dim: int, seq_len: float, sequences: float) -> float:
    """FLOPs of one forward pass over `sequences` causal sequences of `seq_len` tokens each.

    params: weights a token is multiplied by (N); layers: L; attn_dim: query heads x head dim (A).
    Per token, 2 N (a multiply and an add per weight). Attention, per layer and per
    (query, key) pair: QK^T costs 2 A and AV costs 2 A. Token t (1-based) attends to t keys
    (itself and the tokens before it), so a sequence of T tokens has T (T + 1) / 2 pairs.
    Returns sequences x (2 N T + 2 L A T (T + 1)), a float (seq_len may be a mean, not an integer).
    """
    return sequences * (2 * params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1))


def group_forward_flops(params: float, layers: int, attn_dim: int, prompt_len: float, completion_len: float,
                        group_size: int, groups: float) -> float:
    """One forward over `groups` groups of `group_size` completions sharing a prompt, the prompt counted once.

    Per group: F(P) for the prompt, and per completion F(P + C) - F(P) (its C tokens attend
    to the prompt and to each other), with F = forward_flops of one sequence.
    """
    def one(length):
        return forward_flops(params, layers, attn_dim, length, 1)
    return groups * (one(prompt_len) + group_size * (one(prompt_len + completion_len) - one(prompt_len)))


def training_flops(params: float, layers: int, attn_dim: int, prompt_len: float, completion_len: float,
                   group_size: int, groups: float) -> float:
    """An update's model FLOPs: the forward and a backward that costs two forwards (6 N per token)."""
    return 3 * group_forward_flops(params, layers, attn_dim, prompt_len, completion_len, group_size, groups)


def generation_flops(params: float, layers: int, attn_dim: int, prompt_len: float, completion_len: float,
                     group_size: int, groups: float) -> float:
    """KV-cached sampling: the prompt once per group, then C - 1 fed-back tokens per completion (the last is
    sampled from the previous forward and never fed back)."""
    return group_forward_flops(params, layers, attn_dim, prompt_len, max(completion_len - 1.0, 0.0), group_size,
                               groups)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """FLOPs / (peak FLOP/s x seconds): the share of the device's arithmetic the work used."""
    return flops / (peak_flops * seconds) if seconds > 0 and peak_flops > 0 else float("nan")


def step_flops(record: dict, config: dict, shape: FlopShape) -> dict[str, float]:
    """One step's model FLOPs for the rollout and the trainer, and the trainer's hardware FLOPs (with recomputation).

    record: a step record with `tokens/prompt` and `tokens/completion` (the batch's real
    tokens, every row's); config: the run's flat settings (`flat_config(run.json["config"])`).
    The trainer runs forwards without gradients for the reference (beta > 0), pi_old (several
    iterations, the IS correction, or PPO's KL reward) and the critic's values (PPO), then
    num_iterations actor updates and, for PPO, one critic update. With LoRA (stage 4's
    `lora_rank` > 0) the frozen weights get no gradient: an actor update is the forward and
    the backward to the activations, two forwards, not three (the adapters' own FLOPs, a few
    per mille at small ranks, are not counted).
    """
    groups, group_size = config["prompts_per_step"], config["num_generations"]
    rows = groups * group_size
    batch = (record["tokens/prompt"] / rows, record["tokens/completion"] / rows, group_size, groups)
    shape_args = (shape.params, shape.layers, shape.attn_dim)
    forward = group_forward_flops(*shape_args, *batch)
    ppo = config["algo"] == "ppo"
    needs_old = (config["num_iterations"] > 1 or config["importance_sampling_correction"]
                 or (ppo and config["beta"] > 0))
    no_grad = int(config["beta"] > 0) + int(needs_old) + int(ppo)
    updates = config["num_iterations"] + int(ppo)
    actor_update = 2 * forward if config.get("lora_rank") else training_flops(*shape_args, *batch)
    critic_update = int(ppo) * training_flops(*shape_args, *batch)
    trainer = no_grad * forward + config["num_iterations"] * actor_update + critic_update
    recompute = updates * forward if config.get("gradient_checkpointing") else 0.0
    return {"rollout": generation_flops(*shape_args, *batch), "trainer": trainer,
            "trainer_hardware": trainer + recompute}


def flat_config(config: dict) -> dict:
    """A nested settings dict (run.json's "config": RLConfig as a dict, maybe with a stage's extra groups) as leaves."""
    flat = {}
    for key, value in config.items():
        flat |= flat_config(value) if isinstance(value, dict) else {key: value}
    return flat


@dataclass
class MFUReport:
    """Trainer and rollout MFU of a run (None where it cannot be computed; `partial` says why)."""

    trainer: float | None
    rollout: float | None
    trainer_hardware: float | None = None      # HFU: with gradient checkpointing's recomputation
    flops_per_step: dict = field(default_factory=dict)     # {"trainer", "rollout", "trainer_hardware"}: means
    seconds: dict = field(default_factory=dict)            # {"trainer", "rollout"}: totals over the run
    peak: dict = field(default_factory=dict)               # {"trainer", "rollout"}: (FLOP/s, how found)
    partial: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"trainer": self.trainer, "rollout": self.rollout, "trainer_hardware": self.trainer_hardware,
                "flops_per_step": self.flops_per_step, "seconds": self.seconds,
                "peak_flops": {k: v[0] for k, v in self.peak.items()},
                "peak_source": {k: v[1] for k, v in self.peak.items()}, "partial": self.partial}


def run_mfu(records: list[dict], config: dict, shape: FlopShape, peak_trainer: float, peak_rollout: float,
            world_size: int = 1, rollout_world_size: int | None = None) -> MFUReport:
    """MFU of the trainer and the rollout over a run's step records (peaks in FLOP/s per device).

    world_size: devices the times were measured across (their FLOPs are the whole batch's);
    rollout_world_size: the rollout's, where it differs (stage 6's pools; default world_size).
    Records without `tokens/prompt` (written before notebook 09 added it) count the
    completions from `completion_length` and the prompts as 0 tokens: a lower bound, said in `partial`.
    """
    partial, totals = [], {"rollout": 0.0, "trainer": 0.0, "trainer_hardware": 0.0}
    rows = config["prompts_per_step"] * config["num_generations"]
    old = [r for r in records if "tokens/prompt" not in r]
    if old:
        partial.append(f"{len(old)} record(s) carry no tokens/prompt (written before notebook 09): their prompts "
                       "count as 0 tokens, so MFU is a lower bound")
    for record in records:
        if "tokens/prompt" not in record:
            record = {"tokens/prompt": 0, "tokens/completion": record.get("completion_length", 0.0) * rows}
        for key, value in step_flops(record, config, shape).items():
            totals[key] += value
    seconds = {"trainer": sum(r.get(f"time/{s}", 0.0) for r in records for s in TRAINER_STAGES),
               "rollout": sum(r.get(f"time/{s}", 0.0) for r in records for s in ROLLOUT_STAGES)}
    peaks = {"trainer": peak_trainer * world_size, "rollout": peak_rollout * (rollout_world_size or world_size)}
    result = {k: mfu(totals[k], seconds[k], peaks[k]) if seconds[k] > 0 else None for k in ("trainer", "rollout")}
    hardware = mfu(totals["trainer_hardware"], seconds["trainer"], peaks["trainer"]) if seconds["trainer"] else None
    n = max(1, len(records))
    return MFUReport(result["trainer"], result["rollout"], hardware, {k: v / n for k, v in totals.items()}, seconds,
                     partial=partial)


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
