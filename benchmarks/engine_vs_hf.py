"""Tokens per second: the paged engine (notebook 05) against HF `generate` on the same model, in one process.

    python benchmarks/engine_vs_hf.py                     # all workloads, torch's default threads (~10 minutes)
    python benchmarks/engine_vs_hf.py --threads 1         # the same on one thread
    python benchmarks/engine_vs_hf.py --workload long     # the long-tail workload only
    python benchmarks/engine_vs_hf.py --quick             # tiny: one repeat of shortened workloads (CI smoke)

The last line printed is `speedup_vs_hf: X (min A, max B, n N)`: on the long-tail workload, the
median over N pairs of calls of the paged engine's tokens per second over HF generate's within
the pair, with the smallest and largest of those N ratios (X > 1: the engine is faster). Before
it come `machine_limits: matmul_gflops_1t G copy_gbps B` (this machine's limits at one thread,
below), `step_ratio_equal_rows: X` (HF's decode step over the engine's at the same rows),
`decode_roofline_share: X` (the engine's decode step against the machine's limits) and
`peak_rss_mb paged=A hf=B` (each engine's process running the long-tail workload once).

The three workloads, each run by both engines on the same model, prompts, G, length limit and
sampling (multinomial at temperature 1, float32, no top-k/top-p):
  - grpo: the stage-1 GRPO batch. The embedded ~1 M-parameter policy, 16 arithmetic prompts of
    ~7 tokens, G = 8, at most 4 new tokens (the task's longest answer + EOS).
  - long: the long-tail batch. A randomly initialized Qwen2 of 7.6 M parameters with a
    70-character vocabulary (`minirl.runtime.workloads`): near-uniform logits make every
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

How it is timed: one unmeasured call each, then `--repeats` pairs (at least 8 by default): a
pair is one call of each engine on the same batch, back to back, paged first in even pairs and
HF first in odd ones, in one thread of Python; the engines' sampled completions differ
(different random streams), so two figures are compared: generated tokens (up to and including
EOS) per second, and the time to finish the same batch. Each speedup is the median over pairs of
the ratio within a pair (the two calls of a pair see about the same load from other processes
on the machine), printed with its min and max.

The machine's limits (`minirl.runtime.engine_measure.machine_limits`, which notebook 05 uses too):
the float32 matrix-product peak (FLOP/s of 2048 x 2048 products) and the copy bandwidth (bytes/s of
copying 256 MiB, larger than the CPU's caches, with memcpy; read + written) are measured at one
thread by the process's CPU time (`time.process_time`: a process that waits for a core, or is
switched out, does not count that time), over trials of at least a second of work each, best of 3;
and at the run's threads by the wall clock, best of 3 trials of at least two seconds (the copy by
memcpy or torch's threaded copy_, the faster). Both are printed; every share below uses the one-
thread limits.

The decode step at equal rows (long-tail policy, 32 sequences, one new token each after 160
cached tokens): HF's step is the model's forward pass as `generate` calls it (one token per row,
a DynamicCache holding 160 tokens, the attention mask), the engine's is one `PagedModel`
forward pass over the same rows (the step's tensors built beforehand, as the engine's "prepare"
phase does). Both run at one thread, in pairs (the order alternating), timed by CPU time; each
side's turn runs 8 steps back to back, as generation does (a step run alone right after the other
side's finds the caches full of the other side's weights: slower than any step of the engine's
generation); step_ratio_equal_rows is the median over pairs of HF's step over the engine's.

The roofline: the engine's step (median CPU time over the pairs above) beside its ideal time,
max(bytes / bandwidth, FLOPs / peak) at the one-thread limits, counted from the model's shape
(every weight and every cached key and value read once; 2 FLOPs per weight per row plus
attention); decode_roofline_share = ideal / measured. Then the step is profiled at one thread and
its time split into matrix products, attention, cache writes and everything else, each beside its
own ideal, with the share the step would reach were everything else free (its bound).

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
import inspect
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from minirl.config import SamplingConfig
from minirl.models.policy import load_default_policy
from minirl.rollout.engine.engine import PagedEngine
from minirl.rollout.hf import HFEngine
from minirl.runtime.engine_measure import decode_step_breakdown, decode_step_work, machine_limits, probe_step
from minirl.runtime.io import write_summary
from minirl.runtime.seeding import seed_everything
from minirl.runtime.workloads import few_shot_prompts, load_long_tail_policy
from minirl.tasks.arithmetic import make_task

WORKLOADS = ("grpo", "long", "uniform")
MIN_PAIRS = 8        # the defaults time at least this many pairs: a ratio is reported with its spread
ROWS, CONTEXT = 32, 160   # the decode step at equal rows, and the roofline's
BURST = 8                 # decode steps back to back in each side's turn of a pair


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=None,
                        help="pairs of calls, one per engine (default: grpo 15, long and uniform 8)")
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
                         1 if args.quick else args.repeats or MIN_PAIRS)
    return out


def paired_ratio(numerators: list[float], denominators: list[float]) -> dict:
    """The median of the per-pair ratios numerators[i] / denominators[i], with their min, max and count."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "ratios": ratios}


def spread_line(name: str, r: dict) -> str:
    """`name: X (min A, max B, n N)`: a paired ratio with its spread (the benchmarks' last-line format)."""
    return f"{name}: {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}, n {r['n']})"


def versus_hf(model, tokenizer, prompts: list[str], sampling: SamplingConfig, block_size: int, pairs: int,
              seed: int = 0, log=None, kv_cache_bytes: int | None = None) -> dict:
    """The paged engine against HF generate (`HFEngine`) on the same model, prompts, G and length limit, in pairs.

    One unmeasured call each first, then `pairs` pairs: pair r calls both engines on the same
    batch back to back, the paged engine first when r is even and HF first when r is odd, with
    the seed seed + r. The paged engine's cache is emptied before every call (as a weight update
    would). Compared: generated tokens (up to and including EOS) per second, `speedup` the median
    over pairs of the ratio within a pair, and the time to finish the batch, `finish_speedup`
    likewise (each with its spread). Also the engine's median seconds per phase and token counts,
    and HF's work: prompt tokens prefilled and rows x steps decoded.
    """
    engines = {"paged": PagedEngine(model, tokenizer, block_size=block_size, kv_cache_bytes=kv_cache_bytes),
               "hf": HFEngine(model, tokenizer)}
    for engine in engines.values():
        engine.generate(prompts[:1], sampling, generator=torch.Generator().manual_seed(seed))
    seconds, tokens = {k: [] for k in engines}, {k: [] for k in engines}
    phases, counts, hf_rows = [], [], []
    for r in range(pairs):
        for kind in ("paged", "hf") if r % 2 == 0 else ("hf", "paged"):
            engine = engines[kind]
            if kind == "paged":
                engine.reset()
            start = time.perf_counter()
            rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed + r))
            seconds[kind].append(time.perf_counter() - start)
            tokens[kind].append(int(rollout.completion_mask.sum()))
            if kind == "paged":
                phases.append(dict(engine.stats.seconds))
                counts.append({k: getattr(engine.stats, k) for k in ("prompt_tokens", "cached_tokens", "prefill_tokens",
                                                                      "decode_tokens", "steps")})
            else:
                hf_rows.append(rollout.completion_ids.numel())            # B*G rows x the longest completion
        if log is not None:
            log(f"pair {r + 1}/{pairs} ({'paged' if r % 2 == 0 else 'hf'} first): paged {seconds['paged'][-1]:.2f} s "
                f"({tokens['paged'][-1]} tokens), hf {seconds['hf'][-1]:.2f} s ({tokens['hf'][-1]} tokens)")
    rates = {k: [t / s for t, s in zip(tokens[k], seconds[k], strict=True)] for k in engines}
    speedup = paired_ratio(rates["paged"], rates["hf"])
    finish = paired_ratio(seconds["hf"], seconds["paged"])
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    return {"prompts": len(prompts), "num_generations": sampling.num_generations,
            "max_completion_length": sampling.max_completion_length, "block_size": block_size, "pairs": pairs,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "speedup": speedup["median"], "speedups": speedup["ratios"], "speedup_pairs": speedup,
            "finish_speedup": finish["median"], "finish_speedups": finish["ratios"], "finish_pairs": finish,
            "paged_phase_seconds": {p: statistics.median(x[p] for x in phases) for p in phases[0]},
            "paged_counts": {c: statistics.median(x[c] for x in counts) for c in counts[0]},
            "hf_prefill_tokens": prompt_tokens * sampling.num_generations,
            "hf_rows_x_steps": statistics.median(hf_rows)}


def hf_decode_step(model, rows: int, context: int):
    """A function running one HF decode forward pass as `generate` runs it: `rows` sequences of one new token
    after `context` cached ones (a DynamicCache, the attention mask over context + 1 positions). The cache is
    cut back to `context` after each call, so every call does the same work."""
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:                                                  # transformers < 4.56
        cache = DynamicCache()
    mask = torch.ones(rows, context + 1, dtype=torch.long)
    token = torch.full((rows, 1), 3, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=torch.full((rows, context), 3, dtype=torch.long), attention_mask=mask[:, :context],
              use_cache=True, **{kwarg: cache})

    def step():
        with torch.no_grad():
            model(input_ids=token, attention_mask=mask, use_cache=True, return_dict=True, **{kwarg: cache})
        cache.crop(-1)                                                 # back to `context` tokens

    step()
    return step


def decode_steps(model, pairs: int, rows: int = ROWS, context: int = CONTEXT, burst: int = BURST) -> dict:
    """HF's decode step and the engine's at equal rows, at one thread, timed by CPU time in `pairs` pairs
    (the engine first in even pairs, HF first in odd ones). Each side's turn runs `burst` steps back to
    back, as generation does, and counts their CPU time / burst: a step run alone right after the other
    side's is slower than any the engine runs while generating (the other side's weights and cache have
    filled the CPU's caches; on the machine of benchmarks/README.md ~6.7 ms against 4.7 for the
    long-tail policy, recovering over 3-4 steps). `ratio`: HF's seconds over the engine's per pair."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        paged, step = probe_step(model, rows, 1, context)
        runs = {"paged": lambda: paged(step), "hf": hf_decode_step(model, rows, context)}
        seconds = {k: [] for k in runs}
        for r in range(pairs):
            for kind in ("paged", "hf") if r % 2 == 0 else ("hf", "paged"):
                start = time.process_time()
                for _ in range(burst):
                    runs[kind]()
                seconds[kind].append((time.process_time() - start) / burst)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "context": context, "burst": burst, "seconds": seconds,
            "ratio": paired_ratio(seconds["hf"], seconds["paged"]),
            "median_s": {k: statistics.median(v) for k, v in seconds.items()}}


def report(name, r) -> None:
    print(f"\n{name}: {r['prompts']} prompts x G={r['num_generations']}, <= {r['max_completion_length']} new tokens, "
          f"{r['parameters'] / 1e6:.1f} M parameters, {r['pairs']} pairs (medians)")
    print(f"  {'engine':<6} | tokens/s | s to finish the batch | tokens")
    for k in ("paged", "hf"):
        print(f"  {k:<6} | {r['tokens_per_s'][k]:8.1f} | {statistics.median(r['seconds'][k]):21.3f} | "
              f"{statistics.median(r['tokens'][k]):.0f}")
    c = r["paged_counts"]
    print(f"  speedup in tokens/s (paged / hf, median of the pairs' ratios): {r['speedup']:.2f} "
          f"(pairs: {', '.join(f'{x:.2f}' for x in r['speedups'])})")
    print(f"  speedup in time to finish the batch (hf s / paged s): {r['finish_speedup']:.2f} "
          f"(pairs: {', '.join(f'{x:.2f}' for x in r['finish_speedups'])})")
    print(f"  work: hf prefills {r['hf_prefill_tokens']} prompt tokens and computes {r['hf_rows_x_steps']:.0f} "
          "row-steps "
          f"of decoding; paged prefills {c['prefill_tokens']:.0f} ({c['cached_tokens']:.0f} of "
          f"{c['prompt_tokens']:.0f} prompt tokens found in its cache) and decodes {c['decode_tokens']:.0f} tokens "
          f"in {c['steps']:.0f} steps")
    total = sum(r["paged_phase_seconds"].values())
    print("  paged engine, where the time goes: " + ", ".join(
        f"{p} {s:.3f} s ({100 * s / total:.0f} %)" for p, s in r["paged_phase_seconds"].items() if s > 0))


def roofline(args) -> dict:
    """The machine's limits, the decode step at equal rows (HF against the engine) and the engine's step
    against the one-thread limits, with the profiler's breakdown (all at one thread but the wall-clock limits)."""
    model, _, _ = load_long_tail_policy()
    limits = machine_limits(trial=0.2 if args.quick else 1.0)
    print(f"\nmachine: float32 matrix products {limits['matmul_flops_1t'] / 1e9:.1f} GFLOP/s and copies "
          f"{limits['copy_bytes_1t'] / 1e9:.1f} GB/s at one thread (CPU time, best of 3 trials); "
          f"{limits['matmul_flops'] / 1e9:.1f} GFLOP/s and {limits['copy_bytes'] / 1e9:.1f} GB/s at "
          f"{limits['threads']} threads (wall clock, best of 3)")
    steps = decode_steps(model, pairs=4 if args.quick else 30)
    ratio, median = steps["ratio"], steps["median_s"]
    print(f"decode step at equal rows ({ROWS} rows x {CONTEXT} cached tokens, the long-tail policy, 1 thread, CPU "
          f"time, {ratio['n']} pairs of {steps['burst']} steps a side): hf {1e3 * median['hf']:.2f} ms, "
          f"paged {1e3 * median['paged']:.2f} ms; "
          f"hf / paged per pair: median {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    work = decode_step_work(model, ROWS, CONTEXT)
    peak, bandwidth = limits["matmul_flops_1t"], limits["copy_bytes_1t"]
    memory, compute = work["bytes"] / bandwidth, work["flops"] / peak
    ideal, measured = max(memory, compute), median["paged"]
    r = work | {"matmul_flops": peak, "copy_bytes": bandwidth, "threads": 1, "rows": ROWS, "context": CONTEXT,
                "memory_s": memory, "compute_s": compute, "ideal_s": ideal, "measured_s": measured,
                "share": ideal / measured, "bound": "compute" if compute >= memory else "memory"}
    print(f"roofline, the engine's decode step at one thread: {r['flops'] / 1e6:.0f} MFLOP -> "
          f"{1e3 * r['compute_s']:.2f} ms; {r['weight_bytes'] / 1e6:.1f} MB of weights + {r['kv_bytes'] / 1e6:.1f} MB "
          f"of keys/values -> {1e3 * r['memory_s']:.2f} ms")
    print(f"  ideal {1e3 * r['ideal_s']:.2f} ms ({r['bound']}-bound), measured {1e3 * r['measured_s']:.2f} ms "
          f"(median CPU time): share {r['share']:.2f}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = decode_step_breakdown(model, r, repeats=1 if args.quick else 3)
    finally:
        torch.set_num_threads(threads)
    print("  where the measured step goes (profiler): " + "; ".join(
        f"{kind} {1e3 * k['seconds']:.2f} ms" + ("" if k["ideal_s"] is None else f" (ideal {1e3 * k['ideal_s']:.2f})")
        for kind, k in parts["kinds"].items()))
    print(f"  with nothing but the products and attention as they run here, the share would be {parts['bound']:.2f}")
    return r | {"breakdown": parts, "limits": limits, "steps": steps}


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
    for name, (model, tokenizer, prompts, sampling, bs, pairs) in workloads(args).items():
        summary[name] = versus_hf(model, tokenizer, prompts, sampling, bs, pairs, args.seed,
                                  log=lambda line, name=name: print(f"  [{name}] {line}", flush=True),
                                  kv_cache_bytes=kv_bytes(args))
        report(name, summary[name])
    summary["roofline"] = roofline(args)
    summary["machine_limits"] = summary["roofline"]["limits"]
    summary["step_ratio_equal_rows"] = summary["roofline"]["steps"]["ratio"]["median"]
    summary["decode_roofline_share"] = summary["roofline"]["share"]
    if not args.no_memory:
        summary["peak_rss_mb"] = peak_rss(args)
    summary["load_average_after"] = os.getloadavg()[0]
    if "long" in summary:
        summary["speedup_vs_hf"] = summary["long"]["speedup"]
    path = write_summary(args.out, summary)
    print(f"\nload average after: {summary['load_average_after']:.2f}; summary: {path}")
    limits = summary["machine_limits"]
    print(f"machine_limits: matmul_gflops_1t {limits['matmul_flops_1t'] / 1e9:.1f} "
          f"copy_gbps {limits['copy_bytes_1t'] / 1e9:.1f}")
    print(f"step_ratio_equal_rows: {summary['step_ratio_equal_rows']:.2f}")
    print(f"decode_roofline_share: {summary['decode_roofline_share']:.2f}")
    if "peak_rss_mb" in summary:
        print(f"peak_rss_mb paged={summary['peak_rss_mb']['paged']:.0f} hf={summary['peak_rss_mb']['hf']:.0f}")
    if "long" in summary:
        print(spread_line("speedup_vs_hf", summary["long"]["speedup_pairs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
