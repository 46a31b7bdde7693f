# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Stage 4's settings: how the trainer is sharded, LoRA, how weights reach the engine, how vLLM is sized.

The algorithm, sampling, optimizer and run settings stay in RLConfig (notebook 01), the
engine too (`rollout_engine`, a name of notebook 01's engine registry, vLLM included); a
stage-4 run adds these. Every value is checked when the dataclass is built, and
`check_parallel` adds the checks that need the world size or the RLConfig, so that every
rank of a job refuses a bad one before it loads anything.

Importing it is light (no torch): a chapter builds its flags from these fields and refuses a
bad command line before the heavy imports.
"""

__all__ = ["MIXED_PRECISION", "ParallelConfig", "check_parallel"]

from dataclasses import dataclass

from minirl.config import RLConfig
from minirl.memory.calculator import LORA_TARGETS, ZERO_LEVELS
from minirl.rollout.registry import check_engine
from minirl.runtime.validate import ConfigError, check_choice, check_float, check_int
from minirl.sync.modes import SYNC_MODES

MIXED_PRECISION = ("none", "bf16")


@dataclass
class ParallelConfig:
    """How a data-parallel GRPO run shards, adapts and synchronizes (chapters/04_fsdp_lora.py's flags)."""

    zero: int = 3                      # 0: DDP; 1: + sharded Adam (ZeRO-1); 2, 3: FSDP2 (ZeRO-2 / ZeRO-3)
    lora_rank: int = 0                 # LoRA rank r (peft); 0: full fine-tuning
    lora_alpha: float = 0.0            # LoRA's alpha: the update is (alpha / r) B A; 0: 2 * lora_rank
    lora_target_modules: str = ",".join(LORA_TARGETS)  # comma-separated names of the adapted linear layers
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    mixed_precision: str = "none"      # bf16: FSDP2 computes in bfloat16, reduces in float32 (zero 2, 3)
    cpu_offload: bool = False          # FSDP2 keeps shards, gradients and Adam in CPU memory (CUDA, zero 2, 3)
    sync_mode: str = "auto"            # full, merged (LoRA folded in), adapter (A and B only); auto: by LoRA
    packed_sync: bool = True           # whole layers packed into one all-gather per bucket; off: one per tensor
    sync_bucket_mb: float = 256.0      # packed: layers share one all-gather up to this many MiB; 0: one layer
    sync_every: int = 1                # push the weights every K steps: batches up to K-1 updates stale
    colocate: bool = True              # the engine releases its weights during the update, refilled at the sync
    backend: str = "auto"              # process-group backend: auto picks nccl on CUDA, gloo on CPU
    verify_sync: bool = False          # after every push, compare every engine tensor with the trainer's (slow)
    seed_per_prompt: bool = False      # a seed per prompt: the batch does not depend on the world size (slower)
    vllm_gpu_memory_utilization: float = 0.3  # vllm engine: the share of the GPU it may take (the trainer's: the rest)
    vllm_max_num_batched_tokens: int = 4096   # vllm engine: tokens per scheduler step (TRL's colocate value)

    choices = {"zero": ZERO_LEVELS, "sync_mode": ("auto", *SYNC_MODES),
               "mixed_precision": MIXED_PRECISION, "backend": ("auto", "gloo", "nccl")}

    def __post_init__(self):
        for name, allowed in self.choices.items():
            check_choice(name, getattr(self, name), allowed)
        check_int("lora_rank", self.lora_rank, low=0, why="0 is full fine-tuning")
        check_float("lora_alpha", self.lora_alpha, low=0.0, why="0: twice the rank")
        check_float("sync_bucket_mb", self.sync_bucket_mb, low=0.0, why="0: one decoder layer per all-gather")
        check_float("vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, low=0.0, high=1.0,
                    low_open=True)
        check_int("vllm_max_num_batched_tokens", self.vllm_max_num_batched_tokens, low=1)
        check_int("sync_every", self.sync_every, low=1, why="1: push after every update; K: after every K-th, "
                                                          "the rollout up to K-1 updates behind")
        if self.sync_every > 1 and self.colocate:
            raise ConfigError("sync_every", self.sync_every, "a colocated engine discards its weights after every "
                                                             "generate, so every step must refill them: pass "
                                                             "--no-colocate (the engine keeps its copy), or "
                                                             "--sync-every 1")
        if self.lora_rank and not self.targets:
            raise ConfigError("lora_target_modules", self.lora_target_modules, "name at least one linear layer")
        mode = self.resolved_sync_mode
        if mode in ("merged", "adapter") and not self.lora_rank:
            raise ConfigError("sync_mode", self.sync_mode, "merging or shipping an adapter needs LoRA: pass "
                                                           "--lora-rank R, or --sync-mode full")
        if mode == "full" and self.lora_rank:
            raise ConfigError("sync_mode", self.sync_mode, "with LoRA the engine needs the adapter merged "
                                                           "(--sync-mode merged) or applied (--sync-mode adapter)")
        if self.zero < 2 and (self.mixed_precision != "none" or self.cpu_offload):
            flag = "mixed_precision" if self.mixed_precision != "none" else "cpu_offload"
            raise ConfigError(flag, getattr(self, flag), f"is FSDP2's (MixedPrecisionPolicy / CPUOffloadPolicy) and "
                                                         f"--zero {self.zero} is DDP; use --zero 2 or 3")

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_target_modules.split(",") if t.strip())

    @property
    def alpha(self) -> float:
        return self.lora_alpha or 2.0 * self.lora_rank

    @property
    def resolved_sync_mode(self) -> str:
        if self.sync_mode != "auto":
            return self.sync_mode
        return "merged" if self.lora_rank else "full"


def check_parallel(pconfig: ParallelConfig, config: RLConfig, world_size: int) -> None:
    """The checks that need the world size or both configs; ConfigError naming the flag and the fix.

    Run on every rank before anything is loaded: each rank reaches the same verdict on its
    own, so the job stops everywhere with the cause and no rank waits for another.
    """
    B = config.run.prompts_per_step
    if B % world_size:
        raise ConfigError("prompts_per_step", B, f"{B} prompts do not divide over {world_size} ranks; every rank "
                                                 f"needs the same number of whole prompts: use a multiple of "
                                                 f"{world_size}, e.g. {world_size * max(1, B // world_size)}")
    if config.algorithm.algo != "grpo":
        raise ConfigError("algo", config.algorithm.algo, "stage 4 trains GRPO (the critic is not sharded here); "
                                                         "use --algo grpo, or chapters/01_single_process.py for PPO")
    cuda = config.run.device.startswith("cuda")
    if pconfig.cpu_offload and not cuda:
        raise ConfigError("cpu_offload", True, "moves FSDP2's shards from the GPU to CPU memory, and this run is "
                                               "already on the CPU; drop --cpu-offload")
    check_engine(config)                     # a name of the registry, and one this machine can run (vLLM: CUDA)
    if config.rollout.rollout_engine == "vllm":
        if pconfig.verify_sync:
            raise ConfigError("verify_sync", True, "vLLM keeps its weights fused inside its workers and cannot "
                                                   "hand them back by name; drop --verify-sync with "
                                                   "--rollout-engine vllm")
        if pconfig.resolved_sync_mode == "adapter":
            raise ConfigError("sync_mode", "adapter", "minirl's vLLM engine takes whole (merged) weights; vLLM "
                                                      "serves adapters through LoRA requests, not wired here: "
                                                      "use --sync-mode merged with --rollout-engine vllm")
