"""Checking and timing expert parallelism: a `torchrun` job around notebook 08's `ExpertParallelMoE`.

Hand-written (a measurement harness; notebook 08 section 3 teaches the layer itself, in
`minirl.parallel.expert`: experts split over ranks, tokens exchanged with all-to-all).

- `moe_block` builds the MoE block of a fresh one-layer Qwen2-MoE (as in the tiny policy), in float32.
- `skew_router` makes a hot spot: it tilts some experts' router rows toward a direction every token shares.
- `measure_rank` (on one rank) compares the distributed layer's output and gradients with the
  single-process block on all tokens, then times its dispatch, expert compute and combine.
- `expert_worker` is the body of the `torchrun` job (the check and the timing, with the router as built
  and skewed); `launch_expert_parallel` starts it on CPU (gloo) and returns one row per rank and scenario.
"""
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minirl.parallel.expert import ExpertParallelMoE, local_experts
from minirl.runtime.launch import output_ends, torchrun


def moe_block(hidden_size: int = 64, num_experts: int = 8, top_k: int = 2, seed: int = 0) -> nn.Module:
    """The MoE block of a freshly initialized one-layer Qwen2-MoE (as in the tiny policy), in float32."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(vocab_size=32, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True)
    return Qwen2MoeForCausalLM(config).model.layers[0].mlp


def skew_router(block: nn.Module, experts: range, direction: torch.Tensor, strength: float) -> None:
    """A hot spot: `experts`' router rows gain `strength` x `direction` ([H], unit), so tokens that share
    that direction (hidden states of real models share a large common component) score them higher."""
    with torch.no_grad():
        block.gate.weight[experts.start:experts.stop] += strength * direction


def measure_rank(block: nn.Module, tokens: torch.Tensor, repeats: int) -> dict:
    """On this rank: output and gradients against the single-process block, and the exchange's cost."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tokens.chunk(world)[rank]                                        # [n, H] this rank's tokens
    probe = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(7))
    full_in = tokens.clone().requires_grad_()
    reference = block(full_in[None])[0]                                     # [N, H] single process, all tokens
    (reference * probe).sum().backward()
    layer = ExpertParallelMoE(block)
    x = mine.clone().requires_grad_()
    out = layer(x[None])[0]
    (out * probe.chunk(world)[rank]).sum().backward()
    ref_out = reference.chunk(world)[rank]
    ref_gate_up = block.experts.gate_up_proj.grad[layer.local.start:layer.local.stop]
    check = {"max_abs_output": (out - ref_out).abs().max().item(),
             "max_abs_input_grad": (x.grad - full_in.grad.chunk(world)[rank]).abs().max().item(),
             "max_abs_expert_grad": (layer.gate_up_proj.grad - ref_gate_up).abs().max().item()}
    timings = []
    with torch.no_grad():
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            layer(mine[None])
            timings.append(layer.last | {"seconds": time.perf_counter() - start})
    median = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
    return {"rank": rank, "tokens": mine.shape[0], **check, **median}


def expert_worker(argv=None) -> None:
    """Body of the torchrun job: the check and the measurement with the router as built and skewed."""
    import argparse
    import warnings

    parser = argparse.ArgumentParser(description="minirl expert-parallel worker (run under torchrun)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
    dist.init_process_group("gloo")
    try:
        rows = []
        for scenario, strength in (("router as built", 0.0), ("skewed router", args.skew)):
            block = moe_block(args.hidden, args.experts, args.top_k)
            g = torch.Generator().manual_seed(1)
            direction = nn.functional.normalize(torch.randn(args.hidden, generator=g), dim=0)    # [H]
            tokens = torch.randn(args.tokens, args.hidden, generator=g) + direction               # [N, H]
            skew_router(block, local_experts(args.experts, dist.get_world_size(), 0), direction, strength)
            mine = measure_rank(block, tokens, args.repeats)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine | {"scenario": scenario})
            rows.extend(everyone)
            if dist.get_rank() == 0:
                print(f"[expert parallel] {scenario}: checked and timed ({args.repeats} repeats)", flush=True)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps({"rows": rows, "config": vars(args) | {"out": str(args.out)}}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch_expert_parallel(world_size: int = 2, hidden: int = 64, experts: int = 8, top_k: int = 2,
                           tokens: int = 4096, skew: float = 1.0, repeats: int = 5, timeout: float = 300,
                           progress: bool = False) -> dict:
    """Run `expert_worker` under `torchrun --standalone` on CPU (gloo); returns {"rows": one dict per rank
    and scenario, "config"}. Raises ValueError for settings that cannot split, RuntimeError if the job fails,
    subprocess.TimeoutExpired after `timeout` seconds (every rank ended: notebook 04's `torchrun`).
    progress=True prints the job's output as it comes (a line per scenario)."""
    local_experts(experts, world_size, 0)
    if tokens < world_size or tokens % world_size:
        raise ValueError(f"tokens={tokens}: use a multiple of world_size={world_size} (every rank gets an equal share)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "expert.json"
        flags = ["--hidden", hidden, "--experts", experts, "--top-k", top_k, "--tokens", tokens, "--skew", skew,
                 "--repeats", repeats, "--out", out]
        job = torchrun("minirl.runtime.expert_job:expert_worker", world_size, flags, timeout=timeout, stream=progress)
        if job.returncode != 0 or not out.exists():
            raise RuntimeError(f"expert-parallel job (world_size={world_size}) failed with code {job.returncode}:\n"
                               f"{output_ends(job.stdout)}")
        return json.loads(out.read_text())
