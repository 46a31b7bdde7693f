"""Chapter 02: measure the training-inference mismatch of any HF causal LM, on any device.

    python chapters/02_mismatch.py                                  # embedded policy, CPU, all rollout dtypes
    python chapters/02_mismatch.py --model Qwen/Qwen2.5-0.5B --device cuda --prompts-file prompts.txt
    python chapters/02_mismatch.py --rollout-dtype float8_e4m3fn --train-dtype bfloat16
    python chapters/02_mismatch.py --train-steps 60                 # + two training runs, without/with TIS

The rollout side is minirl.rollout.hf.HFEngine (HF generate with a KV cache in the rollout
dtype); the trainer side recomputes the same tokens with one full forward in --train-dtype.
Prints minirl.diagnostics.mismatch.diagnose_mismatch's report and writes OUT/summary.json with, per rollout dtype,
mean and max |delta log p| and the share of tokens whose ratio leaves [0.8, 1.25]. The training
comparison trains in float32 (--dtype of chapter 01), so the rollout is the only side that changes.

The flags are parsed before torch and transformers are imported: a mistyped flag, or a --device
this machine lacks, is reported in one line at once.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

# Light modules only (no torch, no transformers): the heavy ones are imported after the flags are checked.
from minirl.config import ROLLOUT_DTYPES
from minirl.runtime.cli import check_args, check_device, common_parser, seed_everything, write_summary
from minirl.runtime.validate import check_float, check_int


def load(args):
    """(model, tokenizer, prompts) from --model / --prompts-file, or the embedded default."""
    from minirl.runtime.model_loading import check_prompts, load_policy
    from minirl.tasks.arithmetic import make_task

    model, tokenizer = load_policy(args.model, args.device, dtype="float32", progress=False)
    if args.prompts_file:
        prompts = [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        if not prompts:
            raise SystemExit(f"error: --prompts-file {args.prompts_file}: holds no prompt (one per line)")
    else:
        prompts = [row["prompt"] for row in make_task().rows("train")]
    prompts = prompts[:args.num_prompts]
    check_prompts(tokenizer, prompts, getattr(model.config, "max_position_embeddings", None), args.max_new_tokens)
    return model, tokenizer, prompts


def training_comparison(args, model, tokenizer) -> dict:
    """Two stage-1 runs of `model` with a mismatched rollout: without and with truncated IS. Returns their records.

    The ratio statistics (`ratio/std`, `ratio/max`, ...) come from the actor's update metrics.
    """
    from minirl.config import RLConfig
    from minirl.train.run import train

    runs = {}
    for correction in (False, True):
        config = RLConfig.from_flat(steps=args.train_steps, rollout_dtype=args.train_rollout_dtype,
                                    importance_sampling_correction=correction, learning_rate=args.learning_rate,
                                    prompts_per_step=args.prompts_per_step, eval_every=args.eval_every,
                                    seed=args.seed, device=args.device, dtype="float32")
        name = "tis" if correction else "no_correction"
        runs[name] = train(config, copy.deepcopy(model), tokenizer, out_dir=args.out / name, overwrite=True,
                           progress=not args.quiet)
    return runs


def summarize_run(metrics: list[dict]) -> dict:
    steps = [m for m in metrics if "reward" in m]
    evals = [m["accuracy"] for m in metrics if "accuracy" in m]
    half = max(1, len(steps) // 2)

    def mean(key, rows):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")
    return {"reward_first_half": mean("reward", steps[:half]), "reward_second_half": mean("reward", steps[half:]),
            "accuracy_start": evals[0] if evals else None, "accuracy_end": evals[-1] if evals else None,
            "logprob_diff_abs": mean("logprob_diff_abs", steps), "ratio_std": mean("ratio/std", steps),
            "ratio_outside": mean("ratio/outside", steps), "ratio_max": max((r.get("ratio/max", 0) for r in steps),
                                                                            default=None),
            "clip_ratio": mean("clip_ratio/region_mean", steps)}


def mismatch(argv=None) -> dict:
    """Parse the flags (bad ones exit 2 before anything loads), diagnose, optionally train; the summary."""
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--rollout-dtype", default=None, choices=ROLLOUT_DTYPES,
                        help="the rollout dtype for the detailed report (default bfloat16); the sweep covers all")
    parser.add_argument("--sweep", default=",".join(ROLLOUT_DTYPES), help="comma-separated rollout dtypes")
    parser.add_argument("--train-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prompts-file", default=None, help="one prompt per line (default: the arithmetic task)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--train-steps", type=int, default=0, help="> 0: also train twice (without/with TIS)")
    parser.add_argument("--train-rollout-dtype", default="float8_e4m3fn", choices=ROLLOUT_DTYPES)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    check_args(parser, {                    # every value checked before anything is loaded
        "num_prompts": lambda v: check_int("num_prompts", v, low=1),
        "num_generations": lambda v: check_int("num_generations", v, low=1),
        "max_new_tokens": lambda v: check_int("max_new_tokens", v, low=1),
        "temperature": lambda v: check_float("temperature", v, low=0.0, low_open=True),
        "train_steps": lambda v: check_int("train_steps", v, low=0, why="0: no training comparison"),
        "learning_rate": lambda v: check_float("learning_rate", v, low=0.0, low_open=True),
        "prompts_per_step": lambda v: check_int("prompts_per_step", v, low=1),
        "eval_every": lambda v: check_int("eval_every", v, low=0, why="0 turns evaluation off"),
    }, args)
    sweep = tuple(d for d in args.sweep.split(",") if d)
    for d in sweep:
        if d not in ROLLOUT_DTYPES:
            parser.error(f"argument --sweep: {d!r}: use dtypes from {', '.join(ROLLOUT_DTYPES)}")
    if args.prompts_file and not Path(args.prompts_file).is_file():
        parser.error(f"argument --prompts-file: {args.prompts_file!r}: no such file")
    check_device(parser, args.device)                   # imports torch: after every flag parsed
    from minirl.runtime.model_loading import ModelSourceError, check_model_source

    if args.model is not None:
        try:
            check_model_source(args.model)
        except ModelSourceError as err:
            parser.error(f"argument --model: {err}")
    from minirl.diagnostics.mismatch import diagnose_mismatch

    seed_everything(args.seed)
    model, tokenizer, prompts = load(args)
    report = diagnose_mismatch(model, tokenizer, prompts, rollout_dtype=args.rollout_dtype or "bfloat16",
                      train_dtype=args.train_dtype, sweep=sweep, num_generations=args.num_generations,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(report)
    summary = {"model": args.model or "embedded", "device": args.device, "train_dtype": args.train_dtype,
               "temperature": args.temperature, "tokens": report.stats["tokens"],
               "per_rollout_dtype": {d: {k: s[k] for k in ("mean_abs_delta", "max_abs_delta", "share_outside",
                                                            "kl_k3")} for d, s in report.sweep.items()},
               "report": report.to_dict()}
    if args.train_steps > 0:
        runs = training_comparison(args, model, tokenizer)
        summary["training"] = {name: summarize_run(m) for name, m in runs.items()}
        print("training with a", args.train_rollout_dtype, "rollout:")
        print(json.dumps(summary["training"], indent=2))
    path = write_summary(args.out, summary)
    print("wrote", path)
    return summary


def main(argv=None) -> int:
    """0 when the report and summary.json are written; 1 with a one-line error when the work fails."""
    try:
        mismatch(argv)
    except (ValueError, RuntimeError, OSError) as err:       # a bad model or prompts file found while loading
        print(f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
