"""Stage 4's flag checks: every value of a ParallelConfig, and the checks that need the world size or both configs.

Hand-written plumbing (notebook 04 uses it). `check_parallel_config` runs when a
`ParallelConfig` is built (its `__post_init__`); `check_parallel` runs on every rank before
anything is loaded: each rank reaches the same verdict on its own (a flag is the same
everywhere), so the job stops on every rank with the cause and no rank waits for another.
Each check raises ConfigError naming the flag and the fix. Light: no torch import.
"""

from minirl.config import RLConfig
from minirl.rollout.registry import check_engine
from minirl.runtime.validate import ConfigError, check_choice, check_float, check_int


def check_parallel_config(pconfig) -> None:
    """Every field of a ParallelConfig (notebook 04) on its own, and the pairs of fields that exclude each other."""
    for name, allowed in pconfig.choices.items():
        check_choice(name, getattr(pconfig, name), allowed)
    check_int("lora_rank", pconfig.lora_rank, low=0, why="0 is full fine-tuning")
    check_float("lora_alpha", pconfig.lora_alpha, low=0.0, why="0: twice the rank")
    check_float("sync_bucket_mb", pconfig.sync_bucket_mb, low=0.0, why="0: one decoder layer per all-gather")
    check_float("vllm_gpu_memory_utilization", pconfig.vllm_gpu_memory_utilization, low=0.0, high=1.0,
                low_open=True)
    check_int("vllm_max_num_batched_tokens", pconfig.vllm_max_num_batched_tokens, low=1)
    check_int("sync_every", pconfig.sync_every, low=1, why="1: push after every update; K: after every K-th, "
                                                         "the rollout up to K-1 updates behind")
    if pconfig.sync_every > 1 and pconfig.colocate:
        raise ConfigError("sync_every", pconfig.sync_every, "a colocated engine discards its weights after every "
                                                            "generate, so every step must refill them: pass "
                                                            "--no-colocate (the engine keeps its copy), or "
                                                            "--sync-every 1")
    if pconfig.lora_rank and not pconfig.targets:
        raise ConfigError("lora_target_modules", pconfig.lora_target_modules, "name at least one linear layer")
    mode = pconfig.resolved_sync_mode
    if mode in ("merged", "adapter") and not pconfig.lora_rank:
        raise ConfigError("sync_mode", pconfig.sync_mode, "merging or shipping an adapter needs LoRA: pass "
                                                          "--lora-rank R, or --sync-mode full")
    if mode == "full" and pconfig.lora_rank:
        raise ConfigError("sync_mode", pconfig.sync_mode, "with LoRA the engine needs the adapter merged "
                                                          "(--sync-mode merged) or applied (--sync-mode adapter)")
    if pconfig.zero < 2 and pconfig.cpu_offload:
        raise ConfigError("cpu_offload", pconfig.cpu_offload, f"is FSDP2's (CPUOffloadPolicy) and --zero "
                                                              f"{pconfig.zero} is DDP; use --zero 2 or 3")


def check_parallel(pconfig, config: RLConfig, world_size: int) -> None:
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
