"""The measurements of notebook 05 and chapters/05, one function per row of the source's table.

Each function runs the paged engine on a workload it is given (any HF Llama/Qwen2-style model
and tokenizer) and returns a plain dict of figures: counted ones (KV slots, prefill tokens,
accepted drafts, cache hits) that do not depend on the machine, and timed ones (tokens per
second) whose alternatives run interleaved, `repeats` times each, compared by their medians.

Hand-written (a measurement harness: timing loops, paired ratios, the versus-HF comparison,
machine limits); notebook 05 calls it and prints the tables. Also its checks' helpers:
`hf_greedy` (what greedy decoding must reproduce), `looping_prompt` (a prompt the n-gram draft
can predict) and `bigram_speculation` (a chi-square test of an acceptance rule, with
`greedy_acceptance`, a plausible wrong rule it must catch).
"""


import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from minirl.config import SamplingConfig
from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.engine import PagedEngine
from minirl.rollout.hf import HFEngine
from minirl.runtime import paged_kernels as kernels
from minirl.runtime.engine_core import Request


def interleaved(runs: dict, repeats: int, progress: str | None = None) -> dict[str, list[float]]:
    """Seconds of each run (a no-argument function), in turn, `repeats` times: A, B, A, B, ...

    Each run is called once before, unmeasured: first calls pay one-time costs (allocation,
    kernel selection) that would otherwise land on whichever runs first. progress: the label
    of a tqdm bar over the calls (none without one).
    """
    bar = tqdm(total=len(runs) * (repeats + 1), desc=progress, disable=progress is None)
    for name, run in runs.items():
        run()
        bar.set_postfix_str(f"{name}: warm-up call", refresh=False)
        bar.update(1)
    seconds = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
            bar.set_postfix_str(f"{name}: {seconds[name][-1]:.2f} s", refresh=False)
            bar.update(1)
    bar.close()
    return seconds


def kv_utilization(model, tokenizer, prompts: list[str], sampling: SamplingConfig, block_size: int = 16,
                   seed: int = 0) -> dict:
    """KV slots filled / slots held, summed over the steps of one generate call, paged vs contiguous.

    Paged: the blocks the engine actually holds (no prefix cache, so that sharing does not
    flatter it). Contiguous: what preallocating prompt + max_tokens slots per running sequence
    would hold for the very same sequences at the very same steps.
    """
    engine = PagedEngine(model, tokenizer, block_size=block_size, cache="none")
    rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
    timeline = engine.scheduler.timeline
    held = sum(row["held"] for row in timeline)
    lengths = rollout.completion_mask.sum(1).tolist()
    return {"paged": held / sum(row["blocks_used"] * block_size for row in timeline),
            "contiguous": held / sum(row["reserved_max"] for row in timeline),
            "block_size": block_size, "completion_lengths": lengths}


def effective_batch(model, tokenizer, prompts: list[str], sampling: SamplingConfig, cache_tokens: int,
                    block_size: int = 16, seed: int = 0) -> dict:
    """Sequences running at once when the KV cache holds `cache_tokens`: paged vs contiguous reservation.

    The mean is taken over the steps in which requests were still waiting, the steps when
    memory, not the workload, sets the batch size. Also counts the steps each needs in all.
    """
    # the engine refuses a cache smaller than one sequence of max_model_len tokens, which defaults to the
    # model's context (8192 for SmolLM2): pass the longest sequence this workload makes, within the context
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts) \
        + sampling.max_completion_length
    context = getattr(model.config, "max_position_embeddings", None) or longest
    out = {}
    for reserve in ("on_demand", "max_length"):
        engine = PagedEngine(model, tokenizer, block_size=block_size, cache="none", reserve=reserve,
                             num_blocks=cache_tokens // block_size, max_model_len=min(longest, context))
        engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
        timeline = engine.scheduler.timeline
        full = [row["running"] for row in timeline if row["waiting"] > 0] or [row["running"] for row in timeline]
        out[reserve] = (statistics.mean(full), len(timeline), engine.stats.preemptions)
    return {"paged": out["on_demand"][0], "contiguous": out["max_length"][0],
            "ratio": out["on_demand"][0] / out["max_length"][0],
            "steps": {"paged": out["on_demand"][1], "contiguous": out["max_length"][1]},
            "preemptions": out["on_demand"][2], "cache_tokens": cache_tokens}


def continuous_vs_static(model, tokenizer, prompts: list[str], sampling: SamplingConfig, max_num_seqs: int,
                         repeats: int = 3, block_size: int = 16, seed: int = 0, progress: str | None = None) -> dict:
    """Tokens/s of continuous and static batching on the same requests, with `max_num_seqs` batch slots.

    Also counts, per policy, the work of one run: steps, decode rows (a static batch's padding
    rows included) and prefill tokens. progress: the label of a bar over the runs (`interleaved`).
    """
    engines = {policy: PagedEngine(model, tokenizer, block_size=block_size, max_num_seqs=max_num_seqs,
                                   cache="none", policy=policy) for policy in ("continuous", "static")}
    tokens, work = {}, {}

    def run(policy):
        engine = engines[policy]
        rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
        tokens[policy] = int(rollout.completion_mask.sum())
        stats = engine.stats
        work[policy] = {"steps": stats.steps, "decode_rows": stats.decode_tokens + stats.padding_tokens,
                        "prefill_tokens": stats.prefill_tokens}

    seconds = interleaved({p: (lambda p=p: run(p)) for p in engines}, repeats, progress)
    rate = {p: tokens[p] / statistics.median(seconds[p]) for p in engines}
    return {"continuous_tokens_per_s": rate["continuous"], "static_tokens_per_s": rate["static"],
            "ratio": rate["continuous"] / rate["static"], "work": work,
            "step_ratio": work["static"]["steps"] / work["continuous"]["steps"],
            "row_ratio": work["static"]["decode_rows"] / work["continuous"]["decode_rows"],
            "tokens": tokens, "seconds": seconds}


def step_costs(model, rows: int, context: int = 128, prompt: int = 64, block_size: int = 16) -> dict:
    """A linear cost model of an engine step on this device, in seconds: fixed + per decode row + per prefill token.

    Fitted from three timed forward passes: 1 decode row, `rows` decode rows (both after
    `context` cached tokens) and one prefill of `prompt` tokens.
    """
    one = step_seconds(model, 1, 1, context, block_size=block_size)
    many = step_seconds(model, rows, 1, context, block_size=block_size)
    prefill = step_seconds(model, 1, prompt, 0, block_size=block_size)
    per_row = max(many - one, 0.0) / (rows - 1)
    fixed = one - per_row
    return {"fixed": fixed, "per_row": per_row, "per_prefill_token": max(prefill - fixed, 0.0) / prompt}


def predicted_seconds(costs: dict, work: dict) -> float:
    """What the cost model says a run with this work (steps, decode_rows, prefill_tokens) takes."""
    return (costs["fixed"] * work["steps"] + costs["per_row"] * work["decode_rows"]
            + costs["per_prefill_token"] * work["prefill_tokens"])


def step_seconds(model, rows: int, tokens_per_row: int, context: int, repeats: int = 15, block_size: int = 16) -> float:
    """Median seconds of one PagedModel forward pass: `rows` sequences, each `tokens_per_row` new tokens
    after `context` cached ones (what a decode step, or a verification of k drafts, costs)."""
    paged, step = probe_step(model, rows, tokens_per_row, context, block_size)
    return statistics.median(interleaved({"step": lambda: paged(step)}, repeats)["step"])


def probe_step(model, rows: int, tokens_per_row: int, context: int, block_size: int = 16):
    """(PagedModel, Step) of a synthetic engine step: `rows` sequences of `tokens_per_row` new tokens after
    `context` cached ones, each in blocks of its own; run once, so that the first call's costs are paid."""
    paged = PagedModel(model)
    per_row = -(-(context + tokens_per_row) // block_size)
    paged.allocate_cache(rows * per_row, block_size)
    chunks = [Chunk([3] * tokens_per_row, context, list(range(r * per_row, (r + 1) * per_row)), tokens_per_row)
              for r in range(rows)]
    step = make_step(chunks, block_size, paged.n_rep, next(model.parameters()).device)
    paged(step)
    return paged, step


def closed_form_saved(prompt_len: int, num_generations: int, block_size: int) -> float:
    """Share of prefill tokens a prefix cache saves when G completions share one prompt of P tokens.

    The first completion computes all P tokens; each of the other G - 1 reuses the prompt's
    full blocks except that the last token is always computed: bs * floor((P - 1) / bs) tokens.
    saved = (G - 1) * bs * floor((P - 1) / bs) / (G * P), which tends to 1 - 1/G for long prompts.
    """
    shared = block_size * ((prompt_len - 1) // block_size)
    return (num_generations - 1) * shared / (num_generations * prompt_len)


def prefix_savings(model, tokenizer, prompts: list[str], num_generations: int, block_size: int) -> dict:
    """Share of prompt tokens a prefix cache keeps from being prefilled, G completions per prompt, counted.

    Each run generates one token per completion, so that only the prefill is measured.
    """
    sampling = SamplingConfig(num_generations=num_generations, max_completion_length=1)
    computed = {}
    for cache in ("none", "prefix"):
        engine = PagedEngine(model, tokenizer, block_size=block_size, cache=cache)
        engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
        computed[cache] = engine.stats.prefill_tokens
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    closed = sum(closed_form_saved(n, num_generations, block_size) * n for n in lengths) / sum(lengths)
    return {"saved": 1 - computed["prefix"] / computed["none"], "closed_form": closed,
            "prefill_tokens": computed, "prompt_tokens": sum(lengths) * num_generations,
            "mean_prompt_len": sum(lengths) / len(lengths), "block_size": block_size, "G": num_generations}


def multi_turn(model, tokenizer, first: list[str], follow_ups: list[list[str]], max_tokens: int, cache: str,
               num_blocks: int | None = None, block_size: int = 16, seed: int = 0) -> dict:
    """A multi-turn workload: turn t + 1 of conversation c is turn t's prompt and answer plus a new message.

    first: the opening message of each conversation; follow_ups[t][c]: the message of
    conversation c at turn t + 1. Every turn is one `run` of all conversations (greedy).
    Returns the share of prompt tokens found in the cache, over all turns and from turn 2 on.
    """
    engine = PagedEngine(model, tokenizer, block_size=block_size, cache=cache, num_blocks=num_blocks)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    prompts = [encode(text) for text in first]
    hits, totals = [], []
    for turn in range(len(follow_ups) + 1):
        seqs = engine.run([Request(p, max_tokens, 0.0) for p in prompts])
        hits.append(engine.stats.cached_tokens)
        totals.append(engine.stats.prompt_tokens)
        if turn < len(follow_ups):
            answers = [[t for t in s.completion if t != tokenizer.eos_token_id] for s in seqs]
            prompts = [p + a + encode(m) for p, a, m in zip(prompts, answers, follow_ups[turn], strict=True)]
    return {"hit_rate": sum(hits) / sum(totals), "hit_rate_after_first": sum(hits[1:]) / max(1, sum(totals[1:])),
            "per_turn": [h / t for h, t in zip(hits, totals, strict=True)], "prompt_tokens": totals}


def speculative_sweep(model, tokenizer, make_draft, requests: list[Request], ks: list[int], repeats: int = 3,
                      block_size: int = 16, seed: int = 0, progress: str | None = None) -> dict:
    """Acceptance rate, tokens per verification and speedup (tokens/s over plain decoding) for each k.

    make_draft() -> a fresh draft (ModelDraft or NgramDraft). acceptance: accepted / proposed
    drafts; tokens_per_round: tokens a sequence gains per verification pass (accepted + 1).
    progress: the label of a bar over the runs (`interleaved`, which names them by k; 0 is plain decoding).
    """
    engines = {0: PagedEngine(model, tokenizer, block_size=block_size)}
    engines |= {k: PagedEngine(model, tokenizer, block_size=block_size, draft=make_draft(),
                               num_speculative_tokens=k) for k in ks}
    tokens, accepted, per_round = {}, {}, {}

    def run(k):
        engine = engines[k]
        engine.reset()
        seqs = engine.run(requests, torch.Generator().manual_seed(seed))
        tokens[k] = sum(len(s.completion) for s in seqs)
        stats = engine.stats
        accepted[k] = stats.accepted_tokens / max(1, stats.draft_tokens)
        per_round[k] = (stats.accepted_tokens + stats.verified_rows) / max(1, stats.verified_rows)

    seconds = interleaved({k: (lambda k=k: run(k)) for k in engines}, repeats, progress)
    rate = {k: tokens[k] / statistics.median(seconds[k]) for k in engines}
    return {"acceptance": {k: accepted[k] for k in ks}, "tokens_per_round": {k: per_round[k] for k in ks},
            "speedup": {k: rate[k] / rate[0] for k in ks}, "tokens_per_s": rate, "seconds": seconds}


def speculative_speedup(tokens_per_round: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Speedup of speculation over plain decoding when costs are counted in target decode steps.

    Each round the draft runs k steps of `draft_cost` each and the target one pass over k + 1
    tokens costing `verify_cost` decode steps; it yields `tokens_per_round` tokens, where plain
    decoding yields 1 per step. On a GPU a decode step is memory-bound, so verify_cost ~ 1 and
    a draft ~20x smaller has draft_cost ~0.05; on a CPU both grow with the work.
    """
    return tokens_per_round / (k * draft_cost + verify_cost)


def versus_hf(model, tokenizer, prompts: list[str], sampling: SamplingConfig, block_size: int = 16, repeats: int = 3,
              seed: int = 0, log=None, kv_cache_bytes: int | None = None) -> dict:
    """The paged engine against HF generate (`HFEngine`) on the same model, prompts, G and length limit.

    One unmeasured call each first, then paged, HF, paged, ... `repeats` times. The paged
    engine's cache is emptied before every call (as a weight update would). Compared: generated
    tokens (up to and including EOS) per second, `speedup` the median over repeats of the ratio
    within a repeat (the two calls of a repeat see about the same machine load); and the time
    to finish the batch, `finish_speedup` likewise. The completions differ (other random
    streams), so token counts differ a little. Also returns the engine's median seconds per
    phase and token counts, and HF's work: prompt tokens prefilled and rows x steps decoded.
    kv_cache_bytes: the paged engine's cache budget (default: sized to the work).
    """
    engines = {"paged": PagedEngine(model, tokenizer, block_size=block_size, kv_cache_bytes=kv_cache_bytes),
               "hf": HFEngine(model, tokenizer)}
    for engine in engines.values():
        engine.generate(prompts[:1], sampling, generator=torch.Generator().manual_seed(seed))
    seconds, tokens = {k: [] for k in engines}, {k: [] for k in engines}
    phases, counts, hf_rows = [], [], []
    for r in range(repeats):
        for kind, engine in engines.items():
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
            log(f"repeat {r + 1}/{repeats}: paged {seconds['paged'][-1]:.2f} s ({tokens['paged'][-1]} tokens), "
                f"hf {seconds['hf'][-1]:.2f} s ({tokens['hf'][-1]} tokens)")
    rates = {k: [t / s for t, s in zip(tokens[k], seconds[k], strict=True)] for k in engines}     # per repeat
    ratios = [p / h for p, h in zip(rates["paged"], rates["hf"], strict=True)]                   # within a repeat
    finish = [h / p for p, h in zip(seconds["paged"], seconds["hf"], strict=True)]
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    return {"prompts": len(prompts), "num_generations": sampling.num_generations,
            "max_completion_length": sampling.max_completion_length, "block_size": block_size, "repeats": repeats,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "speedup": statistics.median(ratios), "speedups": ratios,
            "finish_speedup": statistics.median(finish), "finish_speedups": finish,
            "paged_phase_seconds": {p: statistics.median(x[p] for x in phases) for p in phases[0]},
            "paged_counts": {c: statistics.median(x[c] for x in counts) for c in counts[0]},
            "hf_prefill_tokens": prompt_tokens * sampling.num_generations,
            "hf_rows_x_steps": statistics.median(hf_rows)}


def best_rate(work, amount: float, clock, min_seconds: float, trials: int) -> float:
    """The best over `trials` of amount x calls / seconds, a trial calling work() until `clock` advanced min_seconds."""
    best = 0.0
    for _ in range(trials):
        calls, start = 0, clock()
        while True:
            work()
            calls += 1
            if (elapsed := clock() - start) >= min_seconds:
                break
        best = max(best, amount * calls / elapsed)
    return best


def machine_limits(trial: float = 1.0, trials: int = 3, current_threads: bool = True, size: int = 2048,
                   copy_mib: int = 256) -> dict:
    """This machine's float32 matrix-product peak (FLOP/s) and copy bandwidth (bytes/s): at one thread by
    CPU time (`*_1t`), and, with `current_threads`, at torch's current threads by the wall clock.

    matmul: size x size float32 products (2 size^3 FLOPs each); copy: a `copy_mib` MiB tensor (read +
    written, 2 x its size; larger than a CPU's last-level cache) copied by libc's memcpy (numpy's
    copyto; torch's copy_ reached about half of it at one thread on the machine of
    benchmarks/README.md) and, at the current threads, also by torch's threaded copy_: the faster
    counts. At one thread each trial runs for at least `trial` seconds of the process's CPU time,
    which a busy machine does not inflate (time waiting for a core is not the process's); at the
    current threads the wall clock is the only honest clock (CPU time would add the threads up), so
    those trials are twice as long. The best of `trials` counts: a limit is what the machine can do.
    """
    a = torch.randn(size, size)
    product = torch.empty_like(a)
    src = torch.empty(copy_mib * 2**20 // 4).normal_()
    dst = torch.empty_like(src)
    flops, moved = 2 * size ** 3, 2 * src.numel() * src.element_size()
    matmul, memcpy = (lambda: torch.mm(a, a, out=product)), (lambda: np.copyto(dst.numpy(), src.numpy()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"matmul_flops_1t": best_rate(matmul, flops, time.process_time, trial, trials),
               "copy_bytes_1t": best_rate(memcpy, moved, time.process_time, trial, trials)}
    finally:
        torch.set_num_threads(threads)
    if current_threads:
        out |= {"matmul_flops": best_rate(matmul, flops, time.perf_counter, 2 * trial, trials),
                "copy_bytes": max(best_rate(copy, moved, time.perf_counter, 2 * trial, trials)
                                  for copy in (memcpy, lambda: dst.copy_(src))),
                "threads": threads}
    return out


def decode_step_work(model, rows: int, context: int) -> dict:
    """FLOPs and bytes of one decode step (`rows` sequences, one token each after `context`), from the shape.

    FLOPs: 2 per weight of every matrix product per row (q/k/v/o, the MLP, the LM head; the
    embedding is a lookup), plus attention's 4 x heads x head_dim per visible position (q.k and
    p.v). Bytes: every parameter read once, plus the keys and values of rows x (context + 1)
    positions. Activations are left out (a few kB per row, cache-resident).
    """
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).dtype.itemsize
    products = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.weight.numel() for m in products)
    params = {p.data_ptr(): p.numel() for p in model.parameters()}                   # tied weights once
    positions = rows * (context + 1)
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize * positions
    attention_flops = 4 * positions * c.num_attention_heads * head_dim * c.num_hidden_layers
    return {"flops": 2 * weights * rows + attention_flops, "attention_flops": attention_flops,
            "weight_bytes": sum(params.values()) * itemsize, "kv_bytes": kv_bytes,
            "bytes": sum(params.values()) * itemsize + kv_bytes}


def decode_roofline(model, rows: int = 32, context: int = 160, limits: dict | None = None, repeats: int = 15,
                    block_size: int = 16) -> dict:
    """One decode step's measured seconds (median) beside its roofline: max(bytes / bandwidth, FLOPs / peak)."""
    limits = limits or machine_limits()
    work = decode_step_work(model, rows, context)
    memory, compute = work["bytes"] / limits["copy_bytes"], work["flops"] / limits["matmul_flops"]
    measured = step_seconds(model, rows, 1, context, repeats, block_size)
    ideal = max(memory, compute)
    return work | limits | {"rows": rows, "context": context, "memory_s": memory, "compute_s": compute,
                            "ideal_s": ideal, "measured_s": measured, "share": ideal / measured,
                            "bound": "compute" if compute >= memory else "memory"}


STEP_KINDS = {"matrix products": ("minirl::linear", "aten::mm", "aten::addmm", "aten::addmm_"),
              "attention, read in place": ("minirl::decode_attention", "aten::_embedding_bag_forward_only",
                                           "aten::_embedding_bag", "aten::_softmax"),
              "cache writes": ("minirl::write_kv", "aten::put_", "aten::_index_put_impl_", "aten::index_copy_")}
OTHER_KIND = "everything else (norms, rotary, residuals, indexing, Python)"


def decode_step_breakdown(model, roof: dict, repeats: int = 3, block_size: int = 16) -> dict:
    """Where the measured decode step of `roof` (decode_roofline's result) goes, each kind beside its own ideal.

    The step is profiled (torch.profiler, self CPU time of each operator and C kernel, `repeats` calls;
    kernels run by a queue, `paged_kernels.queued`, timed inside it) and its operators sorted into
    STEP_KINDS and OTHER_KIND; a kind's seconds are its share of the profiled
    time times the measured step. Ideals: the products' FLOPs at the matmul peak or their weights at
    the copy bandwidth, attention's FLOPs or the cached keys and values likewise; the rest has none.
    "bound" is the share of the machine the step would reach if everything but the products and
    attention took no time at all: how far removing overhead alone could take it.
    """
    paged, step = probe_step(model, roof["rows"], 1, roof["context"], block_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof, kernels.recorded() as queued:
        for _ in range(repeats):
            paged(step)
    own = {e.key: e.self_cpu_time_total for e in prof.key_averages()}          # microseconds
    for name, seconds in queued.items():                 # kernels run by a queue: one range, timed inside
        own[f"minirl::{name}"] = own.get(f"minirl::{name}", 0) + 1e6 * seconds
        own["minirl::queue"] -= 1e6 * seconds            # what is left of it: the queue's own loop
    total = sum(own.values())
    shares = {kind: sum(own.get(op, 0) for op in ops) / total for kind, ops in STEP_KINDS.items()}
    shares[OTHER_KIND] = 1 - sum(shares.values())
    peak, bandwidth = roof["matmul_flops"], roof["copy_bytes"]
    products_flops = roof["flops"] - roof["attention_flops"]
    ideals = {"matrix products": max(products_flops / peak, roof["weight_bytes"] / bandwidth),
              "attention, read in place": max(roof["attention_flops"] / peak, roof["kv_bytes"] / bandwidth)}
    kinds = {kind: {"share": share, "seconds": share * roof["measured_s"], "ideal_s": ideals.get(kind)}
             for kind, share in shares.items()}
    return {"kinds": kinds, "bound": roof["ideal_s"] / sum(kinds[k]["seconds"] for k in ideals)}


def hf_greedy(model, tokenizer, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """HF generate's greedy completions of `texts` (cut after EOS): what the engine must reproduce."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)[:, enc.input_ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def looping_prompt(model, tokenizer, prompts: list[str]) -> list[int]:
    """The first prompt whose greedy continuation runs 16 tokens without EOS (a random model's loop)."""
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        out = out[0, len(ids):]
        if len(out) == 16 and tokenizer.eos_token_id not in out.tolist():
            return ids
    raise RuntimeError("no prompt loops under greedy decoding: the n-gram workload needs one")


def bigram_speculation(accept, n: int = 4000, V: int = 4, k: int = 3, seed: int = 0) -> tuple[float, float]:
    """(p-value, chi2) of the first 3 tokens of n speculative runs from token 0 against the target's joint.

    Bigram "models" on a vocabulary of V: the target P and the draft Q (fixed random matrices).
    Each round the draft samples k tokens, `accept(p, q, draft, generator)` (the rule under test,
    `accept_draft`'s signature) decides, and the emitted tokens are collected until every run has
    3. A chi-square test on V**3 - 1 degrees of freedom against P's exact joint probabilities.
    """
    mats = torch.Generator().manual_seed(1234)
    P = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    g = torch.Generator().manual_seed(seed)
    out, filled = torch.full((n, 3), -1), torch.zeros(n, dtype=torch.long)
    last, rows = torch.zeros(n, dtype=torch.long), torch.arange(n)
    while int(filled.min()) < 3:
        drafts, qs, prev = [], [], last
        for _ in range(k):
            qs.append(Q[prev])
            drafts.append(torch.multinomial(qs[-1], 1, generator=g).squeeze(1))
            prev = drafts[-1]
        draft = torch.stack(drafts, 1)
        a, nxt = accept(P[torch.cat([last[:, None], draft], 1)], torch.stack(qs, 1), draft, g)
        for j in range(k + 1):
            token = torch.where(j < a, draft[:, min(j, k - 1)], nxt)
            ok = (j <= a) & (filled < 3)
            out[rows[ok], filled[ok]] = token[ok]
            filled = filled + ok.long()
        last = nxt
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    t1, t2, t3 = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    expected = (P[0][t1] * P[t1, t2] * P[t2, t3]).flatten().double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((V ** 3 - 1) / 2, dtype=torch.double)
    return float(torch.special.gammaincc(dof, chi2 / 2)), float(chi2)


def greedy_acceptance(p, q, draft, generator=None):
    """A plausible mistake, for `bigram_speculation` to catch: keep a draft token whenever p >= q."""
    S, k = draft.shape
    kept = p[:, :k].gather(2, draft[..., None]).squeeze(2) >= q.gather(2, draft[..., None]).squeeze(2)
    accepted = kept.long().cumprod(1).sum(1)
    return accepted, torch.multinomial(p[torch.arange(S), accepted], 1, generator=generator).squeeze(1)
