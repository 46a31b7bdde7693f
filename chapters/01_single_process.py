"""Stage 1: the whole RL loop (generate -> reward -> update -> synchronize) in one process.

    python chapters/01_single_process.py --out runs/01            # GRPO on the embedded policy, CPU
    python chapters/01_single_process.py --algo ppo --out runs/01-ppo
    python chapters/01_single_process.py --model Qwen/Qwen2.5-0.5B --device cuda --out runs/01-qwen
    python chapters/01_single_process.py --out runs/01 --resume    # continue a killed run exactly

Writes OUT/metrics.jsonl (one line per step), OUT/reward_curve.png, OUT/checkpoints/step-N/
(Hugging Face format + training_state.pt, written atomically) and OUT/summary.json with
accuracy_before, accuracy_after (held-out greedy accuracy, 0-1), steps and seconds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from minirl.utils.cli import common_parser, seed_everything, write_summary
from minirl.train.loop import GRPOConfig, plot_metrics, train
from minirl.models.policy import load_default_policy
from minirl.tasks.arithmetic import make_task

DEFAULTS = GRPOConfig()


def parse_args(argv=None):
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--algo", choices=("grpo", "ppo"), default=DEFAULTS.algo)
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--prompts-per-step", type=int, default=DEFAULTS.prompts_per_step)
    parser.add_argument("--num-generations", type=int, default=DEFAULTS.num_generations)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--beta", type=float, default=DEFAULTS.beta, help="KL coefficient to the reference")
    parser.add_argument("--loss-type", default=DEFAULTS.loss_type, choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    parser.add_argument("--importance-sampling-level", default="token", choices=("token", "sequence"))
    parser.add_argument("--num-iterations", type=int, default=DEFAULTS.num_iterations)
    parser.add_argument("--rollout-dtype", default=DEFAULTS.rollout_dtype,
                        choices=("float32", "bfloat16", "float16", "float8_e4m3fn"))
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="default: the task's longest answer + EOS")
    parser.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="0: no checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints (exactly)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="simulate a crash: exit with code 1 right after the checkpoint at this step")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 suits the tiny policy (its matrices are too small to gain "
                             "from more, and threads on a busy machine spin); 0: torch's default")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def load_policy(args):
    """The embedded warm-started policy, or any HF causal LM id/path (--model)."""
    if args.model is None:
        model, tokenizer, _ = load_default_policy(device=args.device, progress=not args.no_progress)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:          # what TRL does for models without one
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    return model, tokenizer


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    task = make_task()
    model, tokenizer = load_policy(args)
    config = GRPOConfig(
        algo=args.algo, steps=args.steps, prompts_per_step=args.prompts_per_step,
        num_generations=args.num_generations, learning_rate=args.learning_rate, beta=args.beta,
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        num_iterations=args.num_iterations, rollout_dtype=args.rollout_dtype, seed=args.seed,
        max_completion_length=args.max_completion_length or task.config.max_answer_length + 1,
        eval_every=args.eval_every or args.steps, checkpoint_every=args.checkpoint_every, device=args.device)
    out = Path(args.out)
    t0 = time.perf_counter()
    metrics = train(config, model, tokenizer, task, out_dir=out, progress=not args.no_progress,
                    resume=args.resume, stop_after=args.stop_after)
    seconds = time.perf_counter() - t0
    step = max(m["step"] for m in metrics)
    if args.stop_after is not None and step < config.steps:
        print(f"stopped after the checkpoint at step {step} (--stop-after); continue with --resume")
        return 1
    evals = [m for m in metrics if "accuracy" in m]
    before, after = evals[0]["accuracy"], evals[-1]["accuracy"]
    plot_path = out / "reward_curve.png"
    plot_metrics(metrics, plot_path, title=f"stage 1, {config.algo}: {args.model or 'embedded policy'}")
    last20 = [m["reward"] for m in metrics if "reward" in m][-20:]
    stage_seconds = {k: sum(m.get(k, 0.0) for m in metrics) for k in metrics[-1] if k.startswith("time/")}
    summary = {
        "accuracy_before": before, "accuracy_after": after, "steps": step, "seconds": seconds,
        "seconds_training": sum(m.get("time/step", 0.0) for m in metrics), "stage_seconds": stage_seconds,
        "final_reward": sum(last20) / max(1, len(last20)),
        "algo": config.algo, "model": args.model or "embedded", "resumed": args.resume,
        "metrics": str(out / "metrics.jsonl"), "plot": str(plot_path), "config": asdict(config),
    }
    write_summary(out, summary)
    print(f"{config.algo}: held-out greedy accuracy {before:.3f} -> {after:.3f} "
          f"({100 * (after - before):+.1f} points) in {step} steps, {seconds:.0f} s")
    print(f"plot: {plot_path}   metrics: {out / 'metrics.jsonl'}   summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
