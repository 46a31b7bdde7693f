"""Stage 7: asynchronous RL: producers fill a bounded queue, the trainer consumes it, staleness is bounded.

    python chapters/07_async.py --out runs/07                                  # eta = 1, no correction, CPU
    python chapters/07_async.py --max-staleness 0 --out runs/07-sync           # synchronous: the baseline
    python chapters/07_async.py --max-staleness 4 --correction areal --out runs/07-areal
    python chapters/07_async.py --correction tis --env-latency 0.02 --env-latency-sigma 2 --out runs/07-slow
    python chapters/07_async.py --max-turns 2 --in-flight --out runs/07-multiturn
    python chapters/07_async.py --ray --out runs/07-ray        # producers as Ray actors (local cluster)
    python chapters/07_async.py --out runs/07 --resume --steps 90              # continue a run (or a crash)
    python chapters/07_async.py --model Qwen/Qwen2.5-0.5B-Instruct --out runs/07-words \
        --dataset data/word_problems_chat/train.jsonl --eval-dataset data/word_problems_chat/test.jsonl \
        --reward math --reward format --reward-weights 1 0.5 --max-completion-length 256

The trainer's loop is stage 1's (minirl.train.run.run_in_dir): OUT/run.json (the run's
settings), OUT/metrics.jsonl (one line per trainer step, written as it happens: stage 1's keys
plus time/wait, queue/depth, queue/age_mean, queue/age_max, queue/dropped, staleness/max,
env/failures, ...), OUT/checkpoints/step-N/ every --checkpoint-every steps and at the end
(atomic; the newest --keep-checkpoints are kept), OUT/snapshots/ (weights every --snapshot-every
steps), OUT/timeline.png (what the trainer and the first producers did in the last 2 s),
OUT/learning_curve.png, OUT/final/ (the trained policy, Hugging Face format) and
OUT/summary.json with steps, accuracy_before, accuracy_after (held-out greedy accuracy, 0-1; with
--eval-dataset and no correctness reward, the mean weighted reward),
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
0 done, 1 stopped (--stop-after, a producer that failed or died, a disk that filled), 2 bad
input, 130 interrupted. Every setting of minirl.config.RLConfig and of AsyncConfig is a flag.

The task flags are chapter 01's (--dataset, --eval-dataset, --reward, --reward-weights). A
data set's completions are scored by its reward functions in single-turn sessions
(`RewardEnv`: the row's columns, the weights; a reward that raises scores that session 0 and
counts as an environment failure), and every record has `rewards/<name>` and
`frac_reward_zero_std`. Without them, the embedded arithmetic task and its calculator tool
(--env-latency, --max-turns).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from minirl.config import RLConfig
from minirl.runtime.async_config import ASYNC_SAFE_ON_RESUME, AsyncConfig, check_async
from minirl.runtime.cli import add_config_flags, check_device, common_parser, config_from_args, flag, merged_settings
from minirl.runtime.progress import bars_wanted
from minirl.runtime.rundir import read_run_record
from minirl.runtime.schedule import add_schedule_flags, schedule_callbacks
from minirl.runtime.trackers import add_report_flag, check_report_to, tracker_callbacks
from minirl.runtime.training_cli import (
    add_rl_flags,
    add_task_flags,
    check_engine_flag,
    check_run_flags,
    check_task_prompts,
    data_defaults,
    data_record,
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

DEFAULTS = RLConfig().replace(steps=60, learning_rate=1e-4, checkpoint_every=20)
SKIPPED = ("eval_every",)          # evaluation: on snapshots after the run (--snapshot-every)
STAGE1_SAFE_ON_RESUME = ("steps", "checkpoint_every", "keep_checkpoints", "device",
                         "log_completions")   # minirl.train.run's, less
# eval_every (a test keeps them equal): here, so that a bad command line is refused before torch loads


def parse_args(argv=None):
    """(args, config, async_config, task, settings): every flag checked and the task built, before a model loads.
    The parser runs before any heavy import: a usage error is immediate."""
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
    add_task_flags(parser)
    add_rl_flags(parser, DEFAULTS, skip=SKIPPED)
    add_schedule_flags(parser)
    add_report_flag(parser)
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
    check_report_to(parser, args)
    check_engine_flag(parser, config)      # vLLM without vLLM or CUDA: refused before torch loads
    check_run_flags(parser, args)           # --out free (or --resume / --overwrite) and writable, --model exists
    resolve_task_paths(args)
    if args.resume:                         # the run's own settings, changed only where it cannot matter
        saved = read_run_record(args.out).get("async")
        if saved is None:
            parser.error(f"--resume: {args.out} holds no asynchronous run (its run.json has no async settings); "
                         "resume it with the chapter that started it")
        task_flags = saved_task(args)
        config, _ = resumed_config(parser, args, argv, also=saved | task_flags,
                                   safe=STAGE1_SAFE_ON_RESUME + ASYNC_SAFE_ON_RESUME)
        acfg = AsyncConfig(**saved | {k: getattr(args, k) for k in ASYNC_SAFE_ON_RESUME})
        restore_task_flags(args, task_flags)
        restore_untyped(parser, args, argv, read_run_record(args.out).get("where", {}))   # --ray's --num-cpus
    args.run_data = data_record(parser, args)   # the data's content hashes; on --resume, refused if changed
    check_device(parser, config.run.device)
    try:
        check_async(config, acfg)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    if args.dataset is not None and acfg.max_turns > 1:
        parser.error(f"argument --max-turns: {acfg.max_turns}: a --dataset task is scored in one turn by its "
                     "rewards; multi-turn sessions are the embedded task's calculator tool (drop --dataset, or "
                     "--max-turns)")
    task = task_from_args(parser, args)
    config = data_defaults(parser, args, config, task)   # --dataset: TRL's defaults where nothing was set
    return args, config, acfg, task, merged_settings(parser, args)


def progress_line(every: int, steps: int):
    def line(record):
        if record["step"] % every == 0 or record["step"] == steps:
            print(f"step {record['step']:4d}  wall {record['wall']:6.1f} s  reward {record['reward']:.2f}  "
                  f"queue depth {record['queue/depth']:3d}  age max {record['queue/age_max']:.2f} s  "
                  f"dropped {record['queue/dropped']:3d}  staleness max {record['staleness/max']}  "
                  f"wait {record['time/wait']:.3f} s  update {record['time/update']:.3f} s", flush=True)
    return line


def main(argv=None) -> int:
    """The chapter: flags, training, report. Ctrl-C at any moment ends in one line and exit status 130 (not a
    traceback): while the flags are checked, while the model loads or Ray starts, and after the run too."""
    try:
        args, config, acfg, task, settings = parse_args(argv)
    except KeyboardInterrupt:
        print("\ninterrupted before the run started: nothing was written", file=sys.stderr)
        return 130
    try:
        return train_and_report(args, config, acfg, task, settings)
    except KeyboardInterrupt:                 # outside the run's own handler: loading, Ray's start, the evaluation
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()     # a Ray left connected at exit can abort the process in its teardown
        if not (Path(args.out) / "run.json").exists():
            print("\ninterrupted before the run started: nothing was written", file=sys.stderr)
        else:
            print(f"\n{interrupted_line(args.out, resume_command(args.out))}", file=sys.stderr)
        return 130


def train_and_report(args, config, acfg: AsyncConfig, task, settings) -> int:
    bars_wanted()                           # transformers' bars ("Writing model shards") on a terminal only
    from functools import partial  # noqa: PLC0415 (after the arguments: a usage error never waits for torch)

    import torch  # noqa: PLC0415

    from minirl.runtime.async_envs import RewardEnv  # noqa: PLC0415
    from minirl.runtime.async_plots import ACTIVITY_COLORS, plot_learning_curves  # noqa: PLC0415
    from minirl.runtime.async_run import train_async  # noqa: PLC0415
    from minirl.runtime.async_snapshots import evaluate_snapshots  # noqa: PLC0415
    from minirl.runtime.cluster_plots import plot_timelines  # noqa: PLC0415
    from minirl.runtime.io import write_summary  # noqa: PLC0415
    from minirl.runtime.model_loading import (  # noqa: PLC0415
        ModelSourceError,
        PromptError,  # noqa: PLC0415
        load_policy,
    )
    from minirl.runtime.rundir import RunDirError  # noqa: PLC0415
    from minirl.runtime.seeding import seed_everything  # noqa: PLC0415
    from minirl.train.run import RunStopped  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    out, again = Path(args.out), resume_command(args.out)
    try:
        model, tokenizer = load_policy(args.model, config.run.device, progress=False,
                                       dropout=not config.run.disable_dropout)
    except ModelSourceError as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return 2
    max_new_tokens = task.max_new_tokens or config.sampling.max_completion_length
    try:
        check_task_prompts(task, tokenizer, model, config, args)
    except PromptError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    embedded = args.dataset is None          # the calculator tool; a data set: its rewards, one turn
    make_env = None if embedded else partial(RewardEnv, task.reward_funcs, task.reward_weights)
    ray = None
    started = time.perf_counter()
    try:
        if acfg.ray:
            import ray  # noqa: PLC0415 (Ray only with --ray)

            from minirl.runtime.ray_start import connect  # noqa: PLC0415
            print(connect(None, num_cpus=args.num_cpus), flush=True)
        from minirl.runtime.ray_calls import WorkerDiedError  # noqa: PLC0415 (imports Ray)
    except ConnectionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError:                      # no Ray installed: no Ray producer can die
        WorkerDiedError = type("WorkerDiedError", (RuntimeError,), {})  # noqa: N806
    run_info = {"model": args.model, "settings": settings, "where": {"num_cpus": args.num_cpus},
                "task": {k: getattr(args, k) for k in ("dataset", "eval_dataset", "reward", "reward_weights")},
                **args.run_data}
    try:
        result = train_async(config, acfg, model, tokenizer, task.train, out_dir=out, resume=args.resume,
                             overwrite=args.overwrite, on_step=progress_line(args.print_every, config.run.steps),
                             stop_after=args.stop_after, run_info=run_info, make_env=make_env,
                             extra_callbacks=tuple(schedule_callbacks(args, config.run.steps)
                                                   + tracker_callbacks(args, out)))
    except RunStopped as stop:
        print(stop_line(str(stop), last_checkpoint(out), again))
        return 1
    except KeyboardInterrupt:
        print(f"\n{interrupted_line(out, again)}", file=sys.stderr)
        return 130
    except WorkerDiedError as err:                       # a Ray producer that died (killed, out of memory)
        print(stop_line(getattr(err, "what", str(err)), last_checkpoint(out), again), file=sys.stderr)
        return 1
    except (RunDirError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:                    # a disk that filled, a directory made read-only during the run
        return write_stop(err, out, again)
    except (RuntimeError, TimeoutError) as err:          # a producer failed, or no batch came
        print(stop_line(f"the run stopped: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                        last_checkpoint(out), again), file=sys.stderr)
        return 1
    finally:
        if ray is not None:
            ray.shutdown()
    ran = result.summary()
    if ran["trajectories"] and ran["env_failures"] >= ran["trajectories"]:
        print(f"error: every one of the {ran['trajectories']} trajectories failed in its environment (a reward "
              "function or the tool raised, hung or returned junk: metrics.jsonl's env/ records say which); "
              "nothing was learned", file=sys.stderr)
        return 1
    eval_fn = task.eval_fn(tokenizer, max_new_tokens)
    accuracy = evaluate_snapshots(result, model, eval_fn, out, config.run.log_completions) if eval_fn else []
    metric = f"accuracy ({task.accuracy_reward})" if task.accuracy_reward else "mean weighted reward"
    summary = (result.summary() | {"accuracy_before": accuracy[0]["accuracy"] if accuracy else None,
                                   "accuracy_after": accuracy[-1]["accuracy"] if accuracy else None}
               | {"max_staleness": acfg.max_staleness, "correction": acfg.correction, "resumed": args.resume,
                  "accuracy_curve": accuracy, "eval_metric": metric, "seconds_total": time.perf_counter() - started,
                  "model": args.model or "embedded", "metrics": str(out / "metrics.jsonl"),
                  "final_model": str(out / "final"), "task": task_summary(task, args), "settings": settings,
                  **summary_extras(args, accuracy),
                  "config_file": None if args.config is None else str(args.config)})
    end = result.ended
    try:                                      # the disk may fill after the last checkpoint too
        plot_timelines({f"eta = {acfg.max_staleness}, last 2 s": result.timeline.window(end - 2.0, end)},
                       ACTIVITY_COLORS, out / "timeline.png", first="trainer", max_rows=6, panel_height=1.6)
        plot_learning_curves({f"eta = {acfg.max_staleness} ({acfg.correction})": accuracy}, out / "learning_curve.png")
        write_summary(out, summary)
    except OSError as err:
        return write_stop(err, out, again)
    held_out = (f"held-out {metric} {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} after "
                if accuracy else "no held-out evaluation (no --eval-dataset); ")
    print(f"{held_out}{summary['steps']} steps; {summary['trajectories_per_second']:.0f} trajectories/s; "
          f"trainer idle {100 * summary['trainer_idle_share']:.0f} %; "
          f"max staleness seen {summary['max_staleness_seen']} (bound {acfg.max_staleness}); "
          f"queue depth mean {summary['queue_depth_mean']:.1f}; dropped {summary['dropped']}; "
          f"environment failures {summary['env_failures']} ({summary['env_timeouts']} timeouts)")
    print(f"wrote {out / 'summary.json'}")
    return 0


def leave_now(code: int) -> None:
    """Exit with `code`; while a thread is still alive, through os._exit (`minirl.runtime.launch.leave`).

    A producer whose generation outlived the join at the run's end, or a scoring or session thread,
    is a daemon thread that may be inside a torch op: at the interpreter's teardown it is stopped
    when it takes the GIL back, that unwinds through torch's C++ frames, and C++ aborts the
    process ("terminate called without an active exception", exit 134, not 130). Measured: a daemon
    thread in torch.mm at exit aborts 20 of 20 times with sys.exit, 0 of 20 with os._exit.
    """
    if threading.active_count() > 1:
        from minirl.runtime.launch import leave  # noqa: PLC0415

        leave(code)
    sys.exit(code)


if __name__ == "__main__":
    leave_now(main())
