# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The stage-4 run: every rank runs notebook 01's `rl_step` on its share of the batch (SPMD).

`setup_spmd` builds, on every rank, the reference copy (beta > 0), the rank's engine (a full
copy of the policy beside its trainer shard: colocated), the LoRA adapters, the wrapped
trainer (`DistributedActor`) and the `ShardedSync`, and pushes version 0 so that a bad
engine fails before any step. `spmd_step` draws the global batch from the generator every
rank shares, keeps this rank's share and calls `rl_step` with the process group; with
`sync_every` K > 1 only every K-th step pushes (`sync_due`; the others hand `rl_step` a
`KeepWeights`). `run` and the callbacks of notebook 01 drive it unchanged. Evaluating and
exporting the policy: `minirl/runtime/policy_export.py`; the sync's cost: `minirl/runtime/sync_meter.py`.

Simplified vs NeMo-Aligner / veRL: every rank holds a whole engine copy (no tensor-parallel
rollout), GRPO only, one model family's decoder layers per FSDP unit.
"""

__all__ = ["SPMDState", "build_rank_engine", "setup_spmd", "KeepWeights", "sync_due", "spmd_step"]

from dataclasses import dataclass

import torch

from minirl.config import RLConfig
from minirl.memory.wrap import apply_lora, set_checkpointing, wrap_model
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import DistContext, ProcessGroup, rank_slice
from minirl.parallel.roles import DistributedActor
from minirl.roles.reference import Reference
from minirl.rollout.base import Colocated
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.registry import build_engine
from minirl.runtime.prompt_seeds import SeedPerPrompt
from minirl.sync.base import SyncReport
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
    lag: int = 0                                        # updates the engine's weights are behind the trainer's


def build_rank_engine(config: RLConfig, pconfig: ParallelConfig, model, tokenizer, device, prompts=()):
    """This rank's engine holding a copy of `model` (version 0), built by the engine registry, colocated.

    An engine that colocates itself (vLLM's sleep mode: the `Colocated` protocol) is used as
    built; an in-process one is wrapped in `ColocatedEngine` (and `SeedPerPrompt`).
    prompts: the task's, which size vLLM's max_model_len (the model's context without them)."""
    engine = build_engine(config, model, tokenizer, device, colocate=pconfig.colocate, prompts=tuple(prompts),
                          gpu_memory_utilization=pconfig.vllm_gpu_memory_utilization,
                          max_num_batched_tokens=pconfig.vllm_max_num_batched_tokens)
    if isinstance(engine, Colocated):
        return engine
    if pconfig.seed_per_prompt:
        engine = SeedPerPrompt(engine)
    return ColocatedEngine(engine, colocate=pconfig.colocate, adapter_only=pconfig.resolved_sync_mode == "adapter")


def setup_spmd(config: RLConfig, pconfig: ParallelConfig, model, tokenizer, rows: list[dict], reward_funcs: list,
               ctx: DistContext, reward_weights: list[float] | None = None) -> SPMDState:
    """Every rank: reference, engine, LoRA, wrapped actor, sync; version 0 pushed (bad engines fail here).

    rows: the task's training rows; reward_funcs, reward_weights: its rewards (TRL's signature and
    weights; None: 1 each)."""
    model.to(ctx.device).eval()
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    mode = pconfig.resolved_sync_mode
    engine = None if mode == "adapter" else build_rank_engine(config, pconfig, model, tokenizer, ctx.device,
                                                              [r["prompt"] for r in rows])
    if pconfig.lora_rank:
        model = apply_lora(model, pconfig.lora_rank, pconfig.alpha, pconfig.targets)
    if engine is None:                                    # adapter-only: the engine holds base + adapter
        engine = build_rank_engine(config, pconfig, model, tokenizer, ctx.device)
    if pconfig.gradient_checkpointing:
        set_checkpointing(model, True)
    wrapped = wrap_model(model, pconfig.zero, ctx.device, pconfig.mixed_precision, pconfig.cpu_offload)
    group = ProcessGroup(ctx.device)
    actor = DistributedActor(wrapped, config.algorithm, config.optimizer, config.sampling, group,
                             checkpointing=pconfig.gradient_checkpointing)
    sync = ShardedSync(mode, pconfig.alpha / pconfig.lora_rank if pconfig.lora_rank else None, pconfig.verify_sync,
                       packed=pconfig.packed_sync, bucket_bytes=int(pconfig.sync_bucket_mb * 2**20))
    sync.push(actor.named_weights(), engine, 0)           # every name and shape checked before any step
    seed = config.run.seed
    return SPMDState(config, Roles(actor, reference), engine, sync, torch.Generator().manual_seed(seed), rows,
                     reward_funcs, reward_weights, pconfig=pconfig, ctx=ctx, group=group,
                     sampling_generator=torch.Generator().manual_seed(seed + 1_000_003 * (ctx.rank + 1)))


class KeepWeights:
    """The sync of a step that does not synchronize: the engine keeps the weights (and version) it holds.

    push() moves nothing and reports the engine's own version, so `rl_step` keeps expecting
    the version the engine really holds: the next batch is generated, version-checked and
    logged (`generated_version`, the rollout's log-probs that an importance-sampling
    correction divides by) as the older policy it is. A version counts pushes, not updates.
    """

    def push(self, named_weights, engine, version: int) -> SyncReport:
        return SyncReport(engine.version, 0, 0, 0.0)


def sync_due(step: int, pconfig: ParallelConfig, config: RLConfig) -> bool:
    """Whether step `step` (1, 2, ...) pushes its update to the engine.

    Every `sync_every`-th step, and always the steps that evaluate, checkpoint or end the
    run: an evaluation measures the engine's copy (it must be the trainer's latest), and a
    resume refills the engine from the restored trainer (the engine must have held those
    weights when the checkpoint was taken, or the resumed run would differ). Between two
    pushes the engine generates with weights up to sync_every - 1 updates old.
    """
    run = config.run
    return (step % pconfig.sync_every == 0 or step == run.steps
            or bool(run.eval_every and step % run.eval_every == 0)
            or bool(run.checkpoint_every and step % run.checkpoint_every == 0))


def spmd_step(state: SPMDState) -> dict:
    """One step on this rank: the global batch's draw (the same on every rank), this rank's share, rl_step."""
    config, group = state.config, state.group
    rows = sample_prompts(state.rows, config.run.prompts_per_step, state.generator)
    mine = rank_slice(rows, group.rank, group.world_size)
    sampler = state.generator if state.pconfig.seed_per_prompt else state.sampling_generator
    staleness, due = state.lag, sync_due(state.step + 1, state.pconfig, config)
    sync = state.sync if due else KeepWeights()
    record = rl_step(state.roles, state.engine, sync, mine, state.reward_funcs, config, sampler, group=group,
                     reward_weights=state.reward_weights)
    state.lag = 0 if due else state.lag + 1
    report, stats = state.sync.last_report, getattr(state.engine, "stats", {})
    record |= {"sync/peak_bytes": report.peak_bytes if due else 0, "sync/tensors": report.tensors if due else 0,
               "sync/pushed": int(due), "staleness": staleness,
               "time/sleep": stats.get("sleep_seconds", 0.0), "time/wake": stats.get("wake_seconds", 0.0)}
    local = {k: v for k, v in record.items() if k.startswith(("time/", "rewards/")) or k == "reward_errors"}
    everyone = group.gather_objects(local)
    for key in local:
        if key.startswith("rewards/"):                    # equal shares: the mean of the ranks' means
            record[key] = sum(r[key] for r in everyone) / len(everyone)
    record["reward_errors"] = sum(r.get("reward_errors", 0) for r in everyone)
    record["time_by_rank"] = [{k: v for k, v in r.items() if k.startswith("time/")} for r in everyone]
    return record
