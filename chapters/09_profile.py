"""Chapter 09: find a run's bottleneck -- time shares, MFU, and the source's symptom table as rules.

    python chapters/09_profile.py --run runs/01 --out runs/09                # analyse a finished run (any stage)
    python chapters/09_profile.py --profile-steps 3 --out runs/09-profiled   # a new stage-1 run, step 3 profiled
    python chapters/09_profile.py --profile-steps 3,4 --rollout-engine hf --steps 6 --out runs/09-hf
    python chapters/09_profile.py --run runs/01-gpu --peak-tflops 989 --out runs/09-gpu   # a GPU minirl does not know

Writes OUT/summary.json with `stage_shares` (category -> share of the run's time: generation,
reward, reference/values, update, sync, communication, waiting, other), `mfu` (`trainer`,
`rollout`: 0-1, null where it cannot be computed), `findings` (the names of the rules that
fired) and the details (`stage_shares_by_stage`, `measured`, `rules`, `workers_busy`: a Ray
run's workers, `partial`: what could not be measured and why), plus OUT/shares.png (shares
per step and a timeline). A stage-4 run (torchrun) is decomposed from rank 0's timers and
marked partial: its collectives run untimed inside update and sync. A stage-6 run (Ray) has
each stage's driver time outside the workers' calls (from its timeline.json) as
communication, `<stage>/rpc`. minirl/runtime/run_records.py lists the keys a run must write. With
--profile-steps the new run goes to OUT/run/ (run.json, metrics.jsonl, final/) and its
Chrome traces to OUT/run/profile/trace_step-N.json.gz (open them at https://ui.perfetto.dev
or chrome://tracing); summary.json then also holds `profile`. A CPU's peak is measured on
this machine at --threads; a GPU's comes from a table of datasheet peaks, or --peak-tflops.

The flags are checked before torch and transformers are imported: a mistyped flag, a --device
this machine lacks, or a --run directory that holds nothing the analysis reads (the output of
chapter 00, 03 or 05) is refused in one line, exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minirl.config import RLConfig
from minirl.runtime.cli import add_config_flags, check_device, common_parser, config_from_args, explicit_dests, flag
from minirl.runtime.io import write_summary
from minirl.runtime.rundir import RunDirError, check_run_dir, holds_run
from minirl.runtime.validate import ConfigError, check_float, check_int

PROFILE_DEFAULTS = RLConfig.from_flat(steps=6, eval_every=0, checkpoint_every=0)   # a short run to profile
# what the rules read from a summary.json alone (max_over_mean only to say the hottest/coldest ratio is missing)
READABLE_SUMMARY_KEYS = ("expert_load_hottest_over_coldest", "expert_load_max_over_mean", "error")
OTHER_CHAPTERS = {"policy_dir": "00 (the warm start)", "per_rollout_dtype": "02 (the mismatch report)",
                  "zero": "03 (the memory tables)", "comparison": "03 (--measure)",
                  "kv_utilization": "05 (generation speed)"}   # a key of their summary.json -> the chapter


def unreadable_run(path: Path) -> str | None:
    """Why `path` holds nothing the analysis can read (a reason naming the chapter that wrote it), or None."""
    if (path / "metrics.jsonl").is_file():
        return None
    try:
        summary = json.loads((path / "summary.json").read_text())
    except OSError:
        return "holds no run (no metrics.jsonl, no summary.json)"
    except ValueError as err:
        return f"its summary.json is not JSON ({err})"
    if not isinstance(summary, dict):
        return "its summary.json is not a JSON object"
    if any(key in summary for key in READABLE_SUMMARY_KEYS):
        return None
    writer = next((name for key, name in OTHER_CHAPTERS.items() if key in summary), None)
    what = f"the summary of chapter {writer}" if writer else "a summary.json"
    return (f"holds {what} and no metrics.jsonl: nothing the analysis reads (step times, or a summary's "
            f"{' or '.join(READABLE_SUMMARY_KEYS)})")


def parse_steps(text: str, last: int) -> list[int]:
    """'3' or '3,4' -> [3, 4]; ValueError naming what is wrong."""
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"{text!r}: step numbers separated by commas, e.g. 3 or 3,4") from None
    if not steps or steps[0] < 1 or steps[-1] > last:
        raise ValueError(f"{text!r}: steps from 1 to --steps ({last}); step 1 is the run's first (and slowest)")
    return steps


def parse_args(argv=None):
    """(args, config): every flag checked before anything is loaded."""
    parser = common_parser(__doc__.split("\n\n")[0], seed=False, device=False)
    group = parser.add_argument_group("what to analyse")
    group.add_argument("--run", type=Path, default=None, metavar="DIR",
                       help="a finished run directory of any stage (its --out): analyse it")
    group.add_argument("--profile-steps", default=None, metavar="STEPS",
                       help="start a new stage-1 run in OUT/run (the settings below) and profile these steps, e.g. 3 "
                            "or 3,4; then analyse it")
    group.add_argument("--peak-tflops", type=float, default=None,
                       help="the device's dense peak in TFLOP/s at the run's dtype (default: measured for a CPU, "
                            "datasheet table for known NVIDIA GPUs)")
    group.add_argument("--threads", type=int, default=1,
                       help="CPU threads of the run (the CPU peak is measured on as many) (default: 1)")
    group.add_argument("--overwrite", action="store_true", help="with --profile-steps: replace the run in OUT/run")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(parser, PROFILE_DEFAULTS)
    args = parser.parse_args(argv)
    try:
        check_int("threads", args.threads, low=1)
        if args.peak_tflops is not None:
            check_float("peak_tflops", args.peak_tflops, low=0.0, low_open=True)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")
    config = config_from_args(parser, args, PROFILE_DEFAULTS)
    if (args.run is None) == (args.profile_steps is None):
        parser.error("pass --run DIR (analyse a finished run) or --profile-steps STEPS (profile a new stage-1 run), "
                     "one of the two")
    if args.run is not None:
        typed = sorted(explicit_dests(parser, argv) & (set(config.flat()) | {"model", "overwrite"}))
        if typed:
            parser.error(f"argument {flag(typed[0])}: applies to --profile-steps runs only; --run analyses a finished "
                         "run as it ran")
        if not args.run.is_dir():
            parser.error(f"argument --run: {args.run} is not a directory; pass the --out directory of a run")
        problem = unreadable_run(args.run)
        if problem:
            parser.error(f"argument --run: {args.run} {problem}; pass the --out of a training run (chapters 01, "
                         "04, 06, 07, or 02's --train-steps subdirectories) or of chapter 08")
        if args.out.resolve() == args.run.resolve():
            parser.error("argument --out: must differ from --run (the run's own summary.json lives there)")
    else:
        check_device(parser, config.run.device)       # imports torch: after every flag parsed
        try:
            args.profile_steps = parse_steps(args.profile_steps, config.run.steps)
        except ValueError as err:
            parser.error(f"argument --profile-steps: {err}")
        try:
            check_run_dir(args.out / "run", resume=False, overwrite=args.overwrite,
                          flag_names=("--resume", "--overwrite", "--out"))
        except RunDirError as err:
            parser.error(str(err))
    if args.out.is_dir() and holds_run(args.out) and (args.out / "run.json").exists():
        parser.error(f"argument --out: {args.out} holds a run; choose another directory for the analysis")
    return args, config


def profile_run(args, config) -> tuple[Path, str | None]:
    """Run stage 1 into OUT/run with TorchProfiler on the chosen steps; (run directory, error or None)."""
    import torch

    from minirl.profiling.profiler import TorchProfiler
    from minirl.runtime.model_loading import load_policy
    from minirl.runtime.seeding import seed_everything
    from minirl.train.run import train

    torch.set_num_threads(args.threads)
    seed_everything(config.run.seed)
    model, tokenizer = load_policy(args.model, config.run.device, dtype=config.policy_dtype,
                                   progress=not args.no_progress)
    run_dir = args.out / "run"
    try:
        train(config, model, tokenizer, out_dir=run_dir, overwrite=args.overwrite, progress=not args.no_progress,
              extra_callbacks=[TorchProfiler(run_dir, args.profile_steps)],
              run_info={"model": args.model, "threads": args.threads})
    except (torch.OutOfMemoryError, RuntimeError) as err:
        text = str(err)
        if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in text:
            raise
        error = f"out of memory during the run ({type(err).__name__}: {text.splitlines()[0][:300]})"
        write_summary(run_dir, {"error": error})                 # the activation_oom rule reads it
        return run_dir, error
    return run_dir, None


def main(argv=None) -> int:
    args, config = parse_args(argv)
    error = None
    if args.profile_steps:
        run_dir, error = profile_run(args, config)
    else:
        run_dir = args.run
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minirl.runtime.diagnosis_report import diagnose
    from minirl.runtime.profiling_plots import plot_shares, plot_stage_timeline
    from minirl.runtime.run_records import RunDataError

    try:
        diagnosis = diagnose(run_dir, peak_tflops=args.peak_tflops, threads=args.threads)
    except RunDataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = diagnosis.summary()
    profile = run_dir / "profile" / "summary.json"
    if profile.is_file():
        summary["profile"] = json.loads(profile.read_text())
        for step, result in summary["profile"]["per_step"].items():
            print(f"step {step} profiled: trace {result['trace']} (open it at https://ui.perfetto.dev)")
    if error:
        summary["error"] = error
    args.out.mkdir(parents=True, exist_ok=True)
    if diagnosis.decomposition is not None:
        fig, axes = plt.subplots(2, 1, figsize=(9, 5.5))
        plot_shares(diagnosis.decomposition, ax=axes[0], title=f"{run_dir}: each step's time by category")
        plot_stage_timeline(diagnosis.decomposition, steps=3, ax=axes[1])
        fig.tight_layout()
        fig.savefig(args.out / "shares.png", dpi=120)
        plt.close(fig)
        summary["plot"] = str(args.out / "shares.png")
    write_summary(args.out, summary)
    print(f"summary: {args.out / 'summary.json'}" + (f"   plot: {summary['plot']}" if "plot" in summary else ""))
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
