"""Stage 4: GRPO on every rank of a torchrun job, each with its share of the batch (multi-controller, SPMD).

    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04              # CPU, embedded policy, ZeRO-3
    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04-lora --lora-rank 8 --learning-rate 2e-3
    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04 --resume     # continue a stopped run exactly
    torchrun --nproc_per_node 8 chapters/04_fsdp_lora.py --model Qwen/Qwen2.5-0.5B --device cuda \
        --zero 3 --lora-rank 16 --rollout vllm --out runs/04-qwen

Every rank runs notebook 01's step on its share of the prompts, with its trainer shard (--zero:
0 DDP, 1 ZeRO-1, 2/3 FSDP2; --lora-rank R, 0 = full fine-tuning) and its own engine beside it
(--rollout minirl: the in-process engine --rollout-engine names, or vllm; --colocate lets the
engine release its weights during the update). After each update the weights are gathered layer
by layer, one all-gather per layer (--no-packed-sync: one per tensor), into every engine
(--sync-mode full, merged or adapter); --sync-every K pushes only every K-th update (and at
every evaluation, checkpoint and the last step), so a batch is generated up to K-1 updates
behind the trainer (needs --no-colocate). Rank 0 writes OUT/run.json, OUT/metrics.jsonl,
OUT/checkpoints/step-N/ (sharded, torch.distributed.checkpoint), OUT/final/ (the merged policy,
Hugging Face format) and OUT/summary.json with accuracy_before, accuracy_after, peak_bytes (one
per rank), sync_seconds, sync_bytes, sync_share (0-1: the sync's seconds over the steps'),
staleness, steps, the stage split, the sync table (full / merged / adapter, per tensor and
packed) and the memory freed by colocation. Every setting of RLConfig and ParallelConfig is a flag.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import time

import torch

from minirl.config import RLConfig
from minirl.models.policy import ModelSourceError, load_policy
from minirl.parallel.config import ParallelConfig, check_parallel
from minirl.parallel.launch import RankFailed, agree, init_distributed, pick_backend, shutdown, world_from_env
from minirl.rollout.base import VersionMismatchError
from minirl.train.cli import check_run_flags, resumed_config
from minirl.train.run import Callback, RunStopped
from minirl.utils.cli import add_config_flags, common_parser, config_from_args, flag
from minirl.utils.io import write_summary
from minirl.utils.rundir import RunDirError, read_run_record
from minirl.utils.seeding import seed_everything
from minirl.utils.validate import ConfigError, check_int

THRESHOLD = 0.05     # the source's symptom table: weight sync above 5 % of the step is slow
STAGES = ("generate", "score", "reference", "advantages", "update", "sync")
AGREED = (RunDirError, ConfigError, RankFailed, VersionMismatchError, ModelSourceError, ValueError)  # every rank alike
DEFAULTS = RLConfig.from_flat(steps=300, eval_every=50, checkpoint_every=50)   # minutes on CPUs; stage 1 runs 1000


def parse_args(argv=None):
    """(args, config, pconfig): flags checked and both configs built on every rank, before anything is loaded."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)   # both are config fields
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash of the whole job: stop right after this step (exit status 1)")
    group.add_argument("--kill-rank", default=None, metavar="RANK:STEP",
                       help="simulate a node failure: rank RANK dies (SIGKILL) right after step STEP")
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (default: 1)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(parser, DEFAULTS)
    add_config_flags(parser, ParallelConfig())
    args = parser.parse_args(argv)
    try:
        for dest, low in (("stop_after", 1), ("threads", 0)):
            if getattr(args, dest) is not None:
                check_int(dest, getattr(args, dest), low=low)
        if args.kill_rank is not None:
            rank, _, step = args.kill_rank.partition(":")
            if not (rank.isdigit() and step.isdigit()):
                raise ConfigError("kill_rank", args.kill_rank, "write it as RANK:STEP, e.g. 1:3")
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, DEFAULTS)
    pconfig = config_from_args(parser, args, ParallelConfig())
    try:
        check_parallel(pconfig, config, world_from_env()[1])
        pick_backend(pconfig.backend, config.run.device)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    check_run_flags(parser, args)
    if args.resume:                        # the run's own settings, changed only where the user says so
        saved_p = ParallelConfig(**read_run_record(args.out)["pconfig"])
        config, _ = resumed_config(parser, args, argv, also=dataclasses.asdict(saved_p))
        pconfig = saved_p
    return args, config, pconfig


class KillRank(Callback):
    """Rank `rank` dies by SIGKILL right after step `step`: a node failure, for the resume test."""

    def __init__(self, rank: int, step: int, my_rank: int):
        self.rank, self.step, self.my_rank = rank, step, my_rank

    def on_step(self, state, record):
        if state.step == self.step and self.my_rank == self.rank:
            print(f"rank {self.rank}: killed after step {self.step} (--kill-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def summarize(metrics: list[dict], state, pconfig: ParallelConfig, sync_rows: list[dict], seconds: float) -> dict:
    """summary.json: accuracy, per-rank memory, the sync's seconds / bytes / share, the stage split, colocation."""
    from minirl.memory.calculator import lora_memory, zero_per_gpu

    steps = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if "accuracy" in m]
    pushes = sum(m.get("sync/pushed", 1) for m in steps)
    staleness = [m.get("staleness", 0) for m in steps]
    world = state.group.world_size
    per_rank = lambda key: [max(m[key][r] for m in steps) for r in range(world)]   # noqa: E731
    step_time = sum(m["time/step"] for m in steps)
    totals = {s: sum(m.get(f"time/{s}", 0.0) for m in steps) for s in STAGES}
    by_rank = [{s: sum(m["time_by_rank"][r].get(f"time/{s}", 0.0) for m in steps) for s in STAGES}
               for r in range(world)]
    actor = state.roles.actor
    trainable = sum(p.numel() for p in actor.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in actor.module.parameters())
    calc = (zero_per_gpu(total, world, pconfig.zero, "fp32") if not pconfig.lora_rank
            else lora_memory(total - trainable, trainable, world, pconfig.zero, "fp32"))
    return {
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "steps": metrics[-1]["step"] if metrics else 0, "world_size": world, "seconds": seconds,
        "peak_bytes": per_rank("memory/peak_bytes"), "update_bytes": per_rank("memory/update_bytes"),
        "state_bytes": per_rank("memory/state_bytes"),
        "state_bytes_calculator": calc["total"],
        "sync_seconds": totals["sync"] / max(1, len(steps)), "sync_seconds_per_push": totals["sync"] / max(1, pushes),
        "sync_bytes": max((m["sync/bytes"] for m in steps), default=0),
        "sync_peak_bytes": max((m["sync/peak_bytes"] for m in steps), default=0),
        "sync_share": totals["sync"] / step_time if step_time else 0.0,
        "sync_share_median": statistics.median(m["time/sync"] / m["time/step"] for m in steps) if steps else 0.0,
        "sync_threshold": THRESHOLD, "sync_mode": pconfig.resolved_sync_mode, "packed_sync": pconfig.packed_sync,
        "sync_every": pconfig.sync_every, "pushes": pushes,
        "staleness_max": max(staleness, default=0),
        "staleness_mean": statistics.mean(staleness) if staleness else 0.0, "sync_table": sync_rows,
        "stage_seconds": totals, "stage_seconds_by_rank": by_rank,
        "colocation": {"engine_awake_bytes": per_rank("memory/engine_awake_bytes"),
                       "engine_asleep_bytes": [min(m["memory/engine_asleep_bytes"][r] for m in steps)
                                               for r in range(world)],
                       "sleep_seconds": statistics.mean(m.get("time/sleep", 0.0) for m in steps) if steps else 0.0,
                       "wake_seconds": statistics.mean(m.get("time/wake", 0.0) for m in steps) if steps else 0.0},
        "trainable_params": trainable, "params": total,
        "parallel": dataclasses.asdict(pconfig),
    }


def print_report(summary: dict) -> None:
    """The per-rank memory, the stage split and the sync share beside the source's 5 %."""
    MiB = 2**20
    print(f"\nper-rank memory (storage counting, notebook 03): calculator {summary['state_bytes_calculator'] / MiB:.2f}"
          " MiB of trainer state per rank")
    for r, (peak, state) in enumerate(zip(summary["peak_bytes"], summary["state_bytes"])):
        awake = summary["colocation"]["engine_awake_bytes"][r]
        asleep = summary["colocation"]["engine_asleep_bytes"][r]
        update = summary["update_bytes"][r]
        print(f"  rank {r}: trainer state {state / MiB:.2f} MiB, during the update {update / MiB:.2f} MiB, peak "
              f"{peak / MiB:.2f} MiB, engine {awake / MiB:.2f} MiB awake / {asleep / MiB:.2f} MiB asleep")
    whole = sum(summary["stage_seconds"].values()) or 1.0
    shares = ", ".join(f"{s} {100 * v / whole:.1f} %" for s, v in summary["stage_seconds"].items())
    print(f"stage split (rank 0): {shares}")
    print(f"{'sync mode':>9} | {'transfer':>16} | {'tensors':>7} | {'MiB per sync':>12} | {'ms':>7} | "
          f"{'share of step':>13} | source flags > 5 %")
    for row in summary["sync_table"]:
        share = row["share"]
        verdict = "above: slow sync" if share > THRESHOLD else "below"
        print(f"{row['mode']:>9} | {row['transfer']:>16} | {row['tensors']:7d} | {row['bytes'] / MiB:12.3f} | "
              f"{1e3 * row['seconds']:7.2f} | {100 * share:12.2f} % | {verdict}")
    every = summary["sync_every"]
    stale = (f"every {every} steps: {summary['pushes']} pushes, batches up to {summary['staleness_max']} updates "
             f"behind (mean {summary['staleness_mean']:.2f})" if every > 1 else "every step: on-policy batches")
    print(f"this run ({summary['sync_mode']}, {'packed' if summary['packed_sync'] else 'per tensor'}, {stale}): "
          f"sync {100 * summary['sync_share']:.2f} % of the step (median over steps "
          f"{100 * summary['sync_share_median']:.2f} %)")


def main(argv=None) -> int:
    args, config, pconfig = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    ctx = init_distributed(pconfig.backend, config.run.device)
    try:
        code = train_rank(args, config, pconfig, ctx)
    except RunStopped as stop:                          # every rank stops after the same step
        if ctx.is_main:
            print(f"{stop}; continue with: torchrun ... {sys.argv[0]} --out {args.out} --resume")
        code = 1
    except AGREED as err:                               # raised on every rank alike (checks, agree())
        print(f"error (rank {ctx.rank}): {type(err).__name__}: {err}", file=sys.stderr)
        code = 2
    except BaseException:                               # only this rank may have met it: leave at once
        shutdown(together=False)
        raise
    shutdown()
    return code


def train_rank(args, config, pconfig, ctx) -> int:
    """The body every rank runs: load, set up (all ranks agree), notebook 01's `run_in_dir`, export, summarize."""
    import torch.distributed as dist

    from minirl.memory.tracking import MemoryTracker
    from minirl.parallel.checkpoint import ShardedCheckpoints
    from minirl.parallel.spmd import evaluate_engine, export_policy, setup_spmd, spmd_step, sync_table
    from minirl.tasks.arithmetic import make_task
    from minirl.train.plots import plot_metrics
    from minirl.train.run import run_in_dir

    out, main_rank = args.out, ctx.is_main
    seed_everything(config.run.seed)
    if not main_rank:
        dist.barrier()                                   # rank 0 builds the embedded policy's cache first
    model, tokenizer = load_policy(args.model, config.run.device, progress=main_rank and not args.no_progress)
    if main_rank:
        dist.barrier()
    task = make_task()
    rows, reward_funcs = task.rows("train"), [task.reward]
    state = agree("setting up the roles, the engine and the sync",
                  lambda: setup_spmd(config, pconfig, model, tokenizer, rows, reward_funcs, ctx))
    kill = [KillRank(*map(int, args.kill_rank.split(":")), ctx.rank)] if args.kill_rank is not None else []
    started = time.perf_counter()
    metrics = run_in_dir(
        state, spmd_step, tokenizer, out_dir=out, resume=args.resume, overwrite=args.overwrite,
        eval_fn=(lambda _model: evaluate_engine(state.engine, tokenizer, task)) if main_rank else None,
        progress=not args.no_progress, label=f"{ctx.world_size} ranks, zero {pconfig.zero}",
        first_callbacks=(MemoryTracker(),), extra_callbacks=kill, stop_after=args.stop_after,
        run_info={"pconfig": dataclasses.asdict(pconfig), "model": args.model, "world_size": ctx.world_size},
        checkpoints=ShardedCheckpoints(out, config), main=main_rank, agree=agree)
    seconds = time.perf_counter() - started
    export_policy(state.roles.actor, state.sync.lora_scaling, tokenizer, out / "final", ctx)
    rows_table = sync_table(state, metrics)
    if not main_rank:
        return 0
    summary = summarize(metrics, state, pconfig, rows_table, seconds)
    summary |= {"model": args.model or "embedded", "resumed": args.resume, "final_model": str(out / "final"),
                "metrics": str(out / "metrics.jsonl"), "config": dataclasses.asdict(config)}
    plot_metrics(metrics, out / "reward_curve.png",
                 title=f"stage 4: {ctx.world_size} ranks, zero {pconfig.zero}, lora {pconfig.lora_rank}")
    write_summary(out, summary)
    print_report(summary)
    if summary["accuracy_before"] is not None:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        print(f"held-out greedy accuracy {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points) in "
              f"{summary['steps']} steps, {seconds:.0f} s")
    print(f"summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
