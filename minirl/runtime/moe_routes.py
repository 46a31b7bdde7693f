"""The tiny mixture-of-experts policy and the tools around routing: find, record, compare.

Notebook 02 teaches Rollout Routing Replay (R3, `minirl.models.moe.replay_routes`): the
trainer's forward uses the experts the rollout engine chose. This module holds what R3 needs
around it, none of which is the idea itself:

- `build_moe_policy`: a freshly initialized tiny `Qwen2MoeForCausalLM` (8 experts, top-2,
  a shared expert, as Qwen's MoE models), about 0.25 M parameters by default;
- `routers`: a model's top-k routers, found by duck typing on transformers' TopKRouter
  modules (`top_k`, `num_experts`, `weight`, forward -> (logits, weights, indices));
- `RouteRecorder`: records the experts every router picks, call by call, so it works during
  KV-cached generation (one prefill call, then one call per new token);
- `route_agreement`: the share of (layer, token) pairs whose top-k expert sets agree;
- `restore_forward`: undoes an instance-level patch of a router's forward (the recorder and
  `replay_routes` both patch, and may be nested).

Production R3 (slime, veRL with SGLang/vLLM) ships the routes from the inference server with
the tokens; the mechanism is the same.
"""
import torch
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


def restore_forward(module: nn.Module, saved) -> None:
    """Undo an instance-level forward patch: put back the outer patch, or fall back to the class."""
    if saved is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


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
            restore_forward(router, saved)

    def routes(self, batch_size: int) -> Tensor:
        """Every call's experts, stitched along time: [L, B, T, k] long (T: tokens seen per row)."""
        layers = []
        for calls in self.calls:
            k = calls[0].shape[-1]
            layers.append(torch.cat([c.view(batch_size, -1, k) for c in calls], dim=1))
        return torch.stack(layers)


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
