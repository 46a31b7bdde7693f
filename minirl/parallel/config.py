# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Stage 4's settings beyond RLConfig: sharding, LoRA, how weights reach the engine (no torch)."""

__all__ = ["ParallelConfig"]

from dataclasses import dataclass

from minirl.memory.calculator import LORA_TARGETS, ZERO_LEVELS
from minirl.runtime.parallel_checks import check_parallel_config
from minirl.sync.modes import SYNC_MODES


@dataclass
class ParallelConfig:
    """How a data-parallel GRPO run shards, adapts and syncs (chapters/04_fsdp_lora.py's flags)."""

    zero: int = 3                      # 0: DDP; 1: + sharded Adam; 2, 3: FSDP2 (ZeRO-2 / ZeRO-3)
    lora_rank: int = 0                 # LoRA rank r (peft); 0: full fine-tuning
    lora_alpha: float = 0.0            # the update is (alpha / r) B A; 0: 2 * lora_rank
    lora_target_modules: str = ",".join(LORA_TARGETS)  # comma-separated names of the adapted layers
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    cpu_offload: bool = False          # FSDP2 keeps shards, gradients and Adam in CPU memory (CUDA)
    sync_mode: str = "auto"            # full, merged, adapter (A and B only); auto: by LoRA
    packed_sync: bool = True           # one all-gather per bucket of whole layers; off: per tensor
    sync_bucket_mb: float = 256.0      # packed: MiB of layers per all-gather; 0: one layer
    sync_every: int = 1                # push every K steps: batches up to K-1 updates stale
    colocate: bool = True              # the engine releases its weights during the update
    backend: str = "auto"              # process-group backend: auto picks nccl on CUDA, gloo on CPU
    verify_sync: bool = False          # after every push, compare the engine's tensors with ours
    seed_per_prompt: bool = False      # a seed per prompt: batches independent of the world size
    vllm_gpu_memory_utilization: float = 0.3  # vllm engine: the share of the GPU it may take
    vllm_max_num_batched_tokens: int = 4096   # vllm engine: tokens per scheduler step (TRL's value)

    choices = {"zero": ZERO_LEVELS, "sync_mode": ("auto", *SYNC_MODES),
               "backend": ("auto", "gloo", "nccl")}

    def __post_init__(self):
        check_parallel_config(self)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_target_modules.split(",") if t.strip())

    @property
    def alpha(self) -> float:
        return self.lora_alpha or 2.0 * self.lora_rank

    @property
    def resolved_sync_mode(self) -> str:
        """The mode "auto" resolves to: merged with LoRA, full without."""
        if self.sync_mode != "auto":
            return self.sync_mode
        return "merged" if self.lora_rank else "full"
