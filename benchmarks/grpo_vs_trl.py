"""Seconds per GRPO step: minirl's single-process loop against TRL's GRPOTrainer, in one process.

    python benchmarks/grpo_vs_trl.py                      # 3 warm-up + 20 measured steps each
    python benchmarks/grpo_vs_trl.py --quick              # a few steps (a notebook cell)
    python benchmarks/grpo_vs_trl.py --threads 1          # steadier on a shared machine
    python benchmarks/grpo_vs_trl.py --out runs/bench     # summary.json there (default runs/latest)

The last line printed is `speedup_vs_trl: X`, TRL's median seconds per step over minirl's
(X > 1: minirl is faster).

What is compared. Both trainers start from the same warm-started policy (two fresh copies
loaded from the same checkpoint, or `--model`) and run the same GRPO step:
  - the same prompts: a fixed pool of `--prompts-per-step` training prompts, so every step of
    both trainers uses exactly these B prompts (TRL's sampler shuffles their order);
  - generation of B * G completions (`--num-generations` G), at most `--max-completion-length`
    new tokens, multinomial sampling at `--temperature` (top-k 0, top-p 1), HF `generate`
    with a KV cache, in float32;
  - the task's reward function (`task.reward`), group-normalized advantages (scale "group");
  - one forward + backward over the B * G sequences, loss_type `--loss-type`, beta = 0
    (no reference model), epsilon 0.2, num_iterations 1 (so neither computes old log-probs);
  - one AdamW step (learning rate `--learning-rate`, constant, no weight decay, gradient-norm
    clip 1.0).
TRL's defaults for large models are switched off so that both do the same arithmetic:
bf16=False (TRL autocasts to bf16 by default, even on a CPU), gradient_checkpointing=False
(TRL checkpoints by default, which re-runs the forward pass in backward). Its other defaults
stay (logging every 10 steps, no completion logging, its optimizer choice).

How it is timed. The two run interleaved in one process: a minirl step, a TRL step, a minirl
step, ..., so that a change in the machine's load hits both alike. TRL's `train()` runs in a
second thread, parked by a TrainerCallback before each step (on_step_begin) until its turn;
only one of the two computes at any time. TRL's step is the wall clock from on_step_begin to
on_step_end (generation happens inside the step, in `_prepare_inputs`; the work between steps,
logging and fetching the next prompts, finishes before TRL parks and is not counted). minirl's
step is the wall clock around the loop's own `train_step` (prompt sampling, generate, reward,
advantages, update and the weight sync; no evaluation). `--only minirl|trl` runs one side
alone (for profiling).

What still differs, and is part of what is measured:
  - TRL wraps everything in `accelerate` (device placement, gather calls on one process),
    computes and logs metrics (entropy via its fused LM head, clip ratios, completion lengths,
    reward statistics) with `.item()` synchronizations, turns completions into Python lists
    and pads them again, and profiles stages with `profiling_context`.
  - TRL scores the completions with its chunked "fused LM head" (log-softmax in tiles without
    materializing logits); minirl computes full logits for the C + 1 last positions only.
  - minirl keeps a separate rollout copy of the policy and copies the weights into it after
    every update (`sync_weights`, a real cost TRL does not pay, since TRL samples with the
    training model), and asks `generate` for the sampled tokens' logits (behaviour
    log-probs), which TRL does not.
  - minirl computes the entropy with a full softmax over the vocabulary (for its metrics).

Noise: the machine's load average before and after is printed and stored. On a shared machine
use `--threads 1`: with several intra-op threads, torch's thread barriers stall whenever another
process takes a core, and single steps then take ten times longer; one thread per side gives
stable medians. Compare medians, never single steps.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmark this checkout's minirl

from minirl._cli import common_parser, seed_everything, write_summary  # noqa: E402
from minirl.tasks import make_task  # noqa: E402


def parse_args(argv=None):
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per trainer")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per trainer, before")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 4 measured steps (a notebook cell)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="default: the task's longest answer + EOS")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", choices=("minirl", "trl"), default=None, help="run one side only (profiling)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 1
    for name in ("steps", "prompts_per_step"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}: must be >= 0")
    if args.num_generations < 2:
        parser.error(f"--num-generations={args.num_generations}: GRPO needs >= 2 completions per prompt")
    return args


def load_policy(args):
    """A fresh copy of the embedded warm-started policy, or of any HF causal LM (--model)."""
    if args.model is None:
        from minirl.models import load_default_policy

        model, tokenizer, _ = load_default_policy(device=args.device, progress=False)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval(), tokenizer


def prompt_pool(task, n: int, seed: int) -> list[dict]:
    """n training rows {"prompt", "answer"}, drawn once: every step of both trainers uses exactly these."""
    rows = task.rows("train")
    picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [rows[i] for i in picks]


def minirl_stepper(args, task, rows, max_completion_length: int):
    """A function that runs one minirl GRPO step (the loop's own `train_step`) and returns its seconds."""
    from minirl.loop import GRPOConfig, setup, train_step

    model, tokenizer = load_policy(args)
    config = GRPOConfig(steps=args.warmup + args.steps, prompts_per_step=len(rows),
                        num_generations=args.num_generations, max_completion_length=max_completion_length,
                        temperature=args.temperature, learning_rate=args.learning_rate, beta=0.0,
                        loss_type=args.loss_type, num_iterations=1, eval_every=0, seed=args.seed,
                        device=args.device)
    state = setup(config, model, tokenizer)

    def step() -> float:
        t0 = time.perf_counter()
        train_step(state, rows, [task.reward], config)
        return time.perf_counter() - t0

    return step


def trl_trainer(args, task, rows, max_completion_length: int, callback):
    """TRL's GRPOTrainer on the same policy, prompts and settings (see the module docstring)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_policy(args)
    G = args.num_generations
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trl_output"), report_to="none", save_strategy="no",
        use_cpu=args.device == "cpu", disable_tqdm=True, seed=args.seed,
        max_steps=args.warmup + args.steps, per_device_train_batch_size=len(rows) * G,
        gradient_accumulation_steps=1, num_generations=G, max_completion_length=max_completion_length,
        temperature=args.temperature, top_k=0, top_p=1.0, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type=args.loss_type, scale_rewards="group", num_iterations=1,
        bf16=False, gradient_checkpointing=False)
    return GRPOTrainer(model=model, reward_funcs=task.reward, args=config, train_dataset=Dataset.from_list(rows),
                       processing_class=tokenizer, callbacks=[callback])


class TRLSteps(TrainerCallback):
    """A TrainerCallback that times each TRL step and, when interleaving, parks TRL before each step.

    on_step_begin: signal `parked`, wait for `go`, take the clock; on_step_end: take the clock.
    The work TRL does between steps (logging, fetching the next prompts) finishes before it parks,
    so it never overlaps a minirl step.
    """

    def __init__(self, interleave: bool):
        import threading

        self.interleave = interleave
        self.parked, self.go = threading.Semaphore(0), threading.Semaphore(0)
        self.begin, self.end = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.interleave:
            self.parked.release()
            self.go.acquire()
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.perf_counter())

    def seconds(self) -> list[float]:
        return [e - b for b, e in zip(self.begin, self.end)]


def run_interleaved(args, task, rows, max_len) -> tuple[list[float], list[float]]:
    """minirl step, TRL step, minirl step, ...: a change in the machine's load hits both alike.

    TRL's `train()` runs in a second thread that the callback parks before each step; only one
    of the two ever computes at a time. Returns (minirl seconds, TRL seconds) per step, warm-up included.
    """
    import threading

    total = args.warmup + args.steps
    step_minirl = minirl_stepper(args, task, rows, max_len)
    timer = TRLSteps(interleave=True)
    trainer = trl_trainer(args, task, rows, max_len, timer)
    failure, finished = [], threading.Event()

    def run():
        try:
            trainer.train()
        except BaseException as err:  # re-raised in the main thread
            failure.append(err)
        finally:
            finished.set()
            timer.parked.release()     # never leave the main thread waiting

    thread = threading.Thread(target=run, name="trl-train", daemon=True)
    thread.start()
    minirl_seconds = []
    for _ in range(total):
        timer.parked.acquire()              # TRL is parked before its next step (or has stopped)
        if failure:
            raise RuntimeError("TRL's GRPOTrainer failed") from failure[0]
        if finished.is_set():
            raise RuntimeError(f"TRL's GRPOTrainer stopped after {len(timer.end)} steps, expected {total}")
        minirl_seconds.append(step_minirl())
        timer.go.release()                  # let TRL run one step
    thread.join()
    if failure:
        raise RuntimeError("TRL's GRPOTrainer failed") from failure[0]
    return minirl_seconds, timer.seconds()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    seed_everything(args.seed)
    task = make_task()
    rows = prompt_pool(task, args.prompts_per_step, args.seed)
    max_len = args.max_completion_length or task.config.max_answer_length + 1
    load_before = os.getloadavg()
    print(f"B={len(rows)} prompts x G={args.num_generations} completions, <= {max_len} new tokens, "
          f"loss_type={args.loss_type}, {args.warmup} warm-up + {args.steps} measured steps each, "
          f"{torch.get_num_threads()} torch threads, load average {load_before[0]:.2f}", flush=True)

    summary = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "completions_per_step": len(rows) * args.num_generations, "max_completion_length": max_len,
               "torch_threads": torch.get_num_threads(), "load_average_before": load_before[0]}
    if args.only is None:
        minirl_seconds, trl_seconds = run_interleaved(args, task, rows, max_len)
    elif args.only == "minirl":
        step = minirl_stepper(args, task, rows, max_len)
        minirl_seconds, trl_seconds = [step() for _ in range(args.warmup + args.steps)], []
    else:
        timer = TRLSteps(interleave=False)
        trl_trainer(args, task, rows, max_len, timer).train()
        minirl_seconds, trl_seconds = [], timer.seconds()
    for name, seconds in (("minirl", minirl_seconds), ("trl", trl_seconds)):
        if not seconds:
            continue
        measured = seconds[args.warmup:]
        summary |= {f"{name}_seconds": measured, f"{name}_warmup_seconds": seconds[:args.warmup],
                    f"{name}_median_seconds": statistics.median(measured)}
        print(f"{name:>6}: median {statistics.median(measured):.4f} s/step "
              f"(min {min(measured):.4f}, max {max(measured):.4f}, {len(measured)} steps)", flush=True)
    summary["load_average_after"] = os.getloadavg()[0]
    if args.only is None:
        summary["speedup_vs_trl"] = summary["trl_median_seconds"] / summary["minirl_median_seconds"]
    write_summary(args.out, summary)
    print(f"load average after: {summary['load_average_after']:.2f}; summary: {Path(args.out) / 'summary.json'}")
    if args.only is None:
        print(f"speedup_vs_trl: {summary['speedup_vs_trl']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
