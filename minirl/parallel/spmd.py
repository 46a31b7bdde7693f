# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The stage-4 run: every rank runs notebook 01's `rl_step` on its share of the batch (SPMD).

Simplified vs NeMo-Aligner / veRL: every rank holds a whole engine copy (no tensor-parallel
rollout), GRPO only.
"""

__all__ = ["SPMDState", "setup_spmd", "spmd_step"]

from dataclasses import dataclass

import torch

from minirl.config import RLConfig
from minirl.memory.wrap import apply_lora, set_checkpointing, wrap_model
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import DistContext, ProcessGroup, rank_slice
from minirl.parallel.roles import DistributedActor
from minirl.roles.reference import Reference
from minirl.runtime.spmd_support import KeepWeights, build_rank_engine, rank_records, sync_due
from minirl.sync.sharded import ShardedSync
from minirl.train.run import RunState
from minirl.train.step import Roles, rl_step, sample_prompts


@dataclass
class SPMDState(RunState):
    """A RunState with what a rank of a data-parallel run also needs."""

    pconfig: ParallelConfig | None = None
    ctx: DistContext | None = None
    group: ProcessGroup | None = None
    sampling_generator: torch.Generator | None = None   # this rank's own sampling seeds
    lag: int = 0                                        # updates the engine's weights are behind


def setup_spmd(config: RLConfig, pconfig: ParallelConfig, model, tokenizer, rows: list[dict],
               reward_funcs: list,
               ctx: DistContext, reward_weights: list[float] | None = None) -> SPMDState:
    """Every rank: reference, engine, LoRA, wrapped actor, sync; version 0 pushed (or it fails)."""
    model.to(ctx.device).eval()
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    mode = pconfig.resolved_sync_mode
    prompts = [r["prompt"] for r in rows]
    engine = None
    if mode != "adapter":                                 # the engine holds the base model
        engine = build_rank_engine(config, pconfig, model, tokenizer, ctx.device, prompts)
    if pconfig.lora_rank:
        model = apply_lora(model, pconfig.lora_rank, pconfig.alpha, pconfig.targets)
    if engine is None:                                    # adapter only: base + adapter
        engine = build_rank_engine(config, pconfig, model, tokenizer, ctx.device)
    if pconfig.gradient_checkpointing:
        set_checkpointing(model, True)
    fsdp_precision = config.resolved_mixed_precision if pconfig.zero >= 2 else "no"   # DDP: the step autocasts
    wrapped = wrap_model(model, pconfig.zero, ctx.device, fsdp_precision, pconfig.cpu_offload)
    group = ProcessGroup(ctx.device)
    actor = DistributedActor(wrapped, config.algorithm, config.optimizer, config.sampling, group,
                             checkpointing=pconfig.gradient_checkpointing)
    scaling = pconfig.alpha / pconfig.lora_rank if pconfig.lora_rank else None
    sync = ShardedSync(mode, scaling, pconfig.verify_sync,
                       packed=pconfig.packed_sync, bucket_bytes=int(pconfig.sync_bucket_mb * 2**20))
    sync.push(actor.named_weights(), engine, 0)           # every name and shape checked now
    seed, own = config.run.seed, config.run.seed + 1_000_003 * (ctx.rank + 1)   # own: this rank's
    return SPMDState(config, Roles(actor, reference), engine, sync,
                     torch.Generator().manual_seed(seed), rows,
                     reward_funcs, reward_weights, pconfig=pconfig, ctx=ctx, group=group,
                     sampling_generator=torch.Generator().manual_seed(own))


def spmd_step(state: SPMDState) -> dict:
    """One step on this rank: the global batch (the same on every rank), its share, rl_step."""
    config, group = state.config, state.group
    rows = sample_prompts(state.rows, config.run.prompts_per_step, state.generator)
    mine = rank_slice(rows, group.rank, group.world_size)
    sampler = state.generator if state.pconfig.seed_per_prompt else state.sampling_generator
    staleness, due = state.lag, sync_due(state.step + 1, state.pconfig, config)
    sync = state.sync if due else KeepWeights()
    record = rl_step(state.roles, state.engine, sync, mine, state.reward_funcs, config, sampler,
                     group=group, trainer_state=state.trainer_state,
                     reward_weights=state.reward_weights)
    state.lag = 0 if due else state.lag + 1
    report, stats = state.sync.last_report, getattr(state.engine, "stats", {})
    record |= {"sync/peak_bytes": report.peak_bytes if due else 0,
               "sync/tensors": report.tensors if due else 0, "sync/pushed": int(due),
               "staleness": staleness, "time/sleep": stats.get("sleep_seconds", 0.0),
               "time/wake": stats.get("wake_seconds", 0.0)}
    return record | rank_records(record, group)       # per-reward means and each rank's times
