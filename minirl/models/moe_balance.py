# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Expert load and its balancing: routing statistics per layer and expert, the Switch/GShard auxiliary
loss, and DeepSeek-V3's auxiliary-loss-free bias, on a router that replaces transformers' top-k router
in place (same parameter, same name in the state dict).

`load_balancing_loss` is minirl's convention, E * sum_e f_e * P_e with f_e the share of the
(token, slot) assignments: 1 when routing is even. transformers' `load_balancing_loss_func`
counts f_e per token (top_k times ours for one layer) and sums over layers, so one
coefficient pushes top_k times harder there (notebook 08 computes both on one router output).
"""

__all__ = ["RouterError", "check_router_logits", "load_balancing_loss", "expert_counts",
           "load_imbalance", "BalancedTopKRouter", "install_balancing", "load_history"]

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from minirl.models.moe import routers


class RouterError(FloatingPointError):
    """A router produced non-finite scores: the layer cannot choose experts."""


def check_router_logits(logits: Tensor, layer: str = "router") -> None:
    """Raise RouterError when router logits hold NaN or inf (usually an overflow upstream)."""
    if not torch.isfinite(logits).all():
        bad = (~torch.isfinite(logits)).any(-1).sum().item()
        raise RouterError(f"{layer}: router logits are not finite for {bad} of {logits.shape[0]} tokens; "
                          "look for an overflow before this layer (lower the learning rate, clip gradients, or "
                          "compute the router in float32)")


def load_balancing_loss(router_logits: Tensor, top_k: int, token_mask: Tensor | None = None) -> Tensor:
    """The Switch Transformer / GShard auxiliary loss of one MoE layer: E * sum_e f_e * P_e.

    router_logits: [N, E] float, one row per token. token_mask: [N] bool or 0/1, or None for
    all tokens; masked-out tokens (padding) count in neither term.
    f_e: the share of the N * top_k (token, slot) assignments that go to expert e (the top_k
    experts of softmax(router_logits) per token); a count, so it carries no gradient.
    P_e: the mean over tokens of softmax(router_logits)[:, e], with its gradient.
    Returns a 0-dim tensor: 1.0 when routing is perfectly even (f_e = P_e = 1/E), up to
    E / top_k when every token picks the same experts with full confidence. Its gradient
    lowers the probability of the experts that receive the most tokens.
    """
    num_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)                       # [N, E]
    chosen = probs.topk(top_k, dim=-1).indices                                 # [N, k]
    mask = torch.ones(probs.shape[0], device=probs.device) if token_mask is None else token_mask.float()
    counts = torch.zeros(num_experts, device=probs.device).index_add_(
        0, chosen.reshape(-1), mask.repeat_interleave(top_k))                  # [E]
    f = counts / (mask.sum() * top_k).clamp(min=1)
    P = (probs * mask[:, None]).sum(0) / mask.sum().clamp(min=1)               # [E]
    return num_experts * (f * P).sum()


def expert_counts(indices: Tensor, num_experts: int, token_mask: Tensor | None = None) -> Tensor:
    """Tokens per expert: indices [N, k] long, token_mask [N] -> [E] float counts (one per slot)."""
    weights = None if token_mask is None else token_mask.float().repeat_interleave(indices.shape[-1])
    return torch.bincount(indices.reshape(-1), weights=weights, minlength=num_experts).float()


def load_imbalance(counts: Tensor) -> dict[str, float]:
    """Summary of one load vector [E] (or a stack [..., E], averaged over the leading dims).

    max_over_mean: hottest expert's load over the mean load (1 = even; at most E / top_k).
    hottest_over_coldest: hottest over coldest (inf when an expert gets nothing).
    """
    counts = counts.reshape(-1, counts.shape[-1]).float()
    mean = counts.mean(-1).clamp(min=1e-12)
    hot, cold = counts.max(-1).values, counts.min(-1).values
    ratio = torch.where(cold > 0, hot / cold.clamp(min=1e-12), torch.full_like(hot, float("inf")))
    return {"max_over_mean": (hot / mean).mean().item(), "hottest_over_coldest": ratio.mean().item()}


class _AttachAuxLoss(torch.autograd.Function):
    """Return `x` unchanged; on backward, also send gradient 1 into `aux` (Megatron's MoEAuxLossAutoScaler).

    This adds a layer's balancing loss to whatever loss the training loop backpropagates,
    without the loop knowing about it.
    """

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, device=grad.device, dtype=torch.float32)


class BalancedTopKRouter(nn.Module):
    """A top-k router (transformers' Qwen2-MoE router, same forward contract) that keeps load statistics
    and can balance its experts in two ways.

    aux_loss_coef > 0: on every training forward (module.training and gradients enabled) the
    layer's `load_balancing_loss` times the coefficient joins the backward pass (Switch/GShard).
    bias_update_rate > 0: DeepSeek-V3's auxiliary-loss-free balancing: experts are *chosen* by
    softmax probability + `expert_bias` (the routing weights still come from the probabilities
    alone), and at the end of every optimizer step each expert's bias moves by
    rate * sign(mean load - its load): overloaded experts become less attractive, idle ones more.
    `history` holds one [E] vector of token counts per optimizer step (real tokens only, when
    the model's attention mask is known); `end_step` closes a step (`install_balancing` calls
    it after every optimizer step that updates this router).

    Simplified vs DeepSeek-V3: a softmax router (theirs scores with a sigmoid) and no
    node-limited routing; the bias is a persistent buffer, so the rollout copy receives it
    with the weights.
    """

    def __init__(self, router: nn.Module, aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0):
        super().__init__()
        for name, value in (("aux_loss_coef", aux_loss_coef), ("bias_update_rate", bias_update_rate)):
            if not value >= 0:
                raise ValueError(f"{name}={value}: must be >= 0 (0 turns it off)")
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.norm_topk_prob, self.hidden_dim = router.norm_topk_prob, router.hidden_dim
        self.weight = router.weight                                             # the same Parameter
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))      # synced like a weight
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        self.token_mask: Tensor | None = None                                   # [N] for the next forward
        self.pending: list[Tensor] = []                                         # counts since the last step
        self.history: list[Tensor] = []
        self.name = "router"

    def forward(self, hidden_states: Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)             # [N, H]
        logits = F.linear(hidden_states, self.weight)                          # [N, E]
        check_router_logits(logits, self.name)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        chosen = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices    # [N, k]
        weights = probs.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training and torch.is_grad_enabled():
            mask = self.token_mask if self.token_mask is not None and self.token_mask.numel() == len(chosen) else None
            self.pending.append(expert_counts(chosen, self.num_experts, mask).detach().cpu())   # [E]
            if self.aux_loss_coef:
                aux = self.aux_loss_coef * load_balancing_loss(logits, self.top_k, mask)
                weights = _AttachAuxLoss.apply(weights, aux)
        return logits, weights.to(logits.dtype), chosen

    def end_step(self) -> None:
        """Close an optimizer step: record its load and, with bias_update_rate, move the biases."""
        if not self.pending:
            return
        counts = torch.stack(self.pending).sum(0)                               # [E]
        self.pending.clear()
        self.history.append(counts)
        if self.bias_update_rate:
            with torch.no_grad():
                self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts).to(self.expert_bias)


def _capture_token_mask(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook: hand each balanced router the real-token mask of this call's new tokens."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    mask = kwargs.get("attention_mask")
    flat = None
    if ids is not None and mask is not None and mask.dim() == 2:
        flat = mask[:, -ids.shape[1]:].reshape(-1).bool()                       # [B*T] the tokens of this call
    for router in routers(model):
        if isinstance(router, BalancedTopKRouter):
            router.token_mask = flat


_STEP_HOOKS: list = []                     # (weak references to routers, hook handle), one per install


def _end_steps_after(routers_: list[BalancedTopKRouter]) -> None:
    """A global optimizer-step hook that closes the step of `routers_` when the stepping optimizer owns
    their weights. It holds weak references: once the routers are gone it does nothing, and the next
    install removes it (a hook cannot remove itself while the optimizer iterates over the hooks)."""
    for refs, handle in list(_STEP_HOOKS):
        if any(r() is None for r in refs):
            handle.remove()
            _STEP_HOOKS.remove((refs, handle))
    refs = [weakref.ref(r) for r in routers_]

    def hook(optimizer, args, kwargs):
        alive = [r() for r in refs]
        if any(r is None for r in alive):
            return
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for router in alive:
            if id(router.weight) in owned:
                router.end_step()
    _STEP_HOOKS.append((refs, register_optimizer_step_post_hook(hook)))


def install_balancing(model: nn.Module, aux_loss_coef: float = 0.0,
                      bias_update_rate: float = 0.0) -> list[BalancedTopKRouter]:
    """Replace every top-k router of `model` by a BalancedTopKRouter sharing its weight; returns them.

    With both rates 0 the model computes exactly what it did (the routers only keep statistics).
    Call it before building the optimizer or a rollout copy (the copy then gets the same routers,
    and `expert_bias` travels with the weights). A forward pre-hook passes the attention mask to
    the routers, so padding never counts as load; an optimizer-step hook closes each step, so
    any training loop that steps an optimizer over the model records one load vector per step.
    """
    if any(isinstance(r, BalancedTopKRouter) for r in routers(model)):
        raise ValueError("install_balancing: this model's routers are already balanced routers; build or load "
                         "a fresh model to change the settings")
    targets = {id(r) for r in routers(model)}
    if not targets:
        raise ValueError(f"{type(model).__name__} has no MoE routers to balance")
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in targets:
                setattr(parent, child_name, BalancedTopKRouter(child, aux_loss_coef, bias_update_rate))
    installed = routers(model)
    for i, router in enumerate(installed):
        router.name = f"layer {i} router"
    model.register_forward_pre_hook(_capture_token_mask, with_kwargs=True)
    _end_steps_after(installed)
    return installed


def load_history(model: nn.Module) -> Tensor:
    """Token counts per expert of every training forward so far: [forwards, L, E] float."""
    found = [r for r in routers(model) if isinstance(r, BalancedTopKRouter)]
    if not found:
        raise ValueError("no BalancedTopKRouter in this model: call install_balancing(model) before training")
    steps = min(len(r.history) for r in found)
    if steps == 0:
        return torch.zeros(0, len(found), found[0].num_experts)
    return torch.stack([torch.stack(r.history[:steps]) for r in found], dim=1)
