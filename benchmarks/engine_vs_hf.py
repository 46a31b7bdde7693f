"""Tokens per second: the paged engine (notebook 05) against HF `generate` on the same model, in one process.

    python benchmarks/engine_vs_hf.py                     # both workloads (about 5-10 minutes on 2 cores)
    python benchmarks/engine_vs_hf.py --workload long     # the long-tail workload only
    python benchmarks/engine_vs_hf.py --quick             # tiny: one repeat of shortened workloads (CI smoke)
    python benchmarks/engine_vs_hf.py --threads 1 --out runs/bench-engine

The last line printed is `speedup_vs_hf: X`: the long-tail workload's tokens per second with the
paged engine over HF generate's (X > 1: the engine is faster).

The two workloads, each run by both engines on the same model, prompts, G, length limit and
sampling (multinomial at temperature 1, float32, no top-k/top-p):
  - grpo: the stage-1 GRPO batch. The embedded ~1 M-parameter policy, 16 arithmetic prompts of
    ~7 tokens, G = 8, at most 4 new tokens (the task's longest answer + EOS).
  - long: the long-tail batch. A randomly initialized Qwen2 of 7.6 M parameters with a
    70-character vocabulary (`minirl.rollout.engine.workloads`): near-uniform logits make every
    step emit EOS with a probability of about 1/50, so completion lengths are roughly geometric
    (median ~30, mean ~50, a few reach the 256-token cap): the long tail of an RL batch, produced
    by the model itself. 16 few-shot arithmetic prompts of ~62 tokens, G = 8, at most 256 new
    tokens.
HF: `HFEngine` (model.generate over the B*G repeated, left-padded prompts, with its KV cache).
Paged: `PagedEngine` with 16-token blocks (4 for the embedded policy, whose prompts are shorter
than 16 tokens), the hash prefix cache, continuous batching, all B*G sequences in one batch. Its
prefix cache is emptied before every call (`reset()`), as a weight update would: no call profits
from the previous one's blocks.

How it is timed: one unmeasured call each, then paged call, HF call, paged call, ...
(`--repeats` each), in one thread of Python; the engines' sampled completions differ (different
random streams), so the figure compared is generated tokens (up to and including EOS) per
second. The speedup is the median over repeats of the ratio within a repeat: the two calls of a
repeat run back to back and see about the same load from other processes on the machine.

Where the engine's advantage comes from (printed per workload): HF computes every one of the
B*G rows at every step until the longest completion ends (rows that emitted EOS are computed
as padding), and prefills each prompt G times; the engine drops a sequence the step it ends,
and prefills each prompt's full blocks once. The breakdown shows the token counts and the
engine's seconds per phase (schedule, prepare = building the step's index tensors, forward,
sample, postprocess).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from pathlib import Path

import torch

from minirl.config import SamplingConfig
from minirl.models.policy import load_default_policy
from minirl.rollout.engine.measure import versus_hf
from minirl.rollout.engine.workloads import few_shot_prompts, load_long_tail_policy
from minirl.tasks.arithmetic import make_task
from minirl.utils.io import write_summary
from minirl.utils.seeding import seed_everything


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("grpo", "long", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=None, help="calls per engine (default: grpo 15, long 5)")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of small workloads: 4 prompts (grpo), 2 prompts x G=4 x 32 tokens (long); "
                             "a smoke test, not a measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs") / "engine_vs_hf")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be >= 1")
    return args


def workloads(args) -> dict:
    """name -> (model, tokenizer, prompts, sampling, block size, repeats)."""
    out = {}
    if args.workload in ("grpo", "both"):
        model, tokenizer, _ = load_default_policy(progress=False)
        rows = make_task().rows("train")
        picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed))[:16].tolist()
        prompts = [rows[i]["prompt"] for i in picks][:4 if args.quick else 16]
        out["grpo"] = (model, tokenizer, prompts, SamplingConfig(num_generations=8, max_completion_length=4), 4,
                       1 if args.quick else args.repeats or 15)
    if args.workload in ("long", "both"):
        model, tokenizer, _ = load_long_tail_policy()
        prompts = few_shot_prompts(2 if args.quick else 16, length=64, seed=args.seed)
        sampling = SamplingConfig(num_generations=4 if args.quick else 8,
                                  max_completion_length=32 if args.quick else 256)
        out["long"] = (model, tokenizer, prompts, sampling, 16, 1 if args.quick else args.repeats or 5)
    return out


def report(name, r) -> None:
    print(f"\n{name}: {r['prompts']} prompts x G={r['num_generations']}, <= {r['max_completion_length']} new tokens, "
          f"{r['parameters'] / 1e6:.1f} M parameters, {r['repeats']} repeats (medians)")
    print(f"  {'engine':<6} | tokens/s | median s | tokens")
    for k in ("paged", "hf"):
        print(f"  {k:<6} | {r['tokens_per_s'][k]:8.1f} | {statistics.median(r['seconds'][k]):8.3f} | "
              f"{statistics.median(r['tokens'][k]):.0f}")
    c = r["paged_counts"]
    print(f"  speedup (tokens/s, paged / hf, median of the repeats' ratios): {r['speedup']:.2f} "
          f"(repeats: {', '.join(f'{x:.2f}' for x in r['speedups'])})")
    print(f"  work: hf prefills {r['hf_prefill_tokens']} prompt tokens and computes {r['hf_rows_x_steps']:.0f} "
          "row-steps "
          f"of decoding; paged prefills {c['prefill_tokens']:.0f} ({c['cached_tokens']:.0f} of "
          f"{c['prompt_tokens']:.0f} prompt tokens found in its cache) and decodes {c['decode_tokens']:.0f} tokens "
          f"in {c['steps']:.0f} steps")
    total = sum(r["paged_phase_seconds"].values())
    print("  paged engine, where the time goes: " + ", ".join(
        f"{p} {s:.3f} s ({100 * s / total:.0f} %)" for p, s in r["paged_phase_seconds"].items() if s > 0))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    seed_everything(args.seed)
    load_before = os.getloadavg()[0]
    print(f"{torch.get_num_threads()} torch threads, load average {load_before:.2f}", flush=True)
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "torch_threads": torch.get_num_threads(), "load_average_before": load_before}
    for name, (model, tokenizer, prompts, sampling, bs, repeats) in workloads(args).items():
        summary[name] = versus_hf(model, tokenizer, prompts, sampling, bs, repeats, args.seed,
                                  log=lambda line, name=name: print(f"  [{name}] {line}", flush=True))
        report(name, summary[name])
    summary["load_average_after"] = os.getloadavg()[0]
    if "long" in summary:
        summary["speedup_vs_hf"] = summary["long"]["speedup"]
    path = write_summary(args.out, summary)
    print(f"\nload average after: {summary['load_average_after']:.2f}; summary: {path}")
    if "long" in summary:
        print(f"speedup_vs_hf: {summary['speedup_vs_hf']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
