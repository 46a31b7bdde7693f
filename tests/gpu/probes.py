"""The in-process checks of tests/gpu/run.sh, one per subcommand; each prints one JSON line with its figures.

    python tests/gpu/probes.py imports                 # every minirl module but the Ray controller imports
    python tests/gpu/probes.py timer --device cuda     # StageTimer waits for the GPU's queued work
    python tests/gpu/probes.py engine --device cuda    # the paged engine's greedy tokens equal HF generate's

Exit status 0 when the check holds, 1 when it does not (the JSON line says why), as
tests/gpu/check.py reads them. They run on a CPU too (the rehearsal), where `timer` has no
device to wait for and `engine` compares CPU kernels.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEEDS_RAY = ("minirl.controller", "minirl.runtime.async_ray",   # the Ray controller and producers, and the
             "minirl.runtime.driver_run", "minirl.runtime.object_store_sync",   # controller's plumbing
             "minirl.runtime.ray_calls", "minirl.runtime.ray_start", "minirl.runtime.role_checkpoints",
             "minirl.runtime.source_rows", "minirl.runtime.reservations")


def imports(args) -> dict:
    """Import every minirl module except the Ray ones: what a machine without trl, ray, vllm must manage."""
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "minirl").rglob("*.py"))
    failed = []
    for name in modules:
        if name.startswith(NEEDS_RAY):
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            failed.append(f"{name}: {err}")
    return {"ok": not failed, "modules": len(modules), "failed": failed}


def timer(args) -> dict:
    """The stage timer's seconds against CUDA events around the same queued matmuls (a CPU has nothing queued)."""
    import torch

    from minirl.runtime.timing import StageTimer

    device = torch.device(args.device)
    n, repeats = (4096, 20) if device.type == "cuda" else (256, 20)
    a = torch.randn(n, n, device=device) / n ** 0.5
    (a @ a).sum().item()                                                   # warm-up: kernels chosen, memory held
    if device.type != "cuda":
        t = StageTimer()
        with t("work"):
            for _ in range(repeats):
                a @ a
        return {"ok": t.times["time/work"] > 0, "timer_s": t.times["time/work"],
                "note": "CPU: no device queue to wait for"}
    synced, unsynced = StageTimer(), StageTimer(device="cpu")              # auto (CUDA in use), and never synced
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with synced("work"):
        events[0].record()
        for _ in range(repeats):
            a @ a
        events[1].record()
    torch.cuda.synchronize()
    gpu = events[0].elapsed_time(events[1]) / 1e3
    with unsynced("work"):
        for _ in range(repeats):
            a @ a
    torch.cuda.synchronize()
    host = synced.times["time/work"]
    return {"ok": host >= 0.9 * gpu, "timer_s": host, "cuda_events_s": gpu,
            "unsynchronized_s": unsynced.times["time/work"],
            "note": "the timer must include the GPU's work (>= 0.9 x the events' time)"}


def hf_greedy(model, tokenizer, texts, max_new_tokens):
    """HF generate's greedy completions (cut after EOS) and the top-2 logit gap at every step."""
    import torch

    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack(out.logits, 1).float().topk(2, -1).values
    rows = []
    for row in out.sequences[:, enc.input_ids.shape[1]:].tolist():
        rows.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return rows, (top2[..., 0] - top2[..., 1]).cpu()


TIES = {"float32": 1e-3, "bfloat16": 0.125}   # a top-2 logit gap below which two kernels may pick either token


def engine(args) -> dict:
    """Greedy completions of the paged engine and of HF generate on the device, in float32 and bfloat16.

    They must be equal token for token, except where HF's two best logits tie within the
    dtype's rounding (TIES: bfloat16 keeps 8 bits of mantissa, so logits of size ~8 round
    by ~0.06): different attention kernels may then pick either token. Equality in bfloat16
    is meaningful only that far; float32 is the strict comparison.
    """
    import torch

    from minirl.models.policy import load_default_policy
    from minirl.rollout.engine.engine import PagedEngine
    from minirl.runtime.engine_core import Request
    from minirl.tasks.arithmetic import format_prompt, make_task

    model, tokenizer, _ = load_default_policy(progress=False)
    prompts = [format_prompt(p) for p in make_task().test[:args.prompts]]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    result = {"ok": True, "prompts": len(prompts)}
    for dtype in ("float32", "bfloat16"):
        reference = copy.deepcopy(model).to(args.device, getattr(torch, dtype)).eval()
        paged = PagedEngine(model, tokenizer, dtype=dtype, device=args.device, block_size=4)
        got = [s.completion for s in paged.run([Request(x, args.new_tokens, 0.0) for x in ids])]
        want, gaps = hf_greedy(reference, tokenizer, prompts, args.new_tokens)
        equal, ties, wrong = 0, [], []
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if list(g) == list(w):
                equal += 1
                continue
            j = next((j for j in range(min(len(g), len(w))) if g[j] != w[j]), min(len(g), len(w)))
            gap = float(gaps[i, j]) if j < gaps.shape[1] else float("inf")
            (ties if gap < TIES[dtype] else wrong).append({"row": i, "token": j, "gap": gap})
        result[dtype] = {"equal_rows": equal, "tie_rows": len(ties), "wrong_rows": wrong[:3],
                         "tie_threshold": TIES[dtype]}
        result["ok"] = result["ok"] and not wrong
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("imports", "timer", "engine"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=5)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = {"imports": imports, "timer": timer, "engine": engine}[args.probe](args)
    result["seconds"] = time.perf_counter() - started
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
