"""Chapter 05: measure generation speed claim by claim with the paged engine, on any HF model and device.

    python chapters/05_generation.py --out runs/05                 # the long-tail policy + embedded policy, CPU
    python chapters/05_generation.py --quick --out runs/05-quick   # small workloads (about a minute)
    python chapters/05_generation.py --model Qwen/Qwen2.5-0.5B --draft Qwen/Qwen2.5-0.5B-Instruct --device cuda

Runs the measurements of notebook 05 (minirl.runtime.engine_measure) on one workload: --num-prompts
few-shot arithmetic prompts of about --prompt-length characters, G = --num-generations completions
each, at most --max-new-tokens new tokens, sampled at temperature 1:
  - KV utilization, paged vs contiguous preallocation of prompt + max_tokens, and the sequences
    that fit one cache of --cache-tokens tokens under each;
  - continuous vs static batching with --slots batch slots (tokens/s, interleaved; steps and rows);
  - prefix caching at G = 8: share of prefill tokens saved, counted, against the closed form;
  - a radix-tree cache on a multi-turn workload (8 conversations of 4 turns): share of prompt tokens found;
  - speculative decoding for k in --ks: acceptance rate and speedup over plain decoding.
Default model: the long-tail policy (7.6 M parameters, random weights, a long tail of
completion lengths); speculation then runs on the embedded arithmetic policy with a warm-started
draft 8x smaller. With --model, everything runs on that model; speculation uses --draft (a
model with the same vocabulary) or, without one, n-gram prompt lookup.

Writes OUT/summary.json with kv_utilization {paged, contiguous}, effective_batch,
continuous_vs_static {ratio, ...}, prefix_saved_share, spec_acceptance {k: ...},
spec_speedup {k: ...}, radix_hit_rate, and the workload.

The flags are parsed before torch and transformers are imported; a mistyped flag, a --device
this machine lacks, or a workload longer than the model's context is refused in one line
before any model loads.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from minirl.runtime.cli import check_args, check_device, common_parser
from minirl.runtime.validate import check_int

LONG_TAIL_CONTEXT = 512   # LongTailConfig().max_length in minirl.runtime.workloads (not imported: torch)


def model_context(name: str | None) -> int | None:
    """Positions of --model read from its config.json (no weights, no transformers); the long-tail policy's
    without --model; None for a hub id (checked once it has loaded)."""
    if name is None:
        return LONG_TAIL_CONTEXT
    path = Path(name).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None                                    # no config.json, or a bad one: check_model_source says
    text = config.get("text_config") or config if isinstance(config, dict) else {}
    return next((text[k] for k in ("max_position_embeddings", "n_positions", "max_seq_len") if k in text), None)


def check_context(parser, args, context: int | None, name: str) -> None:
    """parser.error when a prompt of --prompt-length characters and --max-new-tokens do not fit `context`
    positions (a character of these ASCII prompts is at most one token)."""
    if context is not None and args.prompt_length + args.max_new_tokens > context:
        parser.error(f"argument --prompt-length: {args.prompt_length}: prompts of about {args.prompt_length} "
                     f"characters plus --max-new-tokens {args.max_new_tokens} need more than the {context} positions "
                     f"of {name}; use --prompt-length <= {max(1, context - args.max_new_tokens)} (or fewer "
                     "--max-new-tokens)")


def parse_args(argv=None):
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=None, help="with --model: a draft model (same vocabulary) for speculation")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64, help="characters per prompt, about")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16, help="batch slots for continuous vs static")
    parser.add_argument("--cache-tokens", type=int, default=2048, help="KV cache size for the effective-batch test")
    parser.add_argument("--ks", default="1,2,3,4", help="speculation lengths to try, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per alternative (medians)")
    parser.add_argument("--quick", action="store_true", help="small workloads: 4 prompts x 4, 48 tokens, 1 repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads; 0: torch's default (default: 1)")
    args = parser.parse_args(argv)
    check_args(parser, {
        **{name: (lambda v, n=name: check_int(n, v, low=1)) for name in
           ("num_prompts", "num_generations", "prompt_length", "max_new_tokens", "block_size", "slots",
            "cache_tokens", "repeats")},
        "threads": lambda v: check_int("threads", v, low=0, why="0: torch's default"),
    }, args)
    raw = args.ks
    try:
        args.ks = [int(k) for k in raw.split(",") if k]
    except ValueError:
        args.ks = []
    if not args.ks or min(args.ks) < 1:
        parser.error(f"argument --ks: {raw!r}: comma-separated integers >= 1, e.g. 1,2,4")
    if args.draft and not args.model:
        parser.error("argument --draft: only with --model (the default target has its own draft)")
    if args.quick:
        args.num_prompts, args.num_generations, args.max_new_tokens = 4, 4, 48
        args.repeats, args.slots, args.cache_tokens, args.ks = 1, 4, 512, args.ks[:2]
    check_context(parser, args, model_context(args.model), args.model or "the long-tail policy")
    check_device(parser, args.device)                  # imports torch: after every flag parsed
    from minirl.runtime.model_loading import ModelSourceError, check_model_source

    for flag, name in (("--model", args.model), ("--draft", args.draft)):
        try:
            if name:
                check_model_source(name)          # a missing directory is named before anything loads
        except ModelSourceError as err:
            parser.error(f"argument {flag}: {err}")
    args.parser = parser                               # main checks a hub model's context once it has loaded
    return args


def verdict(ok: bool) -> str:
    return "agree" if ok else "differ"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from minirl.config import SamplingConfig
    from minirl.models.policy import load_default_policy
    from minirl.runtime.drafts import ModelDraft, NgramDraft
    from minirl.runtime.engine_core import Request
    from minirl.runtime.engine_measure import (
        continuous_vs_static,
        effective_batch,
        kv_utilization,
        multi_turn,
        prefix_savings,
        speculative_sweep,
    )
    from minirl.runtime.io import write_summary
    from minirl.runtime.model_loading import load_policy
    from minirl.runtime.seeding import seed_everything
    from minirl.runtime.workloads import few_shot_prompts, load_draft_policy, load_long_tail_policy
    from minirl.tasks.arithmetic import make_task

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    if args.model:
        model, tokenizer = load_policy(args.model, args.device, dtype=torch.float32, progress=False)
        spec_model, spec_tok = model, tokenizer
        check_context(args.parser, args, getattr(model.config, "max_position_embeddings", None), args.model)
        draft = load_policy(args.draft, args.device, dtype=torch.float32, progress=False)[0] if args.draft else None
    else:
        model, tokenizer, _ = load_long_tail_policy(device=args.device)
        spec_model, spec_tok, _ = load_default_policy(device=args.device, progress=False)
        draft = load_draft_policy(device=args.device)[0]
    prompts = few_shot_prompts(args.num_prompts, length=args.prompt_length, seed=args.seed)
    sampling = SamplingConfig(num_generations=args.num_generations, max_completion_length=args.max_new_tokens)
    bs = args.block_size
    print(f"workload: {len(prompts)} prompts of ~{args.prompt_length} characters x G={args.num_generations}, "
          f"<= {args.max_new_tokens} new tokens, block size {bs}, model {args.model or 'long-tail policy'}, "
          f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}", flush=True)

    kv = kv_utilization(model, tokenizer, prompts, sampling, block_size=bs, seed=args.seed)
    lengths = kv.pop("completion_lengths")
    eb = effective_batch(model, tokenizer, prompts[:max(1, len(prompts) // 2)], sampling, args.cache_tokens, bs,
                         args.seed)
    cvs = continuous_vs_static(model, tokenizer, prompts[:max(1, len(prompts) // 2)], sampling, args.slots,
                               args.repeats, bs, args.seed)
    ps = prefix_savings(model, tokenizer, prompts[:4], 8, bs)
    conversations = max(2, min(8, len(prompts)))
    follow = [few_shot_prompts(conversations, length=24, seed=args.seed + 11 + t) for t in range(3)]
    radix = multi_turn(model, tokenizer, few_shot_prompts(conversations, length=48, seed=args.seed + 10), follow,
                       max_tokens=24, cache="radix", block_size=bs)
    print("measured KV utilization, batching, prefix and radix caching", flush=True)

    if draft is not None:
        make_draft, draft_name = (lambda: ModelDraft(draft)), "model draft"
        if args.model:
            spec_prompts = prompts
        else:
            spec_prompts = [row["prompt"] for row in make_task().rows("train")[:len(prompts)]]
    else:
        make_draft, draft_name, spec_prompts = (lambda: NgramDraft(3)), "n-gram lookup", prompts
    spec_ids = [spec_tok(p, add_special_tokens=False)["input_ids"] for p in spec_prompts]
    spec_tokens = 4 if not args.model else args.max_new_tokens
    requests = [Request(x, spec_tokens, 1.0) for x in spec_ids for _ in range(args.num_generations)]
    spec = speculative_sweep(spec_model, spec_tok, make_draft, requests, args.ks, args.repeats,
                             block_size=4 if not args.model else bs, seed=args.seed)
    ngram = speculative_sweep(model, tokenizer, lambda: NgramDraft(3),
                              [Request(tokenizer(prompts[0], add_special_tokens=False)["input_ids"],
                                       args.max_new_tokens // 2, 0.0)], args.ks, args.repeats, bs, args.seed)

    rows = [
        ("KV utilization, contiguous", "50-70 %", f"{100 * kv['contiguous']:.1f} %",
         verdict(0.5 <= kv["contiguous"] <= 0.7)),
        ("KV utilization, paged", "95 %+", f"{100 * kv['paged']:.1f} %", verdict(kv["paged"] >= 0.9)),
        ("sequences at once, same cache", "2-4x", f"{eb['ratio']:.2f}x", verdict(2 <= eb["ratio"] <= 4)),
        ("continuous / static, tokens/s", "5-10x", f"{cvs['ratio']:.2f}x (steps {cvs['step_ratio']:.2f}x)",
         verdict(5 <= cvs["ratio"] <= 10)),
        ("prefix caching at G = 8, prefill saved", "70-80 %", f"{100 * ps['saved']:.1f} % "
         f"(closed form {100 * ps['closed_form']:.1f} %)", verdict(0.7 <= ps["saved"] <= 0.8)),
        (f"speculative decoding ({draft_name}), best k", "2-3x", f"{max(spec['speedup'].values()):.2f}x",
         verdict(2 <= max(spec["speedup"].values()) <= 3)),
        ("speculative decoding (n-gram, greedy, batch 1)", "2-3x", f"{max(ngram['speedup'].values()):.2f}x",
         verdict(max(ngram["speedup"].values()) >= 2)),
        ("radix cache hit rate, multi-turn", "-", f"{100 * radix['hit_rate']:.1f} % "
         f"(from turn 2: {100 * radix['hit_rate_after_first']:.1f} %)", "-"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    headers = ("quantity", "source", "minirl", "agree?")
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(f"\nspeculation by k ({draft_name}): " + ", ".join(
        f"k={k}: acceptance {100 * spec['acceptance'][k]:.0f} %, speedup {spec['speedup'][k]:.2f}x" for k in args.ks))
    print("notebook 05 explains each difference in numbers (what dominates the time on this device)")

    summary = {
        "workload": {"model": args.model or "long-tail policy", "prompts": len(prompts),
                     "num_generations": args.num_generations, "max_new_tokens": args.max_new_tokens,
                     "block_size": bs, "completion_lengths": lengths, "device": args.device,
                     "torch_threads": torch.get_num_threads()},
        "kv_utilization": kv, "effective_batch": eb,
        "continuous_vs_static": {k: v for k, v in cvs.items() if k != "seconds"},
        "prefix_saved_share": ps["saved"], "prefix": ps,
        "spec_acceptance": spec["acceptance"], "spec_speedup": spec["speedup"],
        "spec_tokens_per_round": spec["tokens_per_round"], "spec_draft": draft_name,
        "spec_ngram": {k: v for k, v in ngram.items() if k != "seconds"},
        "radix_hit_rate": radix["hit_rate"], "radix": radix,
        "table": [dict(zip(("quantity", "source", "minirl", "agree"), r, strict=True)) for r in rows],
    }
    path = write_summary(args.out, summary)
    print(f"summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
