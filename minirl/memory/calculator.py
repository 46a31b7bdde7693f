# Generated from notebooks/03_training_memory.py by tools/build.py -- edit the notebook, not this file.
"""Training memory, computed: bytes per parameter, ZeRO stages 0-3, activations and LoRA.

Every function returns bytes (plain Python numbers) and takes raw counts, so the same code
sizes the embedded 1 M-parameter policy and a 70 B model. `ModelShape` holds what the
activation and LoRA formulas need, read from a Hugging Face config without loading weights.

Simplified on purpose: it counts the training state and the activations autograd saves, and
leaves out temporary buffers (collective buckets, fragmentation, the CUDA context) and
data-parallel imbalance. Notebook 03 measures how far those take a real run from it.
"""

__all__ = ["COMPONENTS", "PRECISIONS", "ZERO_LEVELS", "LORA_TARGETS", "GB", "bytes_per_param",
           "state_bytes", "SHARDED", "zero_per_gpu", "zero_saving", "zero_communication",
           "DTYPE_BYTES", "RECOMPUTE", "ATTENTION", "ModelShape", "LLAMA2_70B",
           "checkpointed_activation_bytes", "activation_memory", "lora_params", "lora_memory",
           "training_memory", "min_gpus"]

import math
from dataclasses import dataclass, replace

from minirl.runtime.memory_checks import check_positive, check_precision, check_stage

COMPONENTS = ("weights", "grads", "master", "adam_m", "adam_v")
PRECISIONS = ("mixed", "fp32", "bf16")
ZERO_LEVELS = (0, 1, 2, 3)                # ZeRO's stages: 0 = plain data parallel, 3 = all sharded
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GB = 1e9  # decimal gigabytes, as the source counts


def bytes_per_param(precision: str = "mixed") -> dict[str, int]:
    """Bytes each parameter costs in training state, by component, under `precision`.

    Returns a dict with keys "weights", "grads", "master", "adam_m", "adam_v" and "total"
    (the sum of the five), all ints:
    - "mixed": BF16 weights 2 and gradients 2, FP32 master copy 4, Adam m 4 and v 4 (total 16)
    - "fp32":  FP32 weights 4 and gradients 4, no master copy (0), Adam m 4 and v 4 (total 16)
    - "bf16":  everything BF16: weights 2, gradients 2, no master (0), m 2, v 2 (total 8)
    Any other precision raises ValueError naming `precision` and the valid values.
    """
    check_precision(precision)
    table = {"mixed": (2, 2, 4, 4, 4), "fp32": (4, 4, 0, 4, 4), "bf16": (2, 2, 0, 2, 2)}[precision]
    per = dict(zip(COMPONENTS, table, strict=True))
    per["total"] = sum(table)
    return per


def state_bytes(num_params: float, precision: str = "mixed") -> dict[str, float]:
    """Bytes of each training-state component for `num_params` parameters on one device."""
    check_positive("num_params", num_params)
    return {k: v * num_params for k, v in bytes_per_param(precision).items()}


SHARDED = {0: (), 1: ("master", "adam_m", "adam_v"), 2: ("grads", "master", "adam_m", "adam_v"),
           3: ("weights", "grads", "master", "adam_m", "adam_v")}


def zero_per_gpu(num_params: float, num_gpus: int, stage: int,
                 precision: str = "mixed") -> dict[str, float]:
    """Per-GPU bytes of the training state under ZeRO `stage` on `num_gpus` data-parallel GPUs.

    num_params: Ψ, the model's parameter count (> 0). num_gpus: N, an int >= 1. stage: 0
    (plain DDP: all replicated), 1 (master weights and both Adam moments divided by N), 2 (also
    gradients divided by N), 3 (also weights divided by N). precision: as in `bytes_per_param`.
    Returns a dict of floats with keys "weights", "grads", "master", "adam_m", "adam_v" and
    "total" (their sum): each is Ψ x bytes_per_param(precision)[component], divided by N when the
    stage shards that component. Shards are taken as exactly Ψ/N (real frameworks pad the last
    shard by at most a few elements per tensor).
    Raises ValueError naming the parameter for num_params <= 0, num_gpus not an int >= 1, or a
    stage outside 0..3.
    """
    check_positive("num_params", num_params)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus!r}: must be an int >= 1")
    check_stage(stage)
    per = bytes_per_param(precision)
    out = {k: num_params * per[k] / (num_gpus if k in SHARDED[stage] else 1) for k in COMPONENTS}
    out["total"] = sum(out[k] for k in COMPONENTS)
    return out


def zero_saving(num_gpus: int, stage: int, precision: str = "mixed") -> float:
    """How many times less state a GPU holds under `stage` than under plain DDP (stage 0)."""
    return zero_per_gpu(1.0, num_gpus, 0, precision)["total"] / zero_per_gpu(1.0, num_gpus, stage,
                                                                             precision)["total"]


def zero_communication(num_params: float, num_gpus: int, stage: int,
                       precision: str = "mixed") -> dict[str, float]:
    """Bytes each GPU sends per optimizer step, with ring collectives (the ZeRO paper's §7).

    A ring all-reduce of B bytes sends 2 (N-1)/N B per GPU; a reduce-scatter or an all-gather
    sends (N-1)/N B. DDP all-reduces the gradients. ZeRO-1 and ZeRO-2 reduce-scatter the
    gradients and all-gather the updated weights: the same 2 (N-1)/N Ψ as DDP. ZeRO-3
    all-gathers the weights twice (forward and backward) and reduce-scatters the gradients:
    3 (N-1)/N Ψ, 1.5x DDP. Returns {"bytes": ..., "vs_ddp": ...}. Counts gradient-sized
    messages at the gradient dtype; ignores overlap, latency and bucketing.
    """
    check_positive("num_params", num_params)
    check_stage(stage)
    g = bytes_per_param(precision)["grads"]
    frac = (num_gpus - 1) / num_gpus
    volumes = {0: 2 * frac, 1: 2 * frac, 2: 2 * frac, 3: 3 * frac}
    return {"bytes": volumes[stage] * num_params * g,
            "vs_ddp": volumes[stage] / volumes[0] if num_gpus > 1 else 1.0}


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "full", "sqrt")
ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-style decoder that memory depends on."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    num_params: int | None = None  # exact count when known (from a config); else the closed form

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
                     "vocab_size"):
            check_positive(f"ModelShape.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape: hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads="
                             f"{self.num_heads}, and num_heads by num_kv_heads={self.num_kv_heads}")

    @property
    def kv_dim(self) -> int:
        return self.hidden_size // self.num_heads * self.num_kv_heads

    def param_count(self) -> int:
        """`num_params` if known, else embeddings + L x (attention + MLP + 2 norms) + final norm."""
        if self.num_params is not None:
            return self.num_params
        h, kv, i = self.hidden_size, self.kv_dim, self.intermediate_size
        attn = h * (h + 2 * kv) + (h + 2 * kv) * self.qkv_bias + h * h
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return embed + self.num_layers * layer + h

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a transformers config (Llama, Qwen2, Mistral, ...), sizes checked before any build.

        A `torch.device("meta")` context applies `tie_word_embeddings` as a real build does
        (accelerate's `init_empty_weights` leaves the tie out and counts the embedding twice).
        """
        import torch
        from transformers import AutoModelForCausalLM

        from minirl.runtime.memory_checks import check_model_sizes  # lazy: only config reading needs it

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        sizes = {name: getattr(text, name, None) for name in ("hidden_size", "num_hidden_layers",
                 "intermediate_size", "num_attention_heads", "vocab_size")}
        sizes["num_key_value_heads"] = getattr(text, "num_key_value_heads",
                                               None) or sizes["num_attention_heads"]
        check_model_sizes(sizes)
        shape = cls(hidden_size=sizes["hidden_size"], num_layers=sizes["num_hidden_layers"],
                    intermediate_size=sizes["intermediate_size"],
                    num_heads=sizes["num_attention_heads"],
                    num_kv_heads=sizes["num_key_value_heads"], vocab_size=sizes["vocab_size"],
                    tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                    qkv_bias=bool(getattr(text, "attention_bias",
                                          False) or text.model_type.startswith("qwen2")))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return replace(shape, num_params=sum(p.numel() for p in model.parameters()))  # tied: once

    @classmethod
    def from_pretrained(cls, name_or_path: str) -> "ModelShape":
        """From a model id or local directory: reads config.json only, never the weights."""
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(name_or_path))

    def describe(self) -> str:
        """One line: the sizes the activation and LoRA figures use."""
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, "
                f"intermediate {self.intermediate_size}, "
                f"{self.num_heads} heads ({self.num_kv_heads} KV), vocabulary {self.vocab_size:,}, "
                f"{self.param_count() / 1e9:.3g} B parameters")


# Llama-2-70B: the usual "70 B" (68.98 B parameters; 8 KV heads; 32 k vocabulary).
LLAMA2_70B = ModelShape(hidden_size=8192, num_layers=80, intermediate_size=28672, num_heads=64,
                        num_kv_heads=8, vocab_size=32000)


def checkpointed_activation_bytes(layer_bytes: float, boundary_bytes: float, head_bytes: float,
                                  num_layers: int, recompute: str = "none") -> float:
    """Peak bytes of saved activations for a stack of identical layers under `recompute`.

    layer_bytes: bytes one layer saves for backward (all its internal tensors);
    boundary_bytes: bytes of one layer's input (what a checkpoint keeps);
    head_bytes: bytes the part after the last layer saves (final norm, logits), alive
    only until backward starts; num_layers: L >= 1.
    - "none": L * layer_bytes + head_bytes (all alive at the end of forward).
    - "full": checkpoint every layer: L * boundary_bytes + max(head_bytes, layer_bytes)
      (at the end of forward the head's tensors; in backward one recomputed layer at a time).
    - "sqrt": k = ceil(sqrt(L)) segments of ceil(L / k) layers each:
      k * boundary_bytes + max(head_bytes, ceil(L / k) * layer_bytes).
    Returns a float. Raises ValueError naming `recompute` (valid: "none", "full", "sqrt") or
    `num_layers` (must be an int >= 1).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: must be an int >= 1")
    L = num_layers
    if recompute == "none":
        return L * layer_bytes + head_bytes
    if recompute == "full":
        return L * boundary_bytes + max(head_bytes, layer_bytes)
    k = math.ceil(math.sqrt(L))
    return k * boundary_bytes + max(head_bytes, math.ceil(L / k) * layer_bytes)


def activation_memory(shape: ModelShape, batch: int, seq: int, dtype: str = "bf16",
                      attention: str = "sdpa", recompute: str = "none",
                      padding_mask: bool = False) -> dict[str, float]:
    """Bytes of saved activations for `batch` sequences of `seq` tokens through `shape`.

    Counts what Hugging Face's Llama/Qwen2 layers save (the table above), per GPU, for one
    micro-batch. Returns {"layer", "boundary", "head", "total"}: one layer's saved bytes, one
    layer input, the head's, and the peak under `recompute`. `padding_mask=True` is a batch
    with padding (an attention mask with zeros): HF's SDPA path then repeats K and V to every
    query head (the grouped-query kernel takes no mask) and each layer saves the mask in the
    compute dtype. Leaves out: the embedding's index tensor, RoPE tables, gradients of
    activations in flight (about one layer's worth), and framework buffers. Dropout is off
    (as in RL fine-tuning); dropout would add its masks.
    """
    check_positive("batch", batch)
    check_positive("seq", seq)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(map(repr, DTYPE_BYTES))}")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: use one of {', '.join(map(repr, ATTENTION))}")
    p, h, i, a = DTYPE_BYTES[dtype], shape.hidden_size, shape.intermediate_size, shape.num_heads
    norm = 4 * h + 2 * p * h + 4
    if attention == "sdpa" and padding_mask:
        attn = p * (2 * h + 2 * h) + 4 * a + p * seq     # K, V repeated to h wide; a mask row
    elif attention == "sdpa":
        attn = p * (2 * h + 2 * shape.kv_dim) + 4 * a
    else:
        attn = 4 * p * h + a * seq * (4 + (p if p < 4 else 0))
    tokens = batch * seq
    layer = tokens * (2 * norm + attn + 4 * p * i)
    boundary = tokens * p * h
    head = tokens * (norm + 4 * shape.vocab_size)
    total = checkpointed_activation_bytes(layer, boundary, head, shape.num_layers, recompute)
    return {"layer": float(layer), "boundary": float(boundary), "head": float(head),
            "total": float(total)}


def lora_params(shape: ModelShape, rank: int,
                target_modules=LORA_TARGETS) -> int:
    """Trainable parameters LoRA adds: r x (fan_in + fan_out) per targeted linear, per layer."""
    check_positive("rank", rank)
    h, kv, i = shape.hidden_size, shape.kv_dim, shape.intermediate_size
    sizes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    unknown = [t for t in target_modules if t not in sizes]
    if unknown:
        raise ValueError(f"target_modules={unknown!r}: use names from {', '.join(sizes)}")
    return shape.num_layers * sum(rank * sum(sizes[t]) for t in target_modules)


def lora_memory(num_base_params: float, num_lora_params: float, num_gpus: int = 1, stage: int = 0,
                precision: str = "mixed",
                base_bytes_per_param: float | None = None) -> dict[str, float]:
    """Per-GPU bytes when only LoRA adapters train: a frozen base plus the adapters' full state.

    The frozen base has weights only (no gradients, no optimizer state): `base_bytes_per_param`
    bytes each (default: the precision's weight bytes, 2 for BF16; 0.5 for 4-bit QLoRA), divided
    by N under ZeRO-3. The adapters cost the precision's 16 (or 8) bytes each, sharded by stage
    like any parameter. Returns {"base", "weights", "grads", "master", "adam_m", "adam_v", "total"}.
    """
    check_positive("num_base_params", num_base_params)
    base_b = base_bytes_per_param
    if base_b is None:
        base_b = bytes_per_param(precision)["weights"]
    check_positive("base_bytes_per_param", base_b)
    out = {"base": num_base_params * base_b / (num_gpus if stage == 3 else 1)}
    out.update({k: v for k, v in zero_per_gpu(num_lora_params, num_gpus, stage,
                                              precision).items() if k != "total"})
    out["total"] = sum(out.values())
    return out


def training_memory(num_params: float, num_gpus: int = 1, stage: int = 0, precision: str = "mixed",
                    shape: ModelShape | None = None, global_batch: int = 1, seq: int = 4096,
                    recompute: str = "none", lora_rank: int | None = None,
                    base_bytes_per_param: float | None = None, attention: str = "sdpa",
                    padding_mask: bool = False) -> dict[str, float]:
    """Per-GPU bytes of one training step: state by component + activations + "total".

    global_batch sequences of `seq` tokens are split evenly over the `num_gpus` data-parallel
    GPUs, so global_batch must be divisible by num_gpus. With `lora_rank`, only adapters on
    every linear layer train (see `lora_memory`). Activations use `shape` (default
    Llama-2-70B) in the precision's compute dtype.
    """
    check_positive("num_gpus", num_gpus)
    check_positive("global_batch", global_batch)
    if global_batch % num_gpus:
        raise ValueError(f"global_batch={global_batch} is not divisible by num_gpus={num_gpus}: "
                         "data parallelism gives every GPU the same number of sequences; "
                         "pick a multiple")
    shape = shape or LLAMA2_70B
    if lora_rank is None:
        out = zero_per_gpu(num_params, num_gpus, stage, precision)
    else:
        out = lora_memory(num_params, lora_params(shape, lora_rank), num_gpus, stage, precision,
                          base_bytes_per_param)
    state = out.pop("total")
    dtype = "fp32" if precision == "fp32" else "bf16"
    act = activation_memory(shape, global_batch // num_gpus, seq, dtype, attention, recompute,
                            padding_mask)["total"]
    return {**out, "state": state, "activations": act, "total": state + act}


def min_gpus(num_params: float, gpu_memory_bytes: float, stage: int, precision: str = "mixed",
             activation_bytes: float = 0.0, max_gpus: int = 65536) -> int | None:
    """The fewest data-parallel GPUs on which ZeRO `stage` training fits, or None.

    Per-GPU need with N GPUs = zero_per_gpu(num_params, N, stage, precision)["total"] +
    activation_bytes (the micro-batch per GPU is fixed, so activations do not shrink with N).
    It fits when the need is <= gpu_memory_bytes. Return the smallest int N in 1..max_gpus
    that fits, or None when none does (e.g. stage 0 never shrinks with N; stages 1 and 2 keep
    some state replicated, so they fit only if that part plus activations is below the memory).
    Raises ValueError naming the parameter for num_params or gpu_memory_bytes <= 0, or a bad stage.
    """
    check_positive("num_params", num_params)
    check_positive("gpu_memory_bytes", gpu_memory_bytes)
    check_stage(stage)
    per = zero_per_gpu(num_params, 1, stage, precision)
    sharded = sum(per[k] for k in SHARDED[stage])             # divided by N
    room = gpu_memory_bytes - (per["total"] - sharded) - activation_bytes
    if room < 0 or (room == 0 and sharded > 0):
        return None
    n = max(1, math.ceil(sharded / room)) if sharded > 0 else 1
    while n > 1 and zero_per_gpu(num_params, n - 1, stage,
                                 precision)["total"] + activation_bytes <= gpu_memory_bytes:
        n -= 1                                                  # float rounding, downwards
    while zero_per_gpu(num_params, n, stage,
                       precision)["total"] + activation_bytes > gpu_memory_bytes:
        n += 1                                                  # float rounding, upwards
    return n if n <= max_gpus else None
