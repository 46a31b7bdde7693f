"""Stage 1: the whole RL loop (generate -> reward -> update -> synchronize) in one process.

    python chapters/01_single_process.py --out runs/01            # GRPO on the embedded policy, CPU
    python chapters/01_single_process.py --algo ppo --out runs/01-ppo
    python chapters/01_single_process.py --model Qwen/Qwen2.5-0.5B --device cuda --out runs/01-qwen
    python chapters/01_single_process.py --out runs/01 --resume    # continue a stopped run exactly
    python chapters/01_single_process.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --out runs/01-words \
        --dataset data/word_problems_chat/train.jsonl --eval-dataset data/word_problems_chat/test.jsonl \
        --reward math --reward format --reward-weights 1 0.5 --max-completion-length 256
    python chapters/01_single_process.py --config run.yaml --out runs/01-yaml   # settings from a YAML file
    python chapters/01_single_process.py --config configs/smollm2.yaml --out runs/01-smollm2  # a real chat model
        # learns to answer arithmetic facts first (SmolLM2-135M-Instruct: build it once with
        # python chapters/00_warm_start.py --real-model; about 6 minutes on one CPU core)

Writes OUT/run.json (the run's settings), OUT/metrics.jsonl (one line per step),
OUT/reward_curve.png, OUT/checkpoints/step-N/ (Hugging Face format + training_state.pt,
written atomically), OUT/final/ (the final policy, Hugging Face format) and OUT/summary.json
with accuracy_before, accuracy_after (held-out greedy accuracy, 0-1; with --eval-dataset and no
correctness reward, the mean weighted reward), steps, seconds and every setting (`settings`, after
--config and the flags) with `defaults` ("trl": a --dataset run takes TRL's GRPOConfig defaults for
what was not set, max_completion_length 512 fitted to the model's context, learning_rate 1e-6, seed 42,
a linear schedule; "embedded": the embedded task's tuned ones), and OUT/completions.jsonl (what the model
wrote: --log-completions rows of prompt, completion and rewards of the first steps and of every
evaluation, also printed). A directory holds one run: --resume continues it, --overwrite replaces it.
Every setting of minirl.config.RLConfig is a flag below (with its default).

The task: --dataset (a `prompt` column, the other columns passed to the rewards, as in TRL;
a prompt may be a list of chat messages, rendered by the model's chat template),
--eval-dataset (held-out rows, decoded greedily and scored by the rewards), --reward
(repeatable: arithmetic, math, format, or module:function) and --reward-weights. Without
them, the embedded arithmetic task.

Precision: --dtype (the policy's) and --rollout-dtype (the engine's copy's) default to auto,
bfloat16 with --device cuda and float32 on the CPU.

The flags are parsed before torch and transformers are imported (a few seconds, more on a busy
machine), so a mistyped flag or a device this machine lacks is reported at once, in one line.
"""

from __future__ import annotations

import dataclasses
import sys
import time

# Only modules that load neither torch nor transformers: the flags are checked first (the heavy
# imports are inside the functions that need them).
from minirl.config import RLConfig
from minirl.runtime.accelerate_launch import accelerate_mixed_precision, refuse_several_processes
from minirl.runtime.cli import check_device, common_parser, config_from_args, flag, merged_settings
from minirl.runtime.io import write_summary
from minirl.runtime.progress import bars_wanted
from minirl.runtime.schedule import add_schedule_flags, schedule_callbacks
from minirl.runtime.trackers import add_report_flag, check_report_to, tracker_callbacks
from minirl.runtime.training_cli import (
    TASK_FLAGS,
    add_rl_flags,
    add_task_flags,
    check_engine_flag,
    check_task_prompts,
    data_defaults,
    data_record,
    held_out_line,
    resolve_task_paths,
    restore_task_flags,
    resume_command,
    saved_task,
    summary_extras,
    task_from_args,
    task_summary,
    write_stop,
)
from minirl.runtime.validate import ConfigError, check_int


def parse_args(argv=None):
    """(args, config, task, settings): flags checked, the config and the task built, before any model loads."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)   # both are config fields
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash: stop right after this step (exit status 1); continue with --resume")
    group.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads; 1 suits the tiny policy (its matrices are too small to gain from "
                            "more, and threads on a busy machine spin); 0: torch's default (default: 1)")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress bars (they are shown only when stderr is a terminal)")
    add_task_flags(parser)
    add_rl_flags(parser, RLConfig())
    add_schedule_flags(parser)
    add_report_flag(parser)
    args = parser.parse_args(argv)
    refuse_several_processes(parser)                 # torchrun or accelerate launch with N > 1: chapter 04's
    accelerate_mixed_precision(parser, args)         # accelerate launch --mixed_precision, when ours is auto
    for dest, low in (("stop_after", 1), ("threads", 0)):
        try:
            if getattr(args, dest) is not None:
                check_int(dest, getattr(args, dest), low=low)
        except ConfigError as err:
            parser.error(f"argument {flag(dest)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, RLConfig())
    check_report_to(parser, args)
    check_engine_flag(parser, config)                 # vLLM without vLLM or CUDA: refused before torch loads
    from minirl.runtime.training_cli import (  # the model's files are checked: after parsing
        check_run_flags,
        resumed_config,
    )

    check_run_flags(parser, args)          # a missing --model path before torch loads
    check_device(parser, config.run.device)           # imports torch: after every flag parsed
    resolve_task_paths(args)               # one spelling of a path: run.json records it, --resume compares it
    if args.resume:                        # the run's own settings (and task), changed only where the user says so
        saved = saved_task(args)
        config, _ = resumed_config(parser, args, argv, also=saved)
        restore_task_flags(args, saved)
    args.run_data = data_record(parser, args)   # the data's content hashes; on --resume, refused if changed
    task = task_from_args(parser, args)
    if not task.test and config.run.eval_every:
        print("no --eval-dataset: no held-out evaluation", file=sys.stderr)
        config = config.replace(eval_every=0)
    config = data_defaults(parser, args, config, task)   # --dataset: TRL's defaults where nothing was set
    return args, config, task, merged_settings(parser, args)


def main(argv=None) -> int:
    args, config, task, settings = parse_args(argv)
    progress = bars_wanted(args.no_progress)         # on a terminal only: a log gets no bars, ours or transformers'
    import torch

    from minirl.runtime.checkpoint import latest_checkpoint
    from minirl.runtime.model_loading import ModelSourceError, PromptError, load_policy
    from minirl.runtime.plots import plot_metrics
    from minirl.runtime.rundir import RunDirError
    from minirl.runtime.seeding import seed_everything
    from minirl.tasks.rewards import RewardError
    from minirl.train.run import RunStopped, train

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    try:
        model, tokenizer = load_policy(args.model, config.run.device, dtype=config.policy_dtype,
                                       dropout=not config.run.disable_dropout,
                                       progress=progress)
    except ModelSourceError as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return 2
    max_new_tokens = task.max_new_tokens or config.sampling.max_completion_length
    try:
        check_task_prompts(task, tokenizer, model, config, args)
    except PromptError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out, again = args.out, resume_command(args.out)
    started = time.perf_counter()
    run_info = {"model": args.model, "task": {k: getattr(args, k) for k in TASK_FLAGS}, "settings": settings,
                **args.run_data}
    try:
        metrics = train(config, model, tokenizer, out_dir=out, resume=args.resume, overwrite=args.overwrite,
                        progress=progress, stop_after=args.stop_after, run_info=run_info,
                        task=task, eval_fn=task.eval_fn(tokenizer, max_new_tokens),
                        extra_callbacks=tuple(schedule_callbacks(args, config.run.steps)
                                              + tracker_callbacks(args, out)))
    except RunStopped as stop:
        print(f"{stop}; continue with: {again}")
        return 1
    except OSError as err:                            # a disk that filled, a directory made read-only during the run
        return write_stop(err, out, again)
    except KeyboardInterrupt:
        found = latest_checkpoint(out / "checkpoints")
        where = f"the last checkpoint is {found[0]}" if found else "no checkpoint was written yet"
        print(f"\ninterrupted: {where}; continue with: python {sys.argv[0]} --out {out} --resume", file=sys.stderr)
        return 130
    except (RunDirError, ConfigError, PromptError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RewardError as err:                        # a reward function's output, named with its row
        found = latest_checkpoint(out / "checkpoints")
        resume = f"; the last checkpoint is {found[0]}, continue with --resume" if found else ""
        print(f"error: {err}{resume}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    evals = [m for m in metrics if "accuracy" in m]
    plot_path = out / "reward_curve.png"
    steps = [m for m in metrics if "reward" in m]
    last20 = [m["reward"] for m in steps][-20:]
    summary = {
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "steps": metrics[-1]["step"] if metrics else 0, "seconds": seconds,
        "seconds_training": sum(m.get("time/step", 0.0) for m in metrics),
        "stage_seconds": {k: sum(m.get(k, 0.0) for m in steps) for k in steps[-1] if k.startswith("time/")},
        "final_reward": sum(last20) / max(1, len(last20)),
        "algo": config.algorithm.algo, "model": args.model or "embedded", "resumed": args.resume,
        "device": config.run.device, "dtype": config.policy_dtype, "rollout_dtype": config.engine_dtype,
        "mixed_precision": {"bfloat16": "bf16", "float16": "fp16"}.get(config.autocast_dtype, "no"),
        "metrics": str(out / "metrics.jsonl"), "plot": str(plot_path), "final_model": str(out / "final"),
        "task": task_summary(task, args),
        "config": dataclasses.asdict(config), "settings": settings, **summary_extras(args, metrics),
        "config_file": None if args.config is None else str(args.config),
    }
    try:                                              # the disk may fill after the last checkpoint too
        plot_metrics(metrics, plot_path, title=f"stage 1, {config.algorithm.algo}: {args.model or 'embedded policy'}",
                     temperature=config.sampling.temperature)
        write_summary(out, summary)
    except OSError as err:
        return write_stop(err, out, again)
    if evals:
        print(f"{config.algorithm.algo}: {held_out_line(task, summary, seconds)}")
    else:
        print(f"{config.algorithm.algo}: {summary['steps']} steps in {seconds:.0f} s (--eval-every 0: no evaluation)")
    print(f"plot: {plot_path}   metrics: {out / 'metrics.jsonl'}   summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
