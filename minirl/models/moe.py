# Generated from notebooks/02_mismatch.py, notebooks/08_moe_pipelines.py
# by tools/build.py -- edit the notebook, not this file.
"""Mixture-of-experts routing: Rollout Routing Replay (R3), and counting MoE parameters.

`replay_routes` makes a forward pass use recorded experts instead of its own top-k, with
routing weights from its own router probabilities at those experts, so the router keeps its
gradient. Building the tiny MoE policy, finding routers, recording routes and measuring
their agreement live in `minirl.runtime.moe_routes`.
"""

__all__ = ["replay_routes", "count_moe_parameters"]

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minirl.runtime.moe_routes import restore_forward, routers


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor):
    """Inside the block, every forward of `model` uses `routes` ([L, B, T, k]) as its experts.

    The routing weights are the model's own softmax(router logits) at the replayed experts
    (renormalized over the k when the router normalizes), so gradients still reach the
    router. Every forward inside must cover exactly the recorded [B, T] tokens.
    """
    found = routers(model)
    saved = [router.__dict__.get("forward") for router in found]
    if routes.dim() != 4 or routes.shape[0] != len(found):
        raise ValueError(f"routes has shape {tuple(routes.shape)}: "
                         f"expected [L={len(found)}, B, T, k]")
    for layer, router in enumerate(found):
        def replaying(hidden_states, _router=router, _routes=routes[layer]):
            hidden_states = hidden_states.reshape(-1, _router.weight.shape[1])
            index = _routes.reshape(-1, _routes.shape[-1]).to(hidden_states.device)     # [N, k]
            if index.shape[0] != hidden_states.shape[0]:
                raise ValueError(f"replay_routes: routes cover {index.shape[0]} tokens but this "
                                 f"forward has {hidden_states.shape[0]}; replay needs the recorded "
                                 "[B, T]")
            logits = F.linear(hidden_states, _router.weight)                             # [N, E]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, index)
            if getattr(_router, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index
        router.forward = replaying
    try:
        yield model
    finally:
        for router, previous in zip(found, saved, strict=True):
            restore_forward(router, previous)


def count_moe_parameters(config) -> dict[str, float]:
    """Total and active parameters of a transformers MoE config, counted on the meta device.

    A token activates all but the routed experts it is not sent to: active = total - routed x
    (1 - top_k / E); `active_without_embedding` also leaves out the input embedding (a lookup).
    """
    from transformers import AutoModelForCausalLM

    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        raise ValueError(f"{type(config).__name__} names no routed experts: not a MoE config")
    with torch.device("meta"):                                   # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    patterns = [("shared_experts", "shared_expert"), ("routed_experts", ".experts."),
                ("routers", ".mlp.gate."), ("input_embedding", "embed_tokens")]
    groups = dict.fromkeys([group for group, _ in patterns] + ["dense"], 0.0)
    for name, p in model.named_parameters():
        groups[next((group for group, key in patterns if key in name), "dense")] += p.numel()
    total = sum(groups.values())
    active = total - groups["routed_experts"] * (1 - top_k / num_experts)
    return {**groups, "total": total, "active": active,
            "active_without_embedding": active - groups["input_embedding"],
            "num_experts": num_experts, "top_k": top_k}
