"""Stage 6: the single controller on Ray: one Driver runs stage 1's step on workers placed on pools.

    python chapters/06_ray.py --placement colocated --out runs/06-colocated        # local Ray cluster, CPU
    python chapters/06_ray.py --placement disaggregated --pools actor=2,rollout=1 --out runs/06-disagg
    python chapters/06_ray.py --placement per-role --sync object_store --out runs/06-per-role
    ray start --head --num-cpus 8        # then, on any node of that cluster:
    python chapters/06_ray.py --address auto --placement disaggregated --out runs/06-cluster
    python chapters/06_ray.py --address auto --device cuda --model Qwen/Qwen2.5-0.5B --pools actor=4,rollout=4 ...
    python chapters/06_ray.py --model Qwen/Qwen2.5-0.5B-Instruct --out runs/06-words \
        --dataset data/word_problems_chat/train.jsonl --eval-dataset data/word_problems_chat/test.jsonl \
        --reward math --reward format --reward-weights 1 0.5 --max-completion-length 256
    python chapters/06_ray.py --config run.yaml --out runs/06-yaml      # settings from a YAML file

Writes OUT/run.json, OUT/metrics.jsonl, OUT/checkpoints/, OUT/final/ (as chapter 01),
OUT/timeline.png (which role was busy when, per worker, in the last 3 steps), OUT/timeline.json (the
steps this process ran, every worker's calls as [what, start, end] in wall-clock seconds; notebook 09 reads it),
OUT/placement.png (role -> node -> device) and OUT/summary.json with accuracy_before,
accuracy_after, stage_shares (stage -> share of the step time, 0-1), sync_seconds (mean per
step), sync_bytes, placement (role -> list of node/device), steps and seconds, mixed_precision
(--mixed-precision resolved: the workers run each call under its autocast, float32 weights), the task
and every setting (`settings`, after --config and the flags). Prints the stage shares after
every step. Without --address a local Ray cluster starts inside the run (tried a few times,
with Ray's start-up waits raised, on a busy machine) and stops at its end. A cluster started by
`ray start --head` asks for a token (Ray 2.60): on its nodes RAY_AUTH_MODE=token is set for you
when ~/.ray/auth_token exists. --resume continues a stopped run (Ctrl-C, a worker that died,
--stop-after) from its newest intact checkpoint, where it ran (its --placement, --pools, --sync,
--address, --num-cpus, ... come back from run.json unless typed again); every setting of minirl.config.RLConfig is a
flag below (with this chapter's defaults). Exit status: 0 done, 1 stopped (a dead worker,
--stop-after, a disk that filled), 2 bad input, 130 interrupted.

The task flags are chapter 01's: --dataset, --eval-dataset, --reward (repeatable),
--reward-weights; the reward workers call the reward functions, and the records are the
ones chapter 01 writes for the same task (`rewards/<name>`, the weighted reward,
`frac_reward_zero_std`). Without them, the embedded arithmetic task.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from minirl.config import RLConfig
from minirl.controller.names import PLACEMENTS, SYNCS  # no Ray, no torch: the parser is built before either loads
from minirl.runtime.cli import check_device, common_parser, config_from_args, flag, merged_settings
from minirl.runtime.progress import bars_wanted
from minirl.runtime.rundir import read_run_record
from minirl.runtime.trackers import add_report_flag, check_report_to, tracker_callbacks
from minirl.runtime.training_cli import (
    add_rl_flags,
    add_task_flags,
    check_engine_flag,
    check_run_flags,
    check_task_prompts,
    data_defaults,
    data_record,
    held_out_line,
    interrupted_line,
    last_checkpoint,
    resolve_task_paths,
    restore_task_flags,
    restore_untyped,
    resume_command,
    resumed_config,
    saved_task,
    stop_line,
    summary_extras,
    task_from_args,
    task_summary,
    write_stop,
)
from minirl.runtime.validate import ConfigError, check_float, check_int

# where the run runs, run.json's "where": --resume restores each flag not typed again; another --placement, --pools
# or --sync is refused as a changed setting would be (another --address: a cluster restarted elsewhere, say, is not)
WHERE = ("placement", "pools", "sync", "address", "num_cpus", "cpus_per_device", "bucket_mb")
FIXED_WHERE = WHERE[:3]
DEFAULTS = RLConfig()   # stage 1's run (1000 steps): the same seed learns the same on every placement


def parse_args(argv=None):
    """(parser, args, config, placement, task, settings): every flag checked, the placement and the task built,
    before Ray starts or a model loads. The parser runs before any heavy import: a usage error is immediate."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)
    ray_group = parser.add_argument_group("placement and cluster")
    ray_group.add_argument("--placement", choices=PLACEMENTS, default="colocated",
                           help="colocated: every role on one pool; disaggregated: train and rollout pools; "
                                "per-role: each role its own workers (default: %(default)s)")
    ray_group.add_argument("--pools", default=None, metavar="ROLE=N[+M],...",
                           help="devices of the pool that hosts each role, per node: actor=2,rollout=1+1 "
                                "(default: one device per pool)")
    ray_group.add_argument("--address", default=None,
                           help="join the Ray cluster there ('auto', or host:port printed by `ray start --head`; "
                                "with token auth, RAY_AUTH_MODE=token and its token); default: start a local cluster")
    ray_group.add_argument("--num-cpus", type=float, default=2,
                           help="CPUs of the local cluster (without --address) (default: %(default)s)")
    ray_group.add_argument("--cpus-per-device", type=float, default=0.25,
                           help="CPUs each worker reserves (on a CPU pool a device is such a slot) "
                                "(default: %(default)s)")
    ray_group.add_argument("--sync", choices=SYNCS, default="collective",
                           help="weight sync between separate workers: a bucketed torch.distributed broadcast "
                                "(gloo; NCCL on GPUs) or Ray's object store (default: %(default)s)")
    ray_group.add_argument("--bucket-mb", type=float, default=32, help="broadcast bucket size, MiB (default: 32)")
    ray_group.add_argument("--compare-syncs", type=int, default=0, metavar="N",
                           help="after training, time N pushes through each sync, interleaved (default: 0)")
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash: stop right after this step (exit status 1); continue with --resume")
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default: 1)")
    add_task_flags(parser)
    add_rl_flags(parser, DEFAULTS)
    add_report_flag(parser)
    args = parser.parse_args(argv)
    try:
        for dest, low in (("stop_after", 1), ("threads", 0), ("compare_syncs", 0)):
            if getattr(args, dest) is not None:
                check_int(dest, getattr(args, dest), low=low)
        for dest in ("num_cpus", "cpus_per_device", "bucket_mb"):
            check_float(dest, getattr(args, dest), low=0.0, low_open=True)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, DEFAULTS)
    check_report_to(parser, args)
    check_engine_flag(parser, config)      # vLLM without vLLM or CUDA: refused before torch or Ray loads
    check_run_flags(parser, args)
    resolve_task_paths(args)
    if args.resume:                        # the run's own settings (and task), changed only where the user says so
        saved, where = saved_task(args), read_run_record(args.out).get("where", {})
        config, _ = resumed_config(parser, args, argv, also=saved | {k: where[k] for k in FIXED_WHERE if k in where})
        restore_task_flags(args, saved)
        restore_untyped(parser, args, argv, where)   # and where it ran: `--out OUT --resume` alone continues it
    args.run_data = data_record(parser, args)   # the data's content hashes; on --resume, refused if changed
    if args.address is None:               # on a cluster the workers' nodes have the devices, not necessarily this one
        check_device(parser, config.run.device)
    from minirl.controller.placement import make_placement  # noqa: PLC0415 (Ray, torch)
    from minirl.runtime.placement_checks import check_placement, parse_pools  # noqa: PLC0415

    device = "gpu" if config.run.device.startswith("cuda") else "cpu"
    try:
        placement = make_placement(args.placement, parse_pools(args.pools), device, args.cpus_per_device)
        check_placement(placement, config)                  # a role without a pool, a batch that does not split
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    task = task_from_args(parser, args)
    if not task.test and config.run.eval_every:
        print("no --eval-dataset: no held-out evaluation", file=sys.stderr)
        config = config.replace(eval_every=0)
    config = data_defaults(parser, args, config, task)   # --dataset: TRL's defaults where nothing was set
    return parser, args, config, placement, task, merged_settings(parser, args)


def main(argv=None) -> int:
    parser, args, config, placement, task, settings = parse_args(argv)
    bars_wanted()                          # transformers' bars ("Writing model shards") on a terminal only
    import ray  # noqa: PLC0415 (after the arguments: a usage error never waits for torch and Ray)
    import torch  # noqa: PLC0415

    from minirl.controller.driver import SOURCE_ORDER, Driver  # noqa: PLC0415
    from minirl.controller.resource_pool import PlacementError  # noqa: PLC0415
    from minirl.runtime.cluster_plots import ROLE_COLORS, last_steps_of, plot_placement, plot_timelines  # noqa: PLC0415
    from minirl.runtime.io import atomic_write_json, write_summary  # noqa: PLC0415
    from minirl.runtime.model_loading import (  # noqa: PLC0415
        ModelSourceError,
        PromptError,  # noqa: PLC0415
        load_policy,
    )
    from minirl.runtime.placement_checks import describe  # noqa: PLC0415
    from minirl.runtime.ray_calls import WorkerDiedError  # noqa: PLC0415
    from minirl.runtime.ray_start import connect  # noqa: PLC0415
    from minirl.runtime.rundir import RunDirError  # noqa: PLC0415
    from minirl.runtime.seeding import seed_everything  # noqa: PLC0415
    from minirl.runtime.source_rows import source_stage_shares  # noqa: PLC0415
    from minirl.train.run import Callback, RunStopped  # noqa: PLC0415

    class StageLine(Callback):
        """One line per step: the share of each stage, in the source's Driver order."""

        def on_step(self, state, record):
            shares = source_stage_shares([record])
            print(f"step {record['step']:4d}  {record['time/step']:6.2f} s  reward {record['reward']:.2f}  "
                  + "  ".join(f"{s} {100 * shares[s]:4.1f}%" for s in (*SOURCE_ORDER, "other") if s in shares)
                  + (f"  accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""), flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    out, again = args.out, resume_command(args.out)
    try:
        print(connect(args.address, num_cpus=args.num_cpus), flush=True)
    except ConnectionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        ray.shutdown()
        print(f"\n{interrupted_line(out, again)}", file=sys.stderr)
        return 130
    started = time.perf_counter()
    max_new_tokens = task.max_new_tokens or config.sampling.max_completion_length
    try:
        model, tokenizer = load_policy(args.model, "cpu", progress=False,     # the driver's copy stays on the CPU
                                       dropout=not config.run.disable_dropout)
        check_task_prompts(task, tokenizer, model, config, args)
        with Driver(config, placement, model, tokenizer, task.reward_funcs, reward_weights=task.reward_weights,
                    sync=args.sync, threads=args.threads, bucket_bytes=int(args.bucket_mb * 2**20)) as driver:
            where = driver.where()
            print(f"placement {describe(placement, driver.roles_needed())}; sync: {type(driver.sync).__name__}")
            for role, devices in where.items():
                print(f"  {role:>9} -> {', '.join(devices)}")
            run_info = {"model": args.model, "placement": args.placement, "pools": args.pools, "settings": settings,
                        "where": {k: getattr(args, k) for k in WHERE},
                        "task": {k: getattr(args, k) for k in ("dataset", "eval_dataset", "reward", "reward_weights")},
                        **args.run_data}
            metrics = driver.train(task.train, eval_fn=task.eval_fn(tokenizer, max_new_tokens), out_dir=out,
                                   resume=args.resume, overwrite=args.overwrite, progress=False,
                                   stop_after=args.stop_after,
                                   extra_callbacks=(StageLine(), *tracker_callbacks(args, args.out)),
                                   run_info=run_info)
            timeline = driver.timeline()
            atomic_write_json(out / "timeline.json", {"clock": "time.time", "placement": args.placement,   # notebook 09
                                                      "steps": [m["step"] for m in metrics if "time/generate" in m],
                                                      "workers": timeline})
            compared = {}
            for _ in range(args.compare_syncs):                      # interleaved: each sync in turn
                for name, sync in driver.syncs.items():
                    report = sync.push(driver.roles.actor.named_weights(), driver.engine, driver.roles.version)
                    compared.setdefault(name, []).append((report.seconds, report.bytes))
    except RunStopped as stop:
        print(stop_line(str(stop), last_checkpoint(out), again))
        return 1
    except WorkerDiedError as err:
        print(stop_line(err.what, last_checkpoint(out), again), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{interrupted_line(out, again)}", file=sys.stderr)
        return 130
    except (RunDirError, ConfigError, PlacementError, PromptError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ModelSourceError as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return 2
    except OSError as err:                    # a disk that filled, a directory made read-only during the run
        return write_stop(err, out, again)
    finally:
        ray.shutdown()
    seconds = time.perf_counter() - started
    steps = [m for m in metrics if "time/generate" in m]
    evals = [m for m in metrics if "accuracy" in m]
    summary = {
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "stage_shares": source_stage_shares(steps),
        "sync_seconds": sum(m["time/sync"] for m in steps) / max(1, len(steps)),
        "sync_bytes": steps[-1]["sync/bytes"] if steps else 0,
        "sync": args.sync if args.placement != "colocated" else "local",
        "sync_compare": {name: {"seconds_median": sorted(s for s, _ in runs)[len(runs) // 2], "bytes": runs[0][1],
                                "repeats": len(runs)} for name, runs in compared.items()},
        "placement": where, "placement_kind": args.placement, "pools": args.pools,
        "steps": metrics[-1]["step"] if metrics else 0, "seconds": seconds,
        "seconds_training": sum(m.get("time/step", 0.0) for m in steps),
        "algo": config.algorithm.algo, "model": args.model or "embedded", "resumed": args.resume,
        "mixed_precision": config.resolved_mixed_precision,
        "metrics": str(out / "metrics.jsonl"), "timeline": str(out / "timeline.png"),
        "placement_plot": str(out / "placement.png"), "task": task_summary(task, args),
        "config": dataclasses.asdict(config), "settings": settings, **summary_extras(args, metrics),
        "config_file": None if args.config is None else str(args.config),
    }
    try:                                      # the disk may fill after the last checkpoint too
        plot_timelines({f"stage 6, {args.placement}: which role was busy when (last 3 steps)":
                        last_steps_of(timeline, 3)}, ROLE_COLORS, out / "timeline.png", xlabel="seconds (wall clock)")
        plot_placement(where, out / "placement.png", title=f"stage 6, {args.placement}: role -> node -> device")
        write_summary(out, summary)
    except OSError as err:
        return write_stop(err, out, again)
    if evals:
        print(f"{args.placement}: {held_out_line(task, summary, seconds)}")
    shares = ", ".join(f"{s} {100 * v:.1f}%" for s, v in summary["stage_shares"].items())
    print(f"stage shares: {shares}; sync {summary['sync_seconds'] * 1e3:.1f} ms and "
          f"{summary['sync_bytes'] / 2**20:.1f} MiB per step")
    for name, row in summary["sync_compare"].items():
        print(f"sync {name}: median {row['seconds_median'] * 1e3:.1f} ms for {row['bytes'] / 2**20:.1f} MiB")
    print(f"timeline: {out / 'timeline.png'}   placement: {out / 'placement.png'}   summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
