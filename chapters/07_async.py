"""Stage 7: asynchronous RL: producers fill a bounded queue, the trainer consumes it, staleness is bounded.

    python chapters/07_async.py --out runs/07                                  # eta = 1, no correction, CPU
    python chapters/07_async.py --max-staleness 0 --out runs/07-sync           # synchronous: the baseline
    python chapters/07_async.py --max-staleness 4 --correction areal --out runs/07-areal
    python chapters/07_async.py --correction tis --env-latency 0.02 --env-latency-sigma 2 --out runs/07-slow
    python chapters/07_async.py --max-turns 2 --in-flight --out runs/07-multiturn
    python chapters/07_async.py --ray --out runs/07-ray        # producers as Ray actors (local cluster)
    python chapters/07_async.py --out runs/07 --resume --steps 90              # continue a run (or a crash)

The trainer's loop is stage 1's (minirl.train.run.run_in_dir): OUT/run.json (the run's
settings), OUT/metrics.jsonl (one line per trainer step, written as it happens: stage 1's keys
plus time/wait, queue/depth, queue/age_mean, queue/age_max, queue/dropped, staleness/max,
env/failures, ...), OUT/checkpoints/step-N/ every --checkpoint-every steps and at the end
(atomic; the newest --keep-checkpoints are kept), OUT/snapshots/ (weights every --snapshot-every
steps), OUT/timeline.png (what the trainer and the first producers did in the last 2 s),
OUT/learning_curve.png, OUT/final/ (the trained policy, Hugging Face format) and
OUT/summary.json with steps, accuracy_before, accuracy_after (held-out greedy accuracy, 0-1),
trajectories_per_second (completions trained on per wall second), trainer_idle_share (0-1),
max_staleness_seen (versions), and more. Prints one line every few steps with the queue's
depth and age and the trainer's idle share. Held-out accuracy is measured after the run on the
snapshots, so evaluation never pauses the trainer (there is no --eval-every).

A checkpoint holds what stage 1's does (weights, optimizer, step, version, RNG states) and the
queue: queued trajectories are saved and re-queued on resume; trajectories in flight (being
sampled, in an environment session) are not saved: their tickets are handed out again on
resume, so they are sampled anew from the same prompts and seeds with the checkpoint's
weights. --resume continues the run in --out from its newest checkpoint with the run's own
settings (only --steps, --checkpoint-every, --keep-checkpoints, --snapshot-every and --device
may change; another --max-staleness, --producers, ... is refused before anything loads);
--overwrite replaces a run. At --max-staleness 0 a resumed run repeats the uninterrupted one
exactly; above it, which trajectory lands in which batch depends on timing anyway. Exit status:
0 done, 1 stopped (--stop-after, or a producer failed), 2 bad input, 130 interrupted. Every
setting of minirl.config.RLConfig and of AsyncConfig is a flag.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from minirl.asyncrl.plots import plot_learning_curves, plot_timelines
from minirl.asyncrl.runner import SAFE_ON_RESUME as ASYNC_SAFE_ON_RESUME
from minirl.asyncrl.runner import AsyncConfig, check_async, train_async
from minirl.asyncrl.snapshots import evaluate_snapshots
from minirl.config import RLConfig
from minirl.models.policy import ModelSourceError, greedy_accuracy, load_policy
from minirl.tasks.arithmetic import make_task
from minirl.train.checkpoint import latest_checkpoint
from minirl.train.cli import check_run_flags, resumed_config
from minirl.train.run import SAFE_ON_RESUME, RunStopped
from minirl.utils.cli import add_config_flags, common_parser, config_from_args, flag
from minirl.utils.io import write_summary
from minirl.utils.rundir import RunDirError, read_run_record
from minirl.utils.seeding import seed_everything
from minirl.utils.validate import ConfigError, check_float, check_int

DEFAULTS = RLConfig().replace(steps=60, learning_rate=1e-4, checkpoint_every=20)
SKIPPED = ("eval_every",)          # evaluation: on snapshots after the run (--snapshot-every)


def parse_args(argv=None):
    """(args, config, async_config): every flag checked before anything is loaded."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)
    parser.epilog = next(p for p in __doc__.split("\n\n") if p.startswith("A checkpoint holds"))
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its newest checkpoint (its queued trajectories are "
                            "re-queued, the ones in flight are sampled again from their tickets)")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash: stop right after this step (exit status 1); continue with --resume")
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    group.add_argument("--num-cpus", type=float, default=2, help="CPUs of the local Ray cluster (--ray) (default: 2)")
    group.add_argument("--print-every", type=int, default=10, help="a progress line every N steps (default: 10)")
    add_config_flags(parser, DEFAULTS, skip=SKIPPED)
    add_config_flags(parser, AsyncConfig())
    args = parser.parse_args(argv)
    try:
        check_int("threads", args.threads, low=0)
        check_int("print_every", args.print_every, low=1)
        check_float("num_cpus", args.num_cpus, low=0.0, low_open=True)
        if args.stop_after is not None:
            check_int("stop_after", args.stop_after, low=1)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, DEFAULTS)
    acfg = config_from_args(parser, args, AsyncConfig())
    check_run_flags(parser, args)           # --out free (or --resume / --overwrite), --model exists
    if args.resume:                         # the run's own settings, changed only where it cannot matter
        saved = read_run_record(args.out).get("async")
        if saved is None:
            parser.error(f"--resume: {args.out} holds no asynchronous run (its run.json has no async settings); "
                         "resume it with the chapter that started it")
        safe = tuple(k for k in SAFE_ON_RESUME if k not in SKIPPED) + ASYNC_SAFE_ON_RESUME
        config, _ = resumed_config(parser, args, argv, also=saved, safe=safe)
        acfg = AsyncConfig(**saved | {k: getattr(args, k) for k in ASYNC_SAFE_ON_RESUME})
    try:
        check_async(config, acfg)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    return args, config, acfg


def progress_line(every: int, steps: int):
    def line(record):
        if record["step"] % every == 0 or record["step"] == steps:
            print(f"step {record['step']:4d}  wall {record['wall']:6.1f} s  reward {record['reward']:.2f}  "
                  f"queue depth {record['queue/depth']:3d}  age max {record['queue/age_max']:.2f} s  "
                  f"dropped {record['queue/dropped']:3d}  staleness max {record['staleness/max']}  "
                  f"wait {record['time/wait']:.3f} s  update {record['time/update']:.3f} s", flush=True)
    return line


def main(argv=None) -> int:
    args, config, acfg = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    task, out = make_task(), Path(args.out)
    try:
        model, tokenizer = load_policy(args.model, config.run.device, progress=False)
    except ModelSourceError as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return 2
    if acfg.ray:
        from minirl.controller.resource_pool import connect  # noqa: PLC0415 (Ray only with --ray)
        print(connect(None, num_cpus=args.num_cpus))
    started = time.perf_counter()
    try:
        result = train_async(config, acfg, model, tokenizer, task.rows("train"), out_dir=out, resume=args.resume,
                             overwrite=args.overwrite, on_step=progress_line(args.print_every, config.run.steps),
                             stop_after=args.stop_after, run_info={"model": args.model})
    except RunStopped as stop:
        print(f"{stop}; continue with: python {sys.argv[0]} --out {out} --resume")
        return 1
    except KeyboardInterrupt:
        found = latest_checkpoint(out / "checkpoints")
        where = f"the last checkpoint is {found[0]}" if found else "no checkpoint was written yet"
        print(f"\ninterrupted: {where}; continue with: python {sys.argv[0]} --out {out} --resume", file=sys.stderr)
        return 130
    except (RunDirError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as err:          # a producer failed, or no batch came
        print(f"error: the run stopped: {type(err).__name__}: {err}; continue from its last checkpoint with: "
              f"python {sys.argv[0]} --out {out} --resume", file=sys.stderr)
        return 1
    finally:
        if acfg.ray:
            import ray  # noqa: PLC0415
            ray.shutdown()
    accuracy = evaluate_snapshots(result, model, lambda m: greedy_accuracy(m, tokenizer, task))
    summary = result.summary() | {"max_staleness": acfg.max_staleness, "correction": acfg.correction,
                                  "resumed": args.resume, "accuracy_curve": accuracy,
                                  "seconds_total": time.perf_counter() - started, "model": args.model or "embedded",
                                  "metrics": str(out / "metrics.jsonl"), "final_model": str(out / "final")}
    end = result.ended
    plot_timelines({f"eta = {acfg.max_staleness}, last 2 s": result.timeline.window(end - 2.0, end)},
                   out / "timeline.png")
    plot_learning_curves({f"eta = {acfg.max_staleness} ({acfg.correction})": accuracy}, out / "learning_curve.png")
    write_summary(out, summary)
    print(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} after "
          f"{summary['steps']} steps; {summary['trajectories_per_second']:.0f} trajectories/s; "
          f"trainer idle {100 * summary['trainer_idle_share']:.0f} %; "
          f"max staleness seen {summary['max_staleness_seen']} (bound {acfg.max_staleness}); "
          f"queue depth mean {summary['queue_depth_mean']:.1f}; dropped {summary['dropped']}; "
          f"environment failures {summary['env_failures']} ({summary['env_timeouts']} timeouts)")
    print(f"wrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
