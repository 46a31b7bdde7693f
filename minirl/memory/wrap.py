"""Wrapping a causal LM to save training memory: DDP, ZeRO-1, FSDP2 (ZeRO-2/3), checkpointing, LoRA.

Hand-written: notebook 03 measures memory with these wrappers and notebook 04 trains with them.

One function per concern, all stock PyTorch and peft:
- `apply_lora(model, rank, ...)`: peft LoRA adapters on the named linear layers, base frozen;
- `set_checkpointing(model, on)`: per-decoder-layer gradient checkpointing (transformers');
- `wrap_model(model, zero, device, ...)`: ZeRO 0 and 1 = DDP, 2 = FSDP2 `fully_shard` per
  decoder layer keeping weights gathered from forward to backward, 3 = FSDP2 resharding after
  forward; with an optional MixedPrecisionPolicy and CPU offload;
- `make_optimizer(wrapped, ...)`: the optimizer over the trainable tensors (ZeRO-1 shards its
  state with ZeroRedundancyOptimizer).
Notebook 03 measures memory with these wrappers; notebook 04 trains with them (and explains them).

Simplified vs accelerate/TRL: no FSDP1, DeepSpeed or HSDP (one flat mesh). ZeRO-2 here is
FSDP2 without resharding after forward, which still reshards after backward, so between
steps it holds ZeRO-3's shard (DeepSpeed's ZeRO-2 keeps the whole weights).
"""


import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from minirl.memory.calculator import LORA_TARGETS, ZERO_LEVELS
from minirl.runtime.validate import ConfigError, check_choice, check_int


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (or of a peft model around one), in order.

    Found by the class names the model lists in `_no_split_modules`, the units accelerate and
    TRL shard for FSDP (also after FSDP2 has wrapped them in subclasses of their own). Raises
    ValueError when the model names none.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]  # FSDP2 subclasses
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder-layer class in _no_split_modules ({sorted(names)}); "
                         "FSDP2 shards one decoder layer at a time: pass a transformers causal LM")
    return layers


def set_checkpointing(model: nn.Module, on: bool, reentrant: bool = False) -> None:
    """Per-decoder-layer gradient checkpointing on a transformers model (or a peft model around one).

    reentrant=True is what notebook 03's saved-tensor meter can see; training uses the
    non-reentrant variant (PyTorch's recommendation, and what works with FSDP2 and frozen inputs).
    """
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 renamed it
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=LORA_TARGETS,
               dropout: float = 0.0) -> nn.Module:
    """`model` with peft LoRA adapters of rank `rank` on every linear layer named in `targets`.

    The base weights are frozen; each targeted layer computes W x + (alpha / r) B A x with A
    (r x in) random and B (out x r) zero, so the adapted model starts as the base model.
    alpha defaults to 2 * rank. Raises ConfigError when a target matches no linear layer,
    listing the linear layers the model has.
    """
    check_int("lora_rank", rank, low=1)
    targets = tuple(targets)
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    unmatched = [t for t in targets if t not in linear]
    if not targets or unmatched:
        raise ConfigError("lora_target_modules", ",".join(targets),
                          f"{unmatched or 'nothing'} matches no linear layer of {type(model).__name__}; its linear "
                          f"layers are named {', '.join(linear)}")
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout, target_modules=list(targets))
    with warnings.catch_warnings():     # peft calls a transformers method deprecated in 5.x; not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


@dataclass
class Wrapped:
    """A model wrapped for data-parallel training."""

    wrapper: nn.Module     # what to call: the DDP wrapper, or the FSDP2-sharded model itself
    module: nn.Module      # the model underneath (Hugging Face or peft; DDP's `.module`): names, config, parameters
    zero: int


def wrap_model(model: nn.Module, zero: int, device: torch.device | str = "cpu", mixed_precision: str = "no",
               cpu_offload: bool = False, process_group=None) -> Wrapped:
    """Wrap `model` (moved to `device`) for ZeRO stage `zero` in the default process group.

    0, 1: DistributedDataParallel with gradients as views of its buckets (one copy of the
    gradients, not two); ZeRO-1's sharded optimizer comes from `make_optimizer`.
    2, 3: FSDP2 `fully_shard` on each decoder layer, then on the whole model, with
    reshard_after_forward = (zero == 3); mixed_precision "bf16" or "fp16" adds a MixedPrecisionPolicy
    (bfloat16 / float16 compute on float32 shards, float32 gradient reduction), cpu_offload a
    CPUOffloadPolicy. DDP has no such policy: its caller runs the step under autocast instead.
    process_group: DDP over this torch.distributed subgroup instead (zero 0 only; the
    data-parallel ranks of a Ray pool, notebook 06).
    """
    check_choice("zero", zero, ZERO_LEVELS)
    check_choice("mixed_precision", mixed_precision, ("no", "bf16", "fp16"))
    if process_group is not None and zero != 0:
        raise ConfigError("zero", zero, "a process group other than the default one is supported by DDP alone; "
                                        "use zero 0")
    device = torch.device(device)
    model.to(device)
    if zero <= 1:
        if mixed_precision != "no" or cpu_offload:
            raise ConfigError("zero", zero, "mixed precision and CPU offload are FSDP2's policies; use zero 2 or 3 "
                                            "(DDP: mixed_precision='no' and the step under torch.autocast)")
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, process_group=process_group)
        return Wrapped(ddp, model, zero)
    kwargs = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),)), "reshard_after_forward": zero == 3}
    if mixed_precision != "no":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed_precision == "bf16" else
                                                   torch.float16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return Wrapped(model, model, zero)


def make_optimizer(wrapped: Wrapped, optimizer_class=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
    """`optimizer_class(**kwargs)` over the trainable parameters; under ZeRO-1 each rank keeps the state of
    its share of the tensors (ZeroRedundancyOptimizer, which hands out whole tensors)."""
    params = [p for p in wrapped.module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the wrapped model has no trainable parameters (is everything frozen?)")
    if wrapped.zero == 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
    return optimizer_class(params, **kwargs)
