# Generated from notebooks/02_mismatch.py, notebooks/08_moe_pipelines.py
# by tools/build.py -- edit the notebook, not this file.
"""Mixture-of-experts routing: a tiny Qwen2-MoE policy, route recording and replay (R3).

`RouteRecorder` records which experts every router picks, call by call (so it works during
KV-cached generation: one prefill call, then one call per new token). `replay_routes` makes
a later forward pass use recorded experts instead of its own top-k, with routing weights
taken from its own router probabilities at those experts (so the router keeps its
gradient): Rollout Routing Replay. `minirl.diagnostics.mismatch.compare_routes` measures route
agreement and the log-prob gap with and without replay.

Simplified on purpose: routers are found by duck typing on transformers' TopKRouter modules
(`top_k`, `num_experts`, `weight`, forward -> (logits, weights, indices)); production R3
(in slime, veRL with SGLang/vLLM) ships the routes from the inference server with the
tokens. The mechanism is the same.
"""

__all__ = ["build_moe_policy", "routers", "RouteRecorder", "replay_routes", "route_agreement",
           "count_moe_parameters"]

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def build_moe_policy(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_experts: int = 8,
                     top_k: int = 2, max_length: int = 32, seed: int = 0):
    """A freshly initialized tiny Qwen2MoeForCausalLM (about 0.25 M parameters by default)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        max_position_embeddings=max_length, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    return Qwen2MoeForCausalLM(config)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, one per MoE layer, in layer order ([] for a dense model)."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("top_k", "num_experts",
                                           "weight")) and type(m).__name__.endswith("Router")]


class RouteRecorder:
    """`with RouteRecorder(model) as rec: ...` then `rec.routes(batch_size)` -> [L, B, T, k]."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE routers to record")
        self.calls: list[list[Tensor]] = [[] for _ in self.routers]

    def __enter__(self):
        self._saved = [router.__dict__.get("forward") for router in self.routers]   # an outer patch
        for i, router in enumerate(self.routers):
            original = router.forward

            def recording(hidden_states, _i=i, _original=original):
                out = _original(hidden_states)
                self.calls[_i].append(out[2].detach().clone())       # [tokens of this call, k]
                return out
            router.forward = recording                 # an instance attribute shadows the class
        return self

    def __exit__(self, *exc):
        for router, saved in zip(self.routers, self._saved, strict=True):
            _restore_forward(router, saved)

    def routes(self, batch_size: int) -> Tensor:
        """Every call's experts, stitched along time: [L, B, T, k] long (T: tokens seen per row)."""
        layers = []
        for calls in self.calls:
            k = calls[0].shape[-1]
            layers.append(torch.cat([c.view(batch_size, -1, k) for c in calls], dim=1))
        return torch.stack(layers)


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
            _restore_forward(router, previous)


def _restore_forward(module: nn.Module, saved) -> None:
    """Undo an instance-level forward patch: put back the outer patch, or fall back to the class."""
    if saved is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


def route_agreement(routes_a: Tensor, routes_b: Tensor, token_mask: Tensor | None = None) -> float:
    """Share of (layer, token) pairs whose top-k expert *sets* agree.

    routes_a, routes_b: [L, B, T, k]; token_mask: [B, T] (None: every token)."""
    if routes_a.shape != routes_b.shape:
        raise ValueError(f"routes_a {tuple(routes_a.shape)} and routes_b {tuple(routes_b.shape)} "
                         "must both be [L, B, T, k] over the same tokens")
    same = (routes_a.sort(-1).values == routes_b.sort(-1).values).all(-1).double()   # [L, B, T]
    if token_mask is None:
        return same.mean().item()
    m = token_mask.bool().expand_as(same)
    return same[m].mean().item() if m.any() else 1.0


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
