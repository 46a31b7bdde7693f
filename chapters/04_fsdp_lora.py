"""Stage 4: GRPO on every rank of a torchrun job, each with its share of the batch (multi-controller, SPMD).

    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04              # CPU, embedded policy, ZeRO-3
    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04-lora --lora-rank 8 --learning-rate 2e-3
    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --out runs/04 --resume     # continue a stopped run exactly
    torchrun --nproc_per_node 8 chapters/04_fsdp_lora.py --model Qwen/Qwen2.5-0.5B --device cuda \
        --zero 3 --lora-rank 16 --rollout-engine vllm --out runs/04-qwen
    torchrun --nproc_per_node 8 chapters/04_fsdp_lora.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda \
        --dataset data/word_problems_chat/train.jsonl --eval-dataset data/word_problems_chat/test.jsonl \
        --reward math --lora-rank 16 --max-completion-length 256 --out runs/04-words
    torchrun --nproc_per_node 2 chapters/04_fsdp_lora.py --config run.yaml --out runs/04-yaml   # settings in YAML
    python chapters/04_fsdp_lora.py --nproc-per-node 2 --out runs/04    # this process launches the job (quiet)
    accelerate launch --config_file configs/accelerate_cpu_2.yaml chapters/04_fsdp_lora.py --out runs/04  # 2 CPU ranks
    accelerate launch --multi_gpu --num_processes 8 chapters/04_fsdp_lora.py --device cuda --out runs/04-gpu

Every rank runs notebook 01's step on its share of the prompts, with its trainer shard (--zero:
0 DDP, 1 ZeRO-1, 2/3 FSDP2; --lora-rank R, 0 = full fine-tuning) and its own engine beside it
(--rollout-engine: hf, shared_prefix, paged in process, or vllm on GPUs; --colocate lets the
engine release its weights during the update). After each update the weights are gathered layer
by layer, one all-gather per layer (--no-packed-sync: one per tensor), into every engine
(--sync-mode full, merged or adapter); --sync-every K pushes only every K-th update (and at
every evaluation, checkpoint and the last step), so a batch is generated up to K-1 updates
behind the trainer (needs --no-colocate). Rank 0 writes OUT/run.json, OUT/metrics.jsonl,
OUT/checkpoints/step-N/ (sharded, torch.distributed.checkpoint), OUT/final/ (the merged policy,
Hugging Face format; with LoRA also peft's adapter, OUT/final/adapter/, `final_adapter`) and
OUT/summary.json with accuracy_before, accuracy_after, peak_bytes (one per rank), sync_seconds,
sync_bytes, sync_share (0-1: the sync's seconds over the steps'), staleness, steps, the stage
split, the sync table (full / merged / adapter, per tensor and packed), the memory freed by
colocation, mixed_precision (--mixed-precision resolved: FSDP2's MixedPrecisionPolicy at
--zero 2/3, autocast at 0/1, float32 weights either way), the task and every setting
(`settings`, after --config and the flags). Every setting of RLConfig and ParallelConfig is a flag.

The task flags are chapter 01's: --dataset (a `prompt` column, text or chat messages rendered by
the model's chat template; the other columns go to the rewards), --eval-dataset, --reward
(repeatable: arithmetic, math, format, or module:function) and --reward-weights; without them,
the embedded arithmetic task. Only rank 0 prints (the other ranks' stderr is quiet, but for
their own death). Exit status: 0 done, 1 stopped (--stop-after, a rank that died, a disk that
filled: one line names it, the last intact checkpoint and the command that continues the run),
2 bad input, 130 interrupted (Ctrl-C). torchrun adds its own report of a failed or interrupted
job (a few log lines and a traceback, exit status 1); with --nproc-per-node N instead of
torchrun, this process runs torchrun's launcher itself, without its report, and exits with
the ranks' status (130 for Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import statistics
import sys
import time

from minirl.config import RLConfig
from minirl.parallel.config import ParallelConfig
from minirl.runtime.accelerate_launch import orphan_problem
from minirl.runtime.cli import add_config_flags, check_device, common_parser, config_from_args, flag, merged_settings
from minirl.runtime.parallel_checks import check_parallel
from minirl.runtime.rundir import RunDirError, check_run_dir, read_run_record
from minirl.runtime.schedule import add_schedule_flags, schedule_callbacks
from minirl.runtime.trackers import add_report_flag, check_report_to, tracker_callbacks
from minirl.runtime.training_cli import (
    TASK_FLAGS,
    add_rl_flags,
    add_task_flags,
    check_engine_flag,
    check_run_flags,
    check_task_prompts,
    data_defaults,
    data_record,
    held_out_line,
    out_problem,
    resolve_task_paths,
    restore_task_flags,
    resumed_config,
    saved_task,
    stop_line,
    summary_extras,
    task_from_args,
    task_summary,
)
from minirl.runtime.validate import ConfigError, check_int

# Light imports only above this line: the flags are parsed (and a usage error reported) before torch loads.
THRESHOLD = 0.05     # the source's symptom table: weight sync above 5 % of the step is slow
STAGES = ("generate", "score", "reference", "advantages", "update", "sync")
DEFAULTS = RLConfig.from_flat(steps=300, eval_every=50, checkpoint_every=50)   # minutes on CPUs; stage 1 runs 1000


def job_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def quiet_stderr():
    """Send this rank's stderr (Python's and the C libraries') to /dev/null; returns a stream to the real one,
    for the rank's own death: the other ranks' copies of every warning and progress bar stay off the terminal."""
    real = os.fdopen(os.dup(2), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return real


def check_world_size(parser, args, world: int) -> None:
    """--resume on the run's own number of ranks (its shards, generators and random states are per rank): refused
    first, from run.json alone, before any other setting is compared and before anything heavy is imported."""
    try:
        trained = read_run_record(args.out).get("world_size")
    except (OSError, ValueError):
        return                             # no run.json (or a broken one): check_run_flags names the problem
    if trained is not None and trained != world:
        parser.error(f"--resume: the run in {args.out} trained on {trained} ranks, and its checkpoints hold "
                     f"{trained} ranks' shards, generators and random states; this job has {world}: resume it with "
                     f"torchrun --nproc_per_node {trained} (on one node), the run's settings otherwise unchanged")


def check_resumable(parser, args) -> None:
    """--resume: a checkpoint whose files are intact, before any model loads (a broken newer one is named and
    skipped when the run restores, as stage 1 does)."""
    from minirl.runtime.sharded_checkpoint import newest_intact  # noqa: PLC0415 (torch: after parsing)

    found, problems = newest_intact(args.out / "checkpoints")
    if found is None and problems:
        parser.error(f"--resume: no checkpoint in {args.out / 'checkpoints'} is intact ({'; '.join(problems)}); put "
                     "the files back from a copy, or start the run again with --overwrite")
    if found is None:
        parser.error(f"--resume: {args.out} holds no checkpoint yet (the run stopped before its first one); start it "
                     "again with --overwrite")


def parse_args(argv=None):
    """(args, config, pconfig, task, settings): flags checked, both configs and the task built on every rank,
    before any model loads. The parser itself runs before torch is imported: a usage error is immediate."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)   # both are config fields
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash of the whole job: stop right after this step (exit status 1)")
    group.add_argument("--kill-rank", default=None, metavar="RANK:STEP",
                       help="simulate a node failure: rank RANK dies (SIGKILL) right after step STEP")
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (default: 1)")
    group.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="without torchrun: launch the job on N local processes from this one (torchrun's "
                            "launcher, quiet: the ranks' one-line stops and their exit status)")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress bars (they are shown on rank 0 when its stderr is a terminal)")
    add_task_flags(parser)
    add_rl_flags(parser, DEFAULTS)
    add_schedule_flags(parser)
    add_report_flag(parser)
    add_config_flags(parser, ParallelConfig())
    args = parser.parse_args(argv)
    if (orphan := orphan_problem()) is not None:    # accelerate launch's one process, not a job of ranks
        parser.error(orphan)
    if args.nproc_per_node is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        parser.error("argument --nproc-per-node: the job is already under torchrun (its --nproc_per_node); drop it")
    try:
        for dest, low in (("stop_after", 1), ("threads", 0), ("nproc_per_node", 1)):
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
    check_report_to(parser, args)
    check_engine_flag(parser, config)      # vLLM without vLLM or CUDA: refused before torch loads
    world = args.nproc_per_node or job_rank()[1]
    problem = out_problem(args.out)        # the quick refusals first: --out, the world size, --device
    if problem is not None:
        parser.error(f"argument --out: {args.out}: {problem}")
    if args.resume:
        check_world_size(parser, args, world)
    try:
        check_run_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    except RunDirError as err:
        parser.error(str(err))
    if config.run.device != "cpu":
        check_device(parser, config.run.device)
    check_run_flags(parser, args)          # and --model
    resolve_task_paths(args)
    if args.resume:                        # the run's own settings (and task), changed only where the user says so
        check_resumable(parser, args)
        saved_p, saved = ParallelConfig(**read_run_record(args.out)["pconfig"]), saved_task(args)
        config, _ = resumed_config(parser, args, argv, also=dataclasses.asdict(saved_p) | saved)
        restore_task_flags(args, saved)
        pconfig = saved_p
        for name, value in {**config.flat(), **dataclasses.asdict(pconfig)}.items():
            setattr(args, name, value)     # what `settings` records: the run's own
        if config.run.device != "cpu":
            check_device(parser, config.run.device)
    args.run_data = data_record(parser, args)   # the data's content hashes; on --resume, refused if changed
    try:
        check_parallel(pconfig, config, world)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    from minirl.runtime.ranks import pick_backend  # noqa: PLC0415 (torch: after parsing)

    try:
        pick_backend(pconfig.backend, config.run.device)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    task = task_from_args(parser, args)
    if not task.test and config.run.eval_every:
        print("no --eval-dataset: no held-out evaluation", file=sys.stderr)
        config = config.replace(eval_every=0)
    config = data_defaults(parser, args, config, task)   # --dataset: TRL's defaults where nothing was set
    return args, config, pconfig, task, merged_settings(parser, args)


class KillRank:
    """Rank `rank` dies by SIGKILL right after step `step`: a node failure, for the resume test (a run callback)."""

    def __init__(self, rank: int, step: int, my_rank: int):
        self.rank, self.step, self.my_rank = rank, step, my_rank

    def on_start(self, state):
        pass

    def on_step(self, state, record):
        if state.step == self.step and self.my_rank == self.rank:
            print(f"rank {self.rank}: killed after step {self.step} (--kill-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_end(self, state):
        pass


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
    for r, (peak, state) in enumerate(zip(summary["peak_bytes"], summary["state_bytes"], strict=True)):
        awake = summary["colocation"]["engine_awake_bytes"][r]
        asleep = summary["colocation"]["engine_asleep_bytes"][r]
        update = summary["update_bytes"][r]
        print(f"  rank {r}: trainer state {state / MiB:.2f} MiB, during the update {update / MiB:.2f} MiB, peak "
              f"{peak / MiB:.2f} MiB, engine {awake / MiB:.2f} MiB awake / {asleep / MiB:.2f} MiB asleep")
    whole = sum(summary["stage_seconds"].values()) or 1.0
    shares = ", ".join(f"{s} {100 * v / whole:.1f} %" for s, v in summary["stage_seconds"].items())
    print(f"stage split (rank 0): {shares}")
    print("pushes into a buffer (the sync alone), against the run's median step:")
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
          f"sync {100 * summary['sync_share']:.2f} % of the run's step time (its seconds over all steps'), "
          f"{'above' if summary['sync_share'] > THRESHOLD else 'below'} the source's 5 %")


def launch_job(nproc: int, argv: list[str]) -> int:
    """`--nproc-per-node N`: minirl's one torchrun launcher (`minirl.runtime.launch.torchrun`) in this process on
    this script, quiet: without torchrun's own report of a failure (the ranks say what happened, in one line);
    returns the ranks' exit status (130 when Ctrl-C stopped them)."""
    from minirl.runtime.launch import torchrun  # noqa: PLC0415 (torch: after the arguments)

    launched = {"MINIRL_LAUNCHED": f"python {sys.argv[0]} --nproc-per-node {nproc}"}   # how the ranks say to resume
    return torchrun(sys.argv[0], nproc, argv, capture=False, env=launched).returncode


def without_nproc(argv: list[str]) -> list[str]:
    """The command line without --nproc-per-node N (what the ranks get)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nproc-per-node":
            skip = True
        elif not word.startswith("--nproc-per-node="):
            out.append(word)
    return out


def main(argv=None) -> int:
    rank, _ = job_rank()
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    stderr = quiet_stderr() if under_torchrun and rank != 0 else sys.stderr
    try:
        try:
            args, config, pconfig, task, settings = parse_args(argv)
        except SystemExit as refused:
            if under_torchrun and rank != 0 and refused.code:
                time.sleep(30)  # rank 0 says why and exits first; torchrun then stops this rank (never the reverse)
            raise
        if args.nproc_per_node is not None:
            return launch_job(args.nproc_per_node, without_nproc(list(sys.argv[1:] if argv is None else argv)))
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted before the run started: nothing was written", file=stderr)
        return 130
    import torch  # noqa: PLC0415 (after the arguments: a usage error never waits for torch)

    from minirl.parallel.launch import init_distributed, shutdown  # noqa: PLC0415
    from minirl.runtime.launch import leave  # noqa: PLC0415
    from minirl.runtime.sharded_checkpoint import newest_intact  # noqa: PLC0415
    from minirl.runtime.stops import StopSignals, rank_processes, relaunch_command, why_stopped  # noqa: PLC0415
    from minirl.train.run import RunStopped  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress and rank == 0 and stderr.isatty()
    if not progress:
        from transformers.utils import logging as hf_logging  # noqa: PLC0415

        hf_logging.disable_progress_bar()
    again = relaunch_command(sys.argv[0], ["--out", args.out, "--resume"])
    if "MINIRL_LAUNCHED" in os.environ:                   # launched by --nproc-per-node: resumed the same way
        again = f"{os.environ['MINIRL_LAUNCHED']} --out {shlex.quote(str(args.out))} --resume"
    last = lambda: newest_intact(args.out / "checkpoints")[0]      # noqa: E731  (verified, as a resume reads it)
    processes = [(None, os.getpid())]
    with StopSignals() as signals:
        try:
            ctx = init_distributed(pconfig.backend, config.run.device)
            processes = rank_processes()
            code = train_rank(args, config, pconfig, task, settings, ctx, progress)
        except RunStopped as stop:                          # every rank stops after the same step
            if rank == 0:
                print(stop_line(str(stop), last(), again), flush=True)
            code = 1
        except BaseException as err:                        # Ctrl-C, a dead rank, a full disk, an error
            signals.quiet()
            stop = why_stopped(err, signals, processes, rank, args.out)
            if stop.what is not None:
                print(stop_line(stop.what, last(), again) if stop.resumable else stop.what, file=stderr, flush=True)
            if under_torchrun:                              # the group is broken: leave now, nothing to wait for
                sys.stdout.flush()
                os._exit(stop.code)
            shutdown(together=False)
            return stop.code
    shutdown()
    if under_torchrun:                                      # a finished rank must not abort in gloo's teardown
        leave(code)
    return code


def train_rank(args, config, pconfig, task, settings, ctx, progress: bool) -> int:
    """The body every rank runs: load, set up (all ranks agree), notebook 01's `run_in_dir`, export, summarize."""
    from minirl.parallel.spmd import setup_spmd, spmd_step  # noqa: PLC0415
    from minirl.runtime.callbacks import run_in_dir  # noqa: PLC0415
    from minirl.runtime.io import write_summary  # noqa: PLC0415
    from minirl.runtime.memory_tracking import MemoryTracker  # noqa: PLC0415
    from minirl.runtime.model_loading import load_policy  # noqa: PLC0415
    from minirl.runtime.plots import plot_metrics  # noqa: PLC0415
    from minirl.runtime.policy_export import EngineEval, adapter_path, export_policy  # noqa: PLC0415
    from minirl.runtime.ranks import agree  # noqa: PLC0415
    from minirl.runtime.seeding import seed_everything  # noqa: PLC0415
    from minirl.runtime.sharded_checkpoint import ShardedCheckpoints  # noqa: PLC0415
    from minirl.runtime.sync_meter import sync_table  # noqa: PLC0415

    out, main_rank = args.out, ctx.is_main
    seed_everything(config.run.seed)
    load = lambda: load_policy(args.model, config.run.device, progress=progress,     # noqa: E731
                               dropout=not config.run.disable_dropout)
    loaded = agree("loading the policy", load if main_rank else lambda: None)  # rank 0 first: it builds the cache
    loaded = agree("loading the policy", (lambda: loaded) if main_rank else load)
    model, tokenizer = loaded
    max_new_tokens = task.max_new_tokens or config.sampling.max_completion_length

    # unknown characters, too long for the model: named, on every rank
    agree("checking the prompts", lambda: check_task_prompts(task, tokenizer, model, config, args))
    state = agree("setting up the roles, the engine and the sync",
                  lambda: setup_spmd(config, pconfig, model, tokenizer, task.train, task.reward_funcs, ctx,
                                     task.reward_weights))
    kill = [KillRank(*map(int, args.kill_rank.split(":")), ctx.rank)] if args.kill_rank is not None else []
    eval_fn = EngineEval(state.engine, tokenizer, task, max_new_tokens) if main_rank and task.test else None
    started = time.perf_counter()
    metrics = run_in_dir(
        state, spmd_step, tokenizer, out_dir=out, resume=args.resume, overwrite=args.overwrite, eval_fn=eval_fn,
        progress=progress, label=f"{ctx.world_size} ranks, zero {pconfig.zero}",
        first_callbacks=(MemoryTracker(),), extra_callbacks=kill + schedule_callbacks(args, config.run.steps)
        + tracker_callbacks(args, out, main_rank),
        stop_after=args.stop_after,
        run_info={"pconfig": dataclasses.asdict(pconfig), "model": args.model, "world_size": ctx.world_size,
                  "task": {k: getattr(args, k) for k in TASK_FLAGS}, "settings": settings, **args.run_data},
        checkpoints=ShardedCheckpoints(out, config), main=main_rank, agree=agree,
        autocast=pconfig.zero < 2)    # --mixed-precision: DDP steps autocast; FSDP2 casts by its MixedPrecisionPolicy
    seconds = time.perf_counter() - started
    export_policy(state.roles.actor, state.sync.lora_scaling, tokenizer, out / "final", ctx)
    rows_table = sync_table(state, metrics)

    def write_results() -> dict:                         # rank 0; a full disk stops every rank with its file named
        summary = summarize(metrics, state, pconfig, rows_table, seconds)
        adapter = adapter_path(out / "final", pconfig.lora_rank)     # LoRA: peft's adapter beside the merged model
        summary |= {"model": args.model or "embedded", "resumed": args.resume, "final_model": str(out / "final"),
                    "final_adapter": None if adapter is None else str(adapter),
                    "mixed_precision": config.resolved_mixed_precision,
                    "metrics": str(out / "metrics.jsonl"), "task": task_summary(task, args),
                    "config": dataclasses.asdict(config), "settings": settings, **summary_extras(args, metrics),
                    "config_file": None if args.config is None else str(args.config)}
        plot_metrics(metrics, out / "reward_curve.png",
                     title=f"stage 4: {ctx.world_size} ranks, zero {pconfig.zero}, lora {pconfig.lora_rank}",
                     temperature=config.sampling.temperature)
        write_summary(out, summary)
        return summary

    summary = agree("writing the summary", write_results if main_rank else lambda: None)
    if not main_rank:
        return 0
    print_report(summary)
    if summary["accuracy_before"] is not None:
        print(held_out_line(task, summary, seconds))
    print(f"summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
