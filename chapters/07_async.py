"""Stage 7: asynchronous RL: producers fill a bounded queue, the trainer consumes it, staleness is bounded.

    python chapters/07_async.py --out runs/07                                  # eta = 1, no correction, CPU
    python chapters/07_async.py --max-staleness 0 --out runs/07-sync           # synchronous: the baseline
    python chapters/07_async.py --max-staleness 4 --correction areal --out runs/07-areal
    python chapters/07_async.py --correction tis --env-latency 0.02 --env-latency-sigma 2 --out runs/07-slow
    python chapters/07_async.py --max-turns 2 --in-flight --out runs/07-multiturn
    python chapters/07_async.py --ray --out runs/07-ray        # producers as Ray actors (local cluster)

Writes OUT/run.json (the run's settings), OUT/metrics.jsonl (one line per trainer step: stage 1's
keys plus time/wait, queue/depth, queue/age_mean, queue/age_max, queue/dropped, staleness/max,
env/failures, ...), OUT/timeline.png (what the trainer and the first producers did, and when),
OUT/learning_curve.png, OUT/final/ (the trained policy, Hugging Face format) and
OUT/summary.json with accuracy_before, accuracy_after (held-out greedy accuracy, 0-1),
trajectories_per_second (completions trained on per wall second),
trainer_idle_share (0-1), max_staleness_seen (versions), and more. Prints one line every few
steps with the queue's depth and age and the trainer's idle share. Held-out accuracy is measured
after the run on weight snapshots, so evaluation never pauses the trainer. An async run has no
checkpoints to resume from (its queue and in-flight trajectories are not saved); --overwrite
replaces a run. Every setting of minirl.config.RLConfig and of AsyncConfig is a flag below.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import ray
import torch

from minirl.asyncrl.plots import plot_learning_curves, plot_timelines
from minirl.asyncrl.runner import AsyncConfig, evaluate_snapshots, train_async
from minirl.config import RLConfig
from minirl.controller.resource_pool import connect
from minirl.models.policy import greedy_accuracy, load_policy
from minirl.tasks.arithmetic import make_task
from minirl.train.cli import check_run_flags
from minirl.utils.cli import add_config_flags, common_parser, config_from_args, flag
from minirl.utils.io import write_jsonl, write_summary
from minirl.utils.rundir import open_run_dir
from minirl.utils.seeding import seed_everything
from minirl.utils.validate import ConfigError, check_float, check_int

DEFAULTS = RLConfig().replace(steps=60, learning_rate=1e-4, checkpoint_every=0)
SKIPPED = ("eval_every", "checkpoint_every", "keep_checkpoints")      # evaluation: --snapshot-every; no checkpoints


def parse_args(argv=None):
    """(args, config, async_config): every flag checked before anything is loaded."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
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
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, DEFAULTS)
    acfg = config_from_args(parser, args, AsyncConfig())
    if acfg.capacity(config.run.prompts_per_step) < config.run.prompts_per_step:
        parser.error(f"argument --queue-capacity: {acfg.queue_capacity}: the queue must hold at least one batch of "
                     f"--prompts-per-step {config.run.prompts_per_step} trajectories")
    if acfg.ray and acfg.in_flight:
        parser.error("argument --in-flight: in-flight updates run in local producer threads only; drop it with --ray")
    args.resume = False                     # an async run is not resumable (its queue is not saved)
    check_run_flags(parser, args)           # --out free (or --overwrite), --model exists: before anything loads
    return args, config, acfg


def main(argv=None) -> int:
    args, config, acfg = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    task, out = make_task(), Path(args.out)
    if acfg.ray:
        print(connect(None, num_cpus=args.num_cpus))
    run_dir = open_run_dir(out, {"config": config.flat(), "async": vars(acfg) | {}, "model": args.model},
                           overwrite=args.overwrite)
    try:
        model, tokenizer = load_policy(args.model, config.run.device, progress=False)
        eval_fn = lambda m: greedy_accuracy(m, tokenizer, task)            # noqa: E731
        started = time.perf_counter()

        def line(record):
            if record["step"] % args.print_every == 0 or record["step"] == config.run.steps:
                print(f"step {record['step']:4d}  wall {record['wall']:6.1f} s  reward {record['reward']:.2f}  "
                      f"queue depth {record['queue/depth']:3d}  age max {record['queue/age_max']:.2f} s  "
                      f"dropped {record['queue/dropped']:3d}  staleness max {record['staleness/max']}  "
                      f"wait {record['time/wait']:.3f} s  update {record['time/update']:.3f} s", flush=True)

        result = train_async(config, acfg, model, tokenizer, task.rows("train"), on_step=line)
        accuracy = evaluate_snapshots(result, model, eval_fn)
        summary = result.summary() | {"max_staleness": acfg.max_staleness, "correction": acfg.correction,
                                      "accuracy_curve": accuracy, "seconds_total": time.perf_counter() - started}
        write_jsonl(out / "metrics.jsonl", result.records)
        t0 = result.timeline.t0
        end = t0 + result.wall
        plot_timelines({f"eta = {acfg.max_staleness}, last 2 s": result.timeline.window(end - 2.0, end)},
                       out / "timeline.png")
        plot_learning_curves({f"eta = {acfg.max_staleness} ({acfg.correction})": accuracy}, out / "learning_curve.png")
        model.save_pretrained(out / "final")                               # the trained policy (HF format)
        tokenizer.save_pretrained(out / "final")
        write_summary(out, summary)
    finally:
        run_dir.close()
        if acfg.ray:
            ray.shutdown()
    print(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
          f"{summary['trajectories_per_second']:.0f} trajectories/s; "
          f"trainer idle {100 * summary['trainer_idle_share']:.0f} %; "
          f"max staleness seen {summary['max_staleness_seen']} (bound {acfg.max_staleness}); "
          f"queue depth mean {summary['queue_depth_mean']:.1f}; dropped {summary['dropped']}; "
          f"environment failures {summary['env_failures']} ({summary['env_timeouts']} timeouts)")
    print(f"wrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
