# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Expert parallelism: a Qwen2-MoE layer's experts split across ranks, tokens sent with all-to-all.

Simplified on purpose: no capacity factor or token dropping, no overlap of the exchange with
compute (DeepEP's job)."""

__all__ = ["local_experts", "exchange", "ExpertParallelMoE"]

import time

import torch
import torch.distributed as dist
from torch import nn


def local_experts(num_experts: int, world_size: int, rank: int) -> range:
    """The experts rank `rank` holds: an equal contiguous slice of `num_experts`."""
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}: "
                         "every rank holds the same number of experts; change one of them")
    per = num_experts // world_size
    return range(rank * per, (rank + 1) * per)


def exchange(x: torch.Tensor, receive_counts: list[int], send_counts: list[int],
             group=None) -> torch.Tensor:
    """all_to_all_single with autograd: sum(send_counts) rows out, sum(receive_counts) in."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(receive_counts), *x.shape[1:]))
    if not x.requires_grad:
        dist.all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=group)
        return out
    return all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=group)


class ExpertParallelMoE(nn.Module):
    """One rank's share of a Qwen2-MoE sparse block: all of its router and shared expert, its
    slice of the routed experts. `last` holds the latest forward's traffic and timings."""

    def __init__(self, block: nn.Module, group=None):
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        experts = block.experts
        self.num_experts = experts.num_experts
        self.local = local_experts(self.num_experts, self.world, self.rank)
        self.gate, self.shared_expert = block.gate, block.shared_expert            # replicated
        self.shared_expert_gate = block.shared_expert_gate
        mine = slice(self.local.start, self.local.stop)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj[mine].detach().clone())
        self.down_proj = nn.Parameter(experts.down_proj[mine].detach().clone())
        self.act_fn = experts.act_fn
        self.last: dict = {}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:    # [B, T, H] -> [B, T, H]
        shape, H = hidden_states.shape, hidden_states.shape[-1]
        x = hidden_states.reshape(-1, H)                                 # [N, H]
        _, weights, experts = self.gate(x)                               # [N, k] each
        k, per = experts.shape[1], len(self.local)
        flat = experts.reshape(-1)                                       # [N*k] expert per slot
        order = torch.argsort(flat // per, stable=True)                  # grouped by destination
        token = order // k                                               # [N*k] token of each row
        send = torch.bincount(flat // per, minlength=self.world)         # [R] rows per rank
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.group)          # rows coming from each
        send, receive = send.tolist(), receive.tolist()
        t0 = time.perf_counter()
        rows = exchange(x[token], receive, send, self.group)             # [n_recv, H] dispatch
        their_experts = exchange(flat[order], receive, send, self.group)  # [n_recv] expert ids
        t1 = time.perf_counter()
        out = torch.zeros_like(rows)
        for e in self.local:
            pick = torch.nonzero(their_experts == e).squeeze(1)
            if pick.numel():
                i = e - self.local.start
                gate, up = nn.functional.linear(rows[pick], self.gate_up_proj[i]).chunk(2, -1)
                y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[i])
                out = out.index_add(0, pick, y)
        t2 = time.perf_counter()
        back = exchange(out, send, receive, self.group)                  # [N*k, H] combine
        t3 = time.perf_counter()
        mix = weights.reshape(-1)[order, None].to(back.dtype)            # [N*k, 1] sorted order
        routed = torch.zeros_like(x).index_add(0, token, back * mix)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        away, back_away = sum(send) - send[self.rank], sum(receive) - receive[self.rank]
        sent = (away + back_away) * H * x.element_size() + away * flat.element_size()
        self.last = {"rows_received": sum(receive), "rows_sent_away": away, "bytes_sent": sent,
                     "dispatch_seconds": t1 - t0, "expert_seconds": t2 - t1,
                     "combine_seconds": t3 - t2}
        return (routed + shared).reshape(shape)
