"""Chapter 00: build (or load) the embedded policy and report its warm start.

    python chapters/00_warm_start.py --out runs/00

Prints the held-out greedy accuracy, saves the warm start's loss curve as a plot, and
writes `--out/summary.json`. With `--rebuild` the cached policy is ignored and trained
again (about 30 s on two CPU cores). The policy directory it prints is an ordinary Hugging
Face checkpoint: pass it as `--model` to the other chapters, or to `vllm serve`.
"""

import shutil
import time

from minirl.utils.cli import common_parser, write_summary
from minirl.models.policy import default_policy_dir, greedy_accuracy, load_default_policy, warm_start_report
from minirl.tasks.arithmetic import make_task


def main(argv=None) -> dict:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="train the warm start again")
    args = parser.parse_args(argv)
    if args.model is not None:
        parser.error("--model: chapter 00 builds the embedded policy; other chapters take --model")

    started = time.perf_counter()
    if args.rebuild and default_policy_dir().exists():
        shutil.rmtree(default_policy_dir())
    model, tokenizer, path = load_default_policy(device=args.device)
    accuracy = greedy_accuracy(model, tokenizer, make_task())
    report = warm_start_report(path)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(report["losses"], lw=0.8)
    ax.set(xlabel="step", ylabel="cross-entropy on answer tokens", title="warm start", yscale="log")
    fig.tight_layout()
    fig.savefig(args.out / "warm_start.png", dpi=120)

    summary = {"policy_dir": str(path), "heldout_accuracy": accuracy,
               "recorded_accuracy": report["heldout_accuracy"], "warm_start_steps": len(report["losses"]),
               "final_loss": report["losses"][-1], "seconds": time.perf_counter() - started}
    write_summary(args.out, summary)
    print(f"policy: {path}")
    print(f"held-out greedy accuracy after the warm start: {accuracy:.3f}")
    print(f"plot: {args.out / 'warm_start.png'}   summary: {args.out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
