"""Seconds per GRPO step: minirl's single-process loop against TRL's GRPOTrainer, in one process.

    python benchmarks/grpo_vs_trl.py                      # 3 warm-up + 20 measured pairs of steps
    python benchmarks/grpo_vs_trl.py --quick              # a few steps (a notebook cell)
    python benchmarks/grpo_vs_trl.py --threads 1          # steadier on a shared machine
    python benchmarks/grpo_vs_trl.py --out runs/bench     # summary.json there (default runs/latest)
    python benchmarks/grpo_vs_trl.py --workload long      # long completions: the paged engine (notebook 05)
    python benchmarks/grpo_vs_trl.py --workload long --max-tokens-per-microbatch 0   # the update padded, as before

The last line printed is `speedup_vs_trl: X (min A, max B, n N)`: the median over N pairs of steps
of TRL's step seconds over minirl's within the pair, and the smallest and largest of those N
ratios (X > 1: minirl is faster). A pair is one minirl step and one TRL step run back to back
on the same prompts; which of the two runs first alternates from pair to pair. Before it:
minirl's generate and update seconds per step (medians, by the loop's own clocks), and the
completion tokens its update computed per step, padded to the longest completion against in its
micro-batches (notebook 01, section 10.3), beside the real ones.

What is compared. Both trainers start from the same warm-started policy (two fresh copies
loaded from the same checkpoint, or `--model`) and run the same GRPO step:
  - the same prompts: a fixed pool of `--prompts-per-step` training prompts, so every step of
    both trainers uses exactly these B prompts (TRL's sampler shuffles their order);
  - generation of B * G completions (`--num-generations` G), at most `--max-completion-length`
    new tokens, multinomial sampling at `--temperature` (top-k 0, top-p 1) with a KV cache, in
    float32;
  - the task's reward function (`task.reward`), group-normalized advantages (scale "group");
  - forward + backward passes scoring the B * G completions, loss_type `--loss-type`, beta = 0
    (no reference model), epsilon 0.2, num_iterations 1 (so neither computes old log-probs); TRL in
    one pass over the batch padded to its longest completion, minirl in micro-batches of similar
    length (`--max-tokens-per-microbatch`, its default unless given; 0: one padded pass, like TRL),
    with the same loss and gradient;
  - one AdamW step (learning rate `--learning-rate`, constant, no weight decay, gradient-norm
    clip 1.0).
TRL's defaults for large models are switched off so that both compute the same thing at the same
precision:
bf16=False (TRL autocasts to bf16 by default, even on a CPU), gradient_checkpointing=False
(TRL checkpoints by default, which re-runs the forward pass in backward). Its other defaults
stay (logging every 10 steps, no completion logging, its optimizer choice).

How it is timed. The two run interleaved in one process and one thread: TRL's `train()` runs
in the main thread and a TrainerCallback runs one minirl step beside each TRL step, before TRL's
clock starts (on_step_begin) in even pairs and after it stops (on_step_end) in odd ones: minirl,
TRL, TRL, minirl, minirl, TRL, ..., so that a change in the machine's load hits both alike, and
neither side always runs first (on a warm or cooling machine, or after the other side's memory
traffic); one pool of torch intra-op threads serves both (an earlier version ran TRL in a
second Python thread; each thread then had its own pool, and both sides' steps took about a
fifth longer with 2 torch threads). TRL's step is the
wall clock from on_step_begin to on_step_end (generation happens inside the step, in
`_prepare_inputs`; the work between steps, logging and fetching the next prompts, is not
counted). minirl's step is the wall clock around the loop's own `stage1_step` (prompt sampling,
generate, reward, advantages, update and the weight sync; no evaluation). `--only minirl|trl`
runs one side alone (for profiling).

Where the difference comes from (notebook 01, section 10, measures each part):
  - Almost the whole step is the arithmetic of the same HF model, on both sides. minirl does
    less of it, with the same results: each prompt's G completions share the prompt, so
    minirl computes it once per group, twice over:
      * generation (`SharedPrefixEngine`): one prefill per prompt, its KV cache
        repeated G times, then a plain multinomial loop; TRL calls HF `generate` on the
        B * G repeated prompts;
      * the update (`completion_logprobs(..., num_generations=G)`): one forward pass over the
        B prompts with a KV cache, repeated G times, then the completions; TRL runs forward and
        backward over all B * G full sequences.
  - With long-tailed completion lengths (the long workload) minirl's update computes about the
    real tokens: its micro-batches are padded to their own longest completion, not the batch's,
    and share one prompt pass (`PromptCache`); TRL's forward and backward cover B * G rows times
    the longest completion.
    Log-probs and gradients agree with the one-pass computation to float32 rounding
    (tests/test_logprobs.py, tests/test_trl_parity.py); the sampled distribution is the same.
  - TRL wraps everything in `accelerate` (device placement, gather calls on one process),
    computes and logs metrics (entropy, clip ratios, completion lengths, reward statistics)
    with `.item()` synchronizations, turns completions into Python lists and pads them again,
    and profiles stages with `profiling_context`: a few percent of a step.
  - minirl keeps a separate rollout copy of the policy and copies the weights into it after
    every update (`sync_weights`, a real cost TRL does not pay, since TRL samples with the
    training model), records the sampled tokens' log-probs (behaviour log-probs), which TRL
    does not, and computes the entropy with a full softmax over the vocabulary (for its metrics).

The long workload (`--workload long`). Sharing the prompt saves less as completions grow longer
than prompts, so this workload asks what generation itself costs: the long-tail policy of
notebook 05 (a Qwen2 of 7.6 M parameters with random weights, whose completion lengths have a
long tail: median ~30 tokens, a few at the cap), 8 few-shot arithmetic prompts of ~70 tokens per
step (`--prompts-per-step`), G = 8, at most 256 new tokens, 1 warm-up + 8 measured pairs. One
step's time follows its longest completion, which is drawn afresh at every step (TRL's whole step
waits for it), so the per-pair ratio moves by a factor of about 2 between pairs: read the median
with its min and max, never one pair. minirl
generates with the paged engine (`rollout_engine="paged"`: continuous batching drops each
completion at its EOS, the prefix cache prefills each prompt's full blocks once); TRL with HF
generate over the 64 rows until the longest ends. Everything else is as above (the task's reward
on the last sum of each prompt: the random policy earns ~0, so advantages are ~0, but both
sides still run the whole forward and backward pass). The default workload is unchanged.

Threads. With torch's default (2 threads on a 2-core machine) TRL's large matrix products gain
more from the second core than minirl's smaller ones (a prompt pass over B rows, decoding steps
of one token), so the ratio is lower than with `--threads 1`; compare like with like, and
compare medians of paired ratios, never single steps. The machine's load average before and after is printed
and stored; on a shared machine other processes' load still moves both sides' times.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback

from minirl.runtime import model_loading
from minirl.runtime.cli import common_parser, seed_everything, write_summary
from minirl.runtime.prefix_sharing import MicroBatchedLogprobs
from minirl.runtime.workloads import few_shot_rows, load_long_tail_policy
from minirl.tasks.arithmetic import make_task

MIN_PAIRS = 8      # the defaults measure at least this many pairs: a ratio is reported with its spread
LONG = {"steps": MIN_PAIRS, "warmup": 1, "prompts_per_step": 8, "max_completion_length": 256}   # --workload long


def parse_args(argv=None):
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("default", "long"), default="default",
                        help="default: the embedded policy, <= 4 new tokens; long: the long-tail policy, ~70-token "
                             "prompts, <= 256 new tokens, minirl with the paged engine (see the docstring)")
    parser.add_argument("--steps", type=int, default=None, help="measured pairs of steps (default 20; long: 8)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps per trainer, before (3; long: 1)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 4 measured steps (a notebook cell)")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="default 16; long: 8")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="default: the task's longest answer + EOS; long: 256")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                        help="minirl's update micro-batches (default: the config's; 0: one pass padded to the longest)")
    parser.add_argument("--only", choices=("minirl", "trl"), default=None, help="run one side only (profiling)")
    args = parser.parse_args(argv)
    defaults = LONG if args.workload == "long" else {"steps": 20, "warmup": 3, "prompts_per_step": 16}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.steps, args.warmup = (1, 1) if args.workload == "long" else (4, 1)
    for name in ("steps", "prompts_per_step"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}: must be >= 0")
    if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < 0:
        parser.error(f"--max-tokens-per-microbatch={args.max_tokens_per_microbatch}: must be >= 0 (0: one padded pass)")
    if args.num_generations < 2:
        parser.error(f"--num-generations={args.num_generations}: GRPO needs >= 2 completions per prompt")
    return args


def load_policy(args):
    """A fresh copy of the embedded warm-started policy (long workload: the long-tail policy), or of --model."""
    if args.model is None and args.workload == "long":
        model, tokenizer, _ = load_long_tail_policy(device=args.device)
        return model, tokenizer
    return model_loading.load_policy(args.model, args.device, progress=False)


def prompt_pool(task, n: int, seed: int, workload: str = "default") -> list[dict]:
    """n training rows {"prompt", "answer"}, drawn once: every step of both trainers uses exactly these."""
    if workload == "long":
        return few_shot_rows(n, length=64, seed=seed)
    rows = task.rows("train")
    picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [rows[i] for i in picks]


MINIRL_RECORDS: list[dict] = []    # each minirl step's record (time/generate, time/update, ...), warm-up included
UPDATE_TOKENS: list[dict] = []     # each minirl update's completion tokens: real, padded to the longest, computed


def count_update_tokens(actor):
    """Wrap `actor.update` so that each call appends the completion tokens its batch has and costs to UPDATE_TOKENS.

    real: the mask's sum; padded: rows x the longest completion (one pass over the padded batch, as
    TRL computes it); computed: what minirl's micro-batches compute (rows x each one's own width).
    """
    update = actor.update

    def counted(exp):
        ro = exp.rollout
        scorer = MicroBatchedLogprobs(actor.model, ro, actor.micro_batches(ro))
        UPDATE_TOKENS.append({"real": int(ro.completion_mask.sum()), "padded": ro.completion_mask.numel(),
                              "computed": scorer.tokens(), "micro_batches": len(scorer)})
        return update(exp)

    actor.update = counted


def minirl_stepper(args, task, rows, max_completion_length: int):
    """A function that runs one minirl GRPO step (the loop's own `stage1_step`) and returns its seconds.

    The step's record (with the loop's own per-stage seconds) is appended to MINIRL_RECORDS.
    """
    from minirl.config import RLConfig
    from minirl.train.run import setup, stage1_step

    model, tokenizer = load_policy(args)
    config = RLConfig.from_flat(steps=args.warmup + args.steps, prompts_per_step=len(rows),
                                num_generations=args.num_generations, max_completion_length=max_completion_length,
                                temperature=args.temperature, learning_rate=args.learning_rate, beta=0.0,
                                loss_type=args.loss_type, num_iterations=1, eval_every=0, seed=args.seed,
                                device=args.device,
                                rollout_engine="paged" if args.workload == "long" else "shared_prefix")
    if args.max_tokens_per_microbatch is not None:
        config = config.replace(max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    state = setup(config, model, tokenizer, rows, [task.reward])
    count_update_tokens(state.roles.actor)

    def step() -> float:
        t0 = time.perf_counter()
        MINIRL_RECORDS.append(stage1_step(state))
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
    """A TrainerCallback that times each TRL step and runs `beside` (a minirl step) next to it.

    Step i (0-based): for even i, on_step_begin runs `beside` and then takes the clock; for odd i,
    on_step_end takes the clock and then runs `beside`. So the order alternates (minirl first,
    then TRL first), and both trainers run in one thread (TRL's), never at the same time.
    """

    def __init__(self, beside=None):
        self.beside = beside
        self.begin, self.end = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.beside is not None and len(self.begin) % 2 == 0:
            self.beside()
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.perf_counter())
        if self.beside is not None and len(self.end) % 2 == 0:           # the step just timed was odd
            self.beside()

    def seconds(self) -> list[float]:
        return [e - b for b, e in zip(self.begin, self.end, strict=True)]


def run_interleaved(args, task, rows, max_len) -> tuple[list[float], list[float]]:
    """Pairs of steps, minirl first then TRL first in turn: a change in the machine's load hits both alike.

    TRL's `train()` runs in this thread; its callback runs one minirl step beside each TRL step
    (a single thread, so one pool of torch intra-op threads serves both; two Python threads
    would each bring their own and slow each other down). Returns (minirl seconds, TRL seconds)
    per step, warm-up included: element i of each is pair i.
    """
    total = args.warmup + args.steps
    step_minirl = minirl_stepper(args, task, rows, max_len)
    minirl_seconds = []
    timer = TRLSteps(beside=lambda: minirl_seconds.append(step_minirl()))
    trl_trainer(args, task, rows, max_len, timer).train()
    if len(timer.end) != total or len(minirl_seconds) != total:
        raise RuntimeError(f"expected {total} steps of each trainer, got {len(minirl_seconds)} minirl and "
                           f"{len(timer.end)} TRL steps")
    return minirl_seconds, timer.seconds()


def state_budget(args) -> int:
    """The micro-batch budget minirl ran with: --max-tokens-per-microbatch, or the config's default."""
    from minirl.config import OptimizerConfig

    given = args.max_tokens_per_microbatch
    return OptimizerConfig().max_tokens_per_microbatch if given is None else given


def paired_ratio(numerators: list[float], denominators: list[float]) -> dict:
    """The median of the per-pair ratios numerators[i] / denominators[i], with their min, max and count."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "ratios": ratios}


def spread_line(name: str, r: dict) -> str:
    """`name: X (min A, max B, n N)`: a paired ratio with its spread (the benchmarks' last-line format)."""
    return f"{name}: {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}, n {r['n']})"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    seed_everything(args.seed)
    task = make_task()
    rows = prompt_pool(task, args.prompts_per_step, args.seed, args.workload)
    max_len = args.max_completion_length or task.config.max_answer_length + 1
    load_before = os.getloadavg()
    print(f"workload {args.workload}: B={len(rows)} prompts x G={args.num_generations} completions, "
          f"<= {max_len} new tokens, "
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
        timer = TRLSteps()
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
    measured = MINIRL_RECORDS[args.warmup:]
    if measured:                               # where minirl's step goes, by the loop's own stage clocks
        stages = {k: statistics.median(r[k] for r in measured) for k in measured[0]
                  if k.startswith("time/") and k != "time/step"}
        summary["minirl_stage_median_seconds"] = stages
        print("minirl stages (median s/step): " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in stages.items()
                                                           if v >= 0.0005), flush=True)
        tokens = {k: statistics.median(t[k] for t in UPDATE_TOKENS[args.warmup:]) for k in UPDATE_TOKENS[0]}
        summary["minirl_update_tokens_median"] = tokens
        print(f"minirl generate {stages.get('time/generate', math.nan):.3f} s/step, update "
              f"{stages.get('time/update', math.nan):.3f} s/step; update's completion tokens per step (median): "
              f"{tokens['real']:.0f} real, {tokens['padded']:.0f} padded to the longest (TRL's), "
              f"{tokens['computed']:.0f} computed in {tokens['micro_batches']:.0f} micro-batch(es) "
              f"(max_tokens_per_microbatch={state_budget(args)})", flush=True)
    summary["load_average_after"] = os.getloadavg()[0]
    if args.only is None:
        pairs = paired_ratio(summary["trl_seconds"], summary["minirl_seconds"])
        summary |= {"speedup_vs_trl": pairs["median"], "speedup_vs_trl_pairs": pairs}
        print(f"TRL / minirl seconds per pair: {', '.join(f'{r:.2f}' for r in pairs['ratios'])}; the ratio of the "
              f"medians {summary['trl_median_seconds'] / summary['minirl_median_seconds']:.2f}")
    write_summary(args.out, summary)
    print(f"load average after: {summary['load_average_after']:.2f}; summary: {Path(args.out) / 'summary.json'}")
    if args.only is None:
        print(spread_line("speedup_vs_trl", summary["speedup_vs_trl_pairs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
