"""Stage 1: the whole RL loop (generate -> reward -> update -> synchronize) in one process.

    python chapters/01_single_process.py --out runs/01            # GRPO on the embedded policy, CPU
    python chapters/01_single_process.py --algo ppo --out runs/01-ppo
    python chapters/01_single_process.py --model Qwen/Qwen2.5-0.5B --device cuda --out runs/01-qwen
    python chapters/01_single_process.py --out runs/01 --resume    # continue a stopped run exactly

Writes OUT/run.json (the run's settings), OUT/metrics.jsonl (one line per step),
OUT/reward_curve.png, OUT/checkpoints/step-N/ (Hugging Face format + training_state.pt,
written atomically), OUT/final/ (the final policy, Hugging Face format) and OUT/summary.json
with accuracy_before, accuracy_after (held-out greedy accuracy, 0-1), steps and seconds.
A directory holds one run: --resume continues it, --overwrite replaces it. Every setting of
minirl.config.RLConfig is a flag below (with its default).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from minirl.config import RLConfig
from minirl.models.policy import ModelSourceError, PromptError, load_policy
from minirl.train.checkpoint import latest_checkpoint
from minirl.train.plots import plot_metrics
from minirl.train.cli import check_run_flags, resumed_config
from minirl.train.run import RunStopped, train
from minirl.utils.cli import add_config_flags, common_parser, config_from_args, flag
from minirl.utils.io import write_summary
from minirl.utils.rundir import RunDirError
from minirl.utils.seeding import seed_everything
from minirl.utils.validate import ConfigError, check_int


def parse_args(argv=None):
    """(args, config): flags checked and the config built, before anything is loaded."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)   # both are config fields
    group = parser.add_argument_group("run directory and process")
    group.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete the run in --out and start a new one")
    group.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                       help="simulate a crash: stop right after this step (exit status 1); continue with --resume")
    group.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads; 1 suits the tiny policy (its matrices are too small to gain from "
                            "more, and threads on a busy machine spin); 0: torch's default (default: 1)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(parser, RLConfig())
    args = parser.parse_args(argv)
    for dest, low in (("stop_after", 1), ("threads", 0)):
        try:
            if getattr(args, dest) is not None:
                check_int(dest, getattr(args, dest), low=low)
        except ConfigError as err:
            parser.error(f"argument {flag(dest)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, RLConfig())
    check_run_flags(parser, args)
    if args.resume:                        # the run's own settings, changed only where the user says so
        config, _ = resumed_config(parser, args, argv)
    return args, config


def main(argv=None) -> int:
    args, config = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    try:
        model, tokenizer = load_policy(args.model, config.run.device, progress=not args.no_progress)
    except ModelSourceError as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return 2
    out = args.out
    started = time.perf_counter()
    try:
        metrics = train(config, model, tokenizer, out_dir=out, resume=args.resume, overwrite=args.overwrite,
                        progress=not args.no_progress, stop_after=args.stop_after, run_info={"model": args.model})
    except RunStopped as stop:
        print(f"{stop}; continue with: python {sys.argv[0]} --out {out} --resume")
        return 1
    except KeyboardInterrupt:
        found = latest_checkpoint(out / "checkpoints")
        where = f"the last checkpoint is {found[0]}" if found else "no checkpoint was written yet"
        print(f"\ninterrupted: {where}; continue with: python {sys.argv[0]} --out {out} --resume", file=sys.stderr)
        return 130
    except (RunDirError, ConfigError, PromptError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    evals = [m for m in metrics if "accuracy" in m]
    plot_path = out / "reward_curve.png"
    plot_metrics(metrics, plot_path, title=f"stage 1, {config.algorithm.algo}: {args.model or 'embedded policy'}")
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
        "metrics": str(out / "metrics.jsonl"), "plot": str(plot_path), "final_model": str(out / "final"),
        "config": dataclasses.asdict(config),
    }
    write_summary(out, summary)
    if evals:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        print(f"{config.algorithm.algo}: held-out greedy accuracy {before:.3f} -> {after:.3f} "
              f"({100 * (after - before):+.1f} points) in {summary['steps']} steps, {seconds:.0f} s")
    else:
        print(f"{config.algorithm.algo}: {summary['steps']} steps in {seconds:.0f} s (--eval-every 0: no evaluation)")
    print(f"plot: {plot_path}   metrics: {out / 'metrics.jsonl'}   summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
