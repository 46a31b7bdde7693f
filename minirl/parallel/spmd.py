# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The stage-4 run: every rank runs notebook 01's `rl_step` on its share of the batch (SPMD).

`setup_spmd` builds, on every rank, the reference copy (beta > 0), the rank's engine (a full
copy of the policy beside its trainer shard: colocated), the LoRA adapters, the wrapped
trainer (`DistributedActor`) and the `ShardedSync`, and pushes version 0 so that a bad
engine fails before any step. `spmd_step` draws the global batch from the generator every
rank shares, keeps this rank's share and calls `rl_step` with the process group; with
`sync_every` K > 1 only every K-th step pushes its update (`sync_due`; the other steps hand
`rl_step` a `KeepWeights`, and the engine generates with weights up to K-1 updates old,
recorded per step as `staleness`). `run` and the callbacks of notebook 01 drive it
unchanged. `evaluate_engine` scores a task's held-out rows on the engine's copy (the
trainer's latest weights, whole), and `export_policy` gathers the (LoRA-merged) policy
into a Hugging Face directory.

Simplified vs NeMo-Aligner / veRL: every rank holds a whole engine copy (no tensor-parallel
rollout), GRPO only, one model family's decoder layers per FSDP unit.
"""

__all__ = ["SPMDState", "build_rank_engine", "setup_spmd", "KeepWeights", "sync_due", "spmd_step",
           "sync_table", "innermost", "evaluate_engine", "export_policy"]

import errno
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

from minirl.config import RLConfig
from minirl.memory.wrap import apply_lora, set_checkpointing, wrap_model
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import DistContext, ProcessGroup, agree, rank_slice
from minirl.parallel.roles import DistributedActor
from minirl.parallel.stops import deferred_signals
from minirl.roles.reference import Reference
from minirl.rollout.base import Colocated
from minirl.rollout.colocated import ColocatedEngine, SeedPerPrompt
from minirl.rollout.registry import build_engine
from minirl.sync.base import SyncReport
from minirl.sync.sharded import ShardedSync, SinkEngine, engine_tensors, gather_buckets
from minirl.tasks.task import Task
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


def sync_table(state: SPMDState, metrics: list[dict], repeats: int = 5) -> list[dict]:
    """Seconds, bytes and share of the step of one sync in each mode and transfer this run can ship.

    Every rank calls it (the pushes are collectives). Each mode ("full"; with LoRA also
    "merged" and "adapter") is pushed into a `SinkEngine` three ways: one all-gather per
    tensor, one per layer (packed), and packed in buckets of the run's `sync_bucket_mb` (if > 0);
    once to allocate, then `repeats` times in turn (the machine's load hits every row alike),
    timed (median). "full" ships every tensor unmerged (for a LoRA run: the base weights, as
    full fine-tuning ships them). share = seconds / this run's median step (rank 0's clock).
    """
    steps = [m["time/step"] for m in metrics if "time/step" in m]
    step_time = statistics.median(steps) if steps else float("nan")
    scaling = state.sync.lora_scaling
    modes = ("full", "merged", "adapter") if scaling is not None else ("full",)
    bucket = state.sync.bucket_bytes
    transfers = {"per tensor": (False, 0), "per layer": (True, 0)}
    if bucket:
        transfers[f"{bucket / 2**20:g} MiB buckets"] = (True, bucket)
    named = list(state.roles.actor.named_weights())
    syncs = {(mode, name): (ShardedSync(mode, scaling, packed=packed, bucket_bytes=cap), SinkEngine())
             for mode in modes for name, (packed, cap) in transfers.items()}
    reports = {key: [] for key in syncs}
    for sync, sink in syncs.values():
        sync.push(named, sink, 0)
    for _ in range(repeats):
        for key, (sync, sink) in syncs.items():
            reports[key].append(sync.push(named, sink, 0))
    rows = []
    for (mode, transfer), got in reports.items():
        seconds = statistics.median(r.seconds for r in got)
        rows.append({"mode": mode, "transfer": transfer, "seconds": seconds, "bytes": got[-1].bytes,
                     "tensors": got[-1].tensors, "peak_bytes": got[-1].peak_bytes, "share": seconds / step_time})
    return rows


def innermost(engine):
    """The engine under any wrappers (SeedPerPrompt, ColocatedEngine)."""
    while hasattr(engine, "engine"):
        engine = engine.engine
    return engine


def evaluate_engine(engine, tokenizer, task: Task, max_new_tokens: int) -> float:
    """The task's evaluation of the policy the engine holds (the trainer's latest weights, whole): its held-out
    rows decoded greedily and scored by its rewards; the accuracy (0..1) when the task has a correctness
    reward, else the mean weighted reward (`Task.eval_fn`'s number)."""
    inner = innermost(engine)
    if not hasattr(inner, "greedy_completions"):          # minirl's engines hold a transformers model
        return task.eval_fn(tokenizer, max_new_tokens)(inner.model)
    completions = inner.greedy_completions([r["prompt"] for r in task.test], max_new_tokens)     # vLLM
    total, metrics = task.score(task.test, completions)
    return metrics[f"rewards/{task.accuracy_reward}"] if task.accuracy_reward else total.mean().item()


def _save_pretrained(model, tokenizer, path: Path) -> None:
    """save_pretrained, with safetensors' errors (which name no file) as the OSError they are, naming `path`."""
    try:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    except SafetensorError as err:
        code = re.search(r"(?:os error|code:) (\d+)", str(err))      # "No space left on device (os error 28)"
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number), str(path / "model.safetensors")) from err


def export_policy(actor: DistributedActor, lora_scaling: float | None, tokenizer, path,
                  ctx: DistContext) -> Path | None:
    """Gather the policy layer by layer (LoRA merged into the base) and save it on rank 0 in Hugging Face format.

    Every rank must call it (the gathers are collectives); rank 0 writes `path` atomically and
    returns it, the others return None; a failed write (a full disk) is raised on every rank.
    `AutoModelForCausalLM.from_pretrained(path)` loads it.
    """
    mode = "merged" if lora_scaling is not None else "full"
    state = {}
    for layer in gather_buckets(list(actor.named_weights())):       # one layer at a time
        for name, tensor in engine_tensors(layer, mode, lora_scaling):
            if ctx.is_main:
                state[name] = tensor.detach().to("cpu", copy=True)
    path = Path(path)

    def write() -> Path:                                   # rank 0: a temporary directory, renamed when whole
        base = actor.module.get_base_model() if hasattr(actor.module, "get_base_model") else actor.module
        model = AutoModelForCausalLM.from_config(base.config)
        model.load_state_dict(state, strict=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            _save_pretrained(model, tokenizer, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with deferred_signals():
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        return path

    return agree(f"writing {path}", write if ctx.is_main else lambda: None)
