"""Tokens per second: the paged engine (notebook 05) against HF `generate` on the same model, in one process.

    python benchmarks/engine_vs_hf.py                     # all workloads, torch's default threads (~10 minutes)
    python benchmarks/engine_vs_hf.py --threads 1         # the same on one thread
    python benchmarks/engine_vs_hf.py --workload long     # the long-tail workload only
    python benchmarks/engine_vs_hf.py --quick             # tiny: one repeat of shortened workloads (CI smoke)

The last line printed is `speedup_vs_hf: X`: the long-tail workload's tokens per second with the
paged engine over HF generate's (X > 1: the engine is faster). Before it come
`decode_roofline_share: X` (one decode step against this machine's limits, below) and
`peak_rss_mb paged=A hf=B` (each engine's process running the long-tail workload once).

The three workloads, each run by both engines on the same model, prompts, G, length limit and
sampling (multinomial at temperature 1, float32, no top-k/top-p):
  - grpo: the stage-1 GRPO batch. The embedded ~1 M-parameter policy, 16 arithmetic prompts of
    ~7 tokens, G = 8, at most 4 new tokens (the task's longest answer + EOS).
  - long: the long-tail batch. A randomly initialized Qwen2 of 7.6 M parameters with a
    70-character vocabulary (`minirl.rollout.engine.workloads`): near-uniform logits make every
    step emit EOS with a probability of about 1/50, so completion lengths are roughly geometric
    (median ~30, mean ~50, a few reach the 256-token cap): the long tail of an RL batch, produced
    by the model itself. 16 few-shot arithmetic prompts of ~62 tokens, G = 8, at most 256 new
    tokens.
  - uniform: the long workload with no completion ending early: both engines get a tokenizer
    whose end-of-sequence token is one the model cannot emit (an id past its vocabulary), so
    every completion runs to the cap, as vLLM's throughput benchmark does with ignore_eos.
    Nothing is dropped early; what remains is the prefix saving and the cost of a step.
HF: `HFEngine` (model.generate over the B*G repeated, left-padded prompts, with its KV cache).
Paged: `PagedEngine` with 16-token blocks (4 for the embedded policy, whose prompts are shorter
than 16 tokens), the hash prefix cache, continuous batching, all B*G sequences in one batch, its
KV cache sized to the work (rows x longest sequence). Its prefix cache is emptied before every
call (`reset()`), as a weight update would: no call profits from the previous one's blocks.

How it is timed: one unmeasured call each, then paged call, HF call, paged call, ...
(`--repeats` each), in one thread of Python; the engines' sampled completions differ (different
random streams), so two figures are compared: generated tokens (up to and including EOS) per
second, and the time to finish the same batch. Each speedup is the median over repeats of the
ratio within a repeat: the two calls of a repeat run back to back and see about the same load
from other processes on the machine.

The roofline (long-tail policy, one decode step of 32 sequences after 160 tokens each): the
machine's float32 matrix-product peak (FLOP/s of a 2048 x 2048 product) and copy bandwidth
(bytes/s of a 256 MiB copy) are measured at the run's threads (best of 5); the step's ideal
time is max(bytes / bandwidth, FLOPs / peak), counted from the model's shape (every weight and
every cached key and value read once; 2 FLOPs per weight per row plus attention), printed
beside the measured step (median of 15); decode_roofline_share = ideal / measured. Then the
step is profiled and its time split into matrix products, attention, cache writes and everything
else, each beside its own ideal, with the share the step would reach were everything else free.

Peak memory: each engine runs the long-tail workload once in a fresh process of its own
(this script with `--rss-of`), and reports its peak resident set size (VmHWM on Linux): the same
model load and imports on both sides, plus the engine's copy of the model and its KV cache.

Where the engine's advantage comes from (printed per workload): HF computes every one of the
B*G rows at every step until the longest completion ends (rows that emitted EOS are computed
as padding), and prefills each prompt G times; the engine drops a sequence the step it ends,
and prefills each prompt's full blocks once. The breakdown shows the token counts and the
engine's seconds per phase (schedule, prepare = building the step's index tensors, forward,
sample, postprocess).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from minirl.config import SamplingConfig
from minirl.models.policy import load_default_policy
from minirl.rollout.engine.engine import PagedEngine
from minirl.rollout.engine.measure import decode_roofline, decode_step_breakdown, machine_limits, versus_hf
from minirl.rollout.engine.workloads import few_shot_prompts, load_long_tail_policy
from minirl.rollout.hf import HFEngine
from minirl.tasks.arithmetic import make_task
from minirl.utils.io import write_summary
from minirl.utils.seeding import seed_everything

WORKLOADS = ("grpo", "long", "uniform")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=None,
                        help="calls per engine (default: grpo 15, long and uniform 5)")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of small workloads: 4 prompts (grpo), 2 prompts x G=4 x 32 tokens (long, "
                             "uniform), a short roofline; a smoke test, not a measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mb", type=float, default=None,
                        help="the paged engine's KV cache budget in MiB (default: sized to the work, rows x longest)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--out", type=Path, default=Path("runs") / "engine_vs_hf")
    parser.add_argument("--rss-of", choices=("paged", "hf"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be >= 1")
    if args.kv_cache_mb is not None and args.kv_cache_mb <= 0:
        parser.error(f"--kv-cache-mb={args.kv_cache_mb}: must be > 0 (leave it out to size the cache to the work)")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads}: must be >= 1 (leave it out for torch's default)")
    return args


def never_ending(tokenizer):
    """A copy of `tokenizer` whose end-of-sequence token is a new id, one past the model's vocabulary."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"eos_token": "<never-sampled>"})
    return tokenizer


def workloads(args) -> dict:
    """name -> (model, tokenizer, prompts, sampling, block size, repeats)."""
    names = WORKLOADS if args.workload == "all" else (args.workload,)
    out = {}
    if "grpo" in names:
        model, tokenizer, _ = load_default_policy(progress=False)
        rows = make_task().rows("train")
        picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed))[:16].tolist()
        prompts = [rows[i]["prompt"] for i in picks][:4 if args.quick else 16]
        out["grpo"] = (model, tokenizer, prompts, SamplingConfig(num_generations=8, max_completion_length=4), 4,
                       1 if args.quick else args.repeats or 15)
    for name in ("long", "uniform"):
        if name in names:
            model, tokenizer, _ = load_long_tail_policy()
            prompts = few_shot_prompts(2 if args.quick else 16, length=64, seed=args.seed)
            sampling = SamplingConfig(num_generations=4 if args.quick else 8,
                                      max_completion_length=32 if args.quick else 256)
            out[name] = (model, tokenizer if name == "long" else never_ending(tokenizer), prompts, sampling, 16,
                         1 if args.quick else args.repeats or 5)
    return out


def report(name, r) -> None:
    print(f"\n{name}: {r['prompts']} prompts x G={r['num_generations']}, <= {r['max_completion_length']} new tokens, "
          f"{r['parameters'] / 1e6:.1f} M parameters, {r['repeats']} repeats (medians)")
    print(f"  {'engine':<6} | tokens/s | s to finish the batch | tokens")
    for k in ("paged", "hf"):
        print(f"  {k:<6} | {r['tokens_per_s'][k]:8.1f} | {statistics.median(r['seconds'][k]):21.3f} | "
              f"{statistics.median(r['tokens'][k]):.0f}")
    c = r["paged_counts"]
    print(f"  speedup in tokens/s (paged / hf, median of the repeats' ratios): {r['speedup']:.2f} "
          f"(repeats: {', '.join(f'{x:.2f}' for x in r['speedups'])})")
    print(f"  speedup in time to finish the batch (hf s / paged s): {r['finish_speedup']:.2f} "
          f"(repeats: {', '.join(f'{x:.2f}' for x in r['finish_speedups'])})")
    print(f"  work: hf prefills {r['hf_prefill_tokens']} prompt tokens and computes {r['hf_rows_x_steps']:.0f} "
          "row-steps "
          f"of decoding; paged prefills {c['prefill_tokens']:.0f} ({c['cached_tokens']:.0f} of "
          f"{c['prompt_tokens']:.0f} prompt tokens found in its cache) and decodes {c['decode_tokens']:.0f} tokens "
          f"in {c['steps']:.0f} steps")
    total = sum(r["paged_phase_seconds"].values())
    print("  paged engine, where the time goes: " + ", ".join(
        f"{p} {s:.3f} s ({100 * s / total:.0f} %)" for p, s in r["paged_phase_seconds"].items() if s > 0))


def roofline(args) -> dict:
    model, _, _ = load_long_tail_policy()
    limits = machine_limits(repeats=2 if args.quick else 5, copy_mib=64 if args.quick else 256)
    r = decode_roofline(model, rows=32, context=160, limits=limits, repeats=3 if args.quick else 15)
    print(f"\nroofline, one decode step of the long-tail policy (32 rows x 160 cached tokens), {r['threads']} threads:")
    print(f"  machine: float32 matrix products {r['matmul_flops'] / 1e9:.1f} GFLOP/s, "
          f"copies {r['copy_bytes'] / 1e9:.1f} GB/s (best of repeats)")
    print(f"  step: {r['flops'] / 1e6:.0f} MFLOP -> {1e3 * r['compute_s']:.2f} ms; {r['weight_bytes'] / 1e6:.1f} MB of "
          f"weights + {r['kv_bytes'] / 1e6:.1f} MB of keys/values -> {1e3 * r['memory_s']:.2f} ms")
    print(f"  ideal {1e3 * r['ideal_s']:.2f} ms ({r['bound']}-bound), measured {1e3 * r['measured_s']:.2f} ms (median)")
    parts = decode_step_breakdown(model, r, repeats=1 if args.quick else 3)
    print("  where the measured step goes (profiler): " + "; ".join(
        f"{kind} {1e3 * k['seconds']:.2f} ms" + ("" if k["ideal_s"] is None else f" (ideal {1e3 * k['ideal_s']:.2f})")
        for kind, k in parts["kinds"].items()))
    print(f"  with nothing but the products and attention as they run here, the share would be {parts['bound']:.2f}")
    return r | {"breakdown": parts}


def kv_bytes(args) -> int | None:
    return None if args.kv_cache_mb is None else int(args.kv_cache_mb * 2**20)


def rss_child(args) -> int:
    """The --rss-of process: one call of one engine on the long-tail workload; prints its peak RSS."""
    model, tokenizer, prompts, sampling, block_size, _ = workloads(args)["long"]
    if args.rss_of == "paged":
        engine = PagedEngine(model, tokenizer, block_size=block_size, kv_cache_bytes=kv_bytes(args))
    else:
        engine = HFEngine(model, tokenizer)
    engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(args.seed))
    print(f"rss_mb {peak_rss_mb():.1f}")
    return 0


def peak_rss_mb() -> float:
    """This process's peak resident set size. Linux: VmHWM, which starts afresh at exec (ru_maxrss would
    also count the memory of the parent this process was forked from); elsewhere ru_maxrss."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    scale = 2**20 if sys.platform == "darwin" else 2**10           # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def peak_rss(args) -> dict:
    """Each engine's peak RSS (MB) running the long-tail workload once, each in a fresh process."""
    out = {}
    for kind in ("paged", "hf"):
        cmd = [sys.executable, __file__, "--rss-of", kind, "--seed", str(args.seed)]
        cmd += (["--threads", str(args.threads)] if args.threads else []) + (["--quick"] if args.quick else [])
        cmd += ["--kv-cache-mb", str(args.kv_cache_mb)] if args.kv_cache_mb else []
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("rss_mb ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"peak RSS of {kind}: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        out[kind] = float(lines[-1].split()[1])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    seed_everything(args.seed)
    if args.rss_of:
        return rss_child(args)
    load_before = os.getloadavg()[0]
    print(f"{torch.get_num_threads()} torch threads, load average {load_before:.2f}", flush=True)
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "torch_threads": torch.get_num_threads(), "load_average_before": load_before}
    for name, (model, tokenizer, prompts, sampling, bs, repeats) in workloads(args).items():
        summary[name] = versus_hf(model, tokenizer, prompts, sampling, bs, repeats, args.seed,
                                  log=lambda line, name=name: print(f"  [{name}] {line}", flush=True),
                                  kv_cache_bytes=kv_bytes(args))
        report(name, summary[name])
    summary["roofline"] = roofline(args)
    summary["decode_roofline_share"] = summary["roofline"]["share"]
    if not args.no_memory:
        summary["peak_rss_mb"] = peak_rss(args)
    summary["load_average_after"] = os.getloadavg()[0]
    if "long" in summary:
        summary["speedup_vs_hf"] = summary["long"]["speedup"]
    path = write_summary(args.out, summary)
    print(f"\nload average after: {summary['load_average_after']:.2f}; summary: {path}")
    print(f"decode_roofline_share: {summary['decode_roofline_share']:.2f}")
    if "peak_rss_mb" in summary:
        print(f"peak_rss_mb paged={summary['peak_rss_mb']['paged']:.0f} hf={summary['peak_rss_mb']['hf']:.0f}")
    if "long" in summary:
        print(f"speedup_vs_hf: {summary['speedup_vs_hf']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
