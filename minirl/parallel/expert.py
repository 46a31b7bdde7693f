# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Expert parallelism: a MoE layer's experts split across ranks, tokens sent to them with all-to-all.

`ExpertParallelMoE` wraps a transformers Qwen2-MoE sparse block on one rank of a process
group: the router and the shared expert are replicated, the routed experts are split into
equal contiguous slices (rank r holds experts r*E/R .. (r+1)*E/R - 1). A forward pass routes
the rank's own tokens, sends each (token, expert) pair to the rank holding the expert
(dispatch all-to-all), runs the local experts, sends the results back (combine all-to-all)
and sums them with the routing weights: the same output as the single-process block, and,
through `torch.distributed.nn.functional.all_to_all_single`, the same gradients.
`expert_worker` is the body of a `torchrun` job that checks this and measures the exchange;
`launch_expert_parallel` starts it.

Simplified on purpose: gloo's all_to_all_single on CPU (NCCL on GPUs); no capacity factor or
token dropping, no overlap of the exchange with compute (DeepEP's job), one MoE layer.
"""

__all__ = ["local_experts", "exchange", "ExpertParallelMoE", "moe_block", "skew_router",
           "measure_rank", "expert_worker", "launch_expert_parallel"]

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minirl.runtime.launch import output_ends, torchrun


def local_experts(num_experts: int, world_size: int, rank: int) -> range:
    """The experts rank `rank` holds: an equal contiguous slice of `num_experts`."""
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}: expert "
                         "parallelism gives every rank the same number of experts; change one of them")
    per = num_experts // world_size
    return range(rank * per, (rank + 1) * per)


def exchange(x: torch.Tensor, receive_counts: list[int], send_counts: list[int], group=None) -> torch.Tensor:
    """all_to_all_single with autograd: rows [sum(send_counts), ...] out, [sum(receive_counts), ...] in."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(receive_counts), *x.shape[1:]))
    if not x.requires_grad:
        dist.all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=group)
        return out
    return all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=group)


class ExpertParallelMoE(nn.Module):
    """One rank's share of a Qwen2-MoE sparse block (`Qwen2MoeSparseMoeBlock`): all of its router and
    shared expert, its slice of the routed experts. `last` holds the latest forward's measurements."""

    def __init__(self, block: nn.Module, group=None):
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        experts = block.experts
        self.num_experts = experts.num_experts
        self.local = local_experts(self.num_experts, self.world, self.rank)
        self.gate, self.shared_expert = block.gate, block.shared_expert                  # replicated
        self.shared_expert_gate = block.shared_expert_gate
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj[self.local.start:self.local.stop].detach().clone())
        self.down_proj = nn.Parameter(experts.down_proj[self.local.start:self.local.stop].detach().clone())
        self.act_fn = experts.act_fn
        self.last: dict = {}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:       # [B, T, H] -> [B, T, H]
        shape, H = hidden_states.shape, hidden_states.shape[-1]
        x = hidden_states.reshape(-1, H)                                    # [N, H]
        _, weights, experts = self.gate(x)                                  # [N, k] each
        k, per = experts.shape[1], len(self.local)
        flat = experts.reshape(-1)                                          # [N*k] expert of each (token, slot)
        order = torch.argsort(flat // per, stable=True)                     # grouped by destination rank
        token = order // k                                                  # [N*k] the token of each sorted slot
        send = torch.bincount(flat // per, minlength=self.world)            # [R]
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.group)             # how many rows come from each rank
        send, receive = send.tolist(), receive.tolist()
        t0 = time.perf_counter()
        rows = exchange(x[token], receive, send, self.group)                # [n_recv, H] dispatch
        their_experts = exchange(flat[order], receive, send, self.group)    # [n_recv] (ids need no gradient)
        t1 = time.perf_counter()
        out = torch.zeros_like(rows)
        for e in self.local:
            pick = torch.nonzero(their_experts == e).squeeze(1)
            if pick.numel():
                gate, up = nn.functional.linear(rows[pick], self.gate_up_proj[e - self.local.start]).chunk(2, -1)
                y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e - self.local.start])
                out = out.index_add(0, pick, y)
        t2 = time.perf_counter()
        back = exchange(out, send, receive, self.group)                     # [N*k, H] combine, in sorted order
        t3 = time.perf_counter()
        routed = torch.zeros_like(x).index_add(0, token, back * weights.reshape(-1)[order, None].to(back.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        away, back_away = sum(send) - send[self.rank], sum(receive) - receive[self.rank]
        self.last = {"rows_received": sum(receive), "rows_sent_away": away,
                     "bytes_sent": (away + back_away) * H * x.element_size() + away * flat.element_size(),
                     "dispatch_seconds": t1 - t0, "expert_seconds": t2 - t1, "combine_seconds": t3 - t2}
        return (routed + shared).reshape(shape)


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
        job = torchrun("minirl.parallel.expert:expert_worker", world_size, flags, timeout=timeout, stream=progress)
        if job.returncode != 0 or not out.exists():
            raise RuntimeError(f"expert-parallel job (world_size={world_size}) failed with code {job.returncode}:\n"
                               f"{output_ends(job.stdout)}")
        return json.loads(out.read_text())
