# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Expert load and its balancing: the Switch/GShard auxiliary loss (minirl's convention: f_e per
(token, slot), 1 when even) and DeepSeek-V3's loss-free bias, in a drop-in top-k router."""

__all__ = ["load_balancing_loss", "expert_counts", "load_imbalance", "BalancedTopKRouter"]

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minirl.runtime.moe_checks import check_router_logits


def load_balancing_loss(router_logits: Tensor, top_k: int,
                        token_mask: Tensor | None = None) -> Tensor:
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
    mask = (torch.ones(probs.shape[0], device=probs.device) if token_mask is None
            else token_mask.float())                                           # [N]
    counts = torch.zeros(num_experts, device=probs.device).index_add_(
        0, chosen.reshape(-1), mask.repeat_interleave(top_k))                  # [E]
    f = counts / (mask.sum() * top_k).clamp(min=1)
    P = (probs * mask[:, None]).sum(0) / mask.sum().clamp(min=1)               # [E]
    return num_experts * (f * P).sum()


def expert_counts(indices: Tensor, num_experts: int, token_mask: Tensor | None = None) -> Tensor:
    """Tokens per expert: indices [N, k] long, token_mask [N] -> [E] float counts (one per slot)."""
    k = indices.shape[-1]
    weights = None if token_mask is None else token_mask.float().repeat_interleave(k)
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
    return {"max_over_mean": (hot / mean).mean().item(),
            "hottest_over_coldest": ratio.mean().item()}


class _AttachAuxLoss(torch.autograd.Function):
    """Return `x` unchanged; on backward, also send gradient 1 into `aux` (the balancing loss)."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, device=grad.device, dtype=torch.float32)


class BalancedTopKRouter(nn.Module):
    """transformers' Qwen2-MoE top-k router (same forward contract), keeping load statistics.

    aux_loss_coef > 0: on every training forward the layer's `load_balancing_loss` times the
    coefficient joins the backward pass (Switch/GShard).
    bias_update_rate > 0: DeepSeek-V3's balancing: experts are *chosen* by probability +
    `expert_bias` (the mixing weights ignore it), and after every optimizer step each bias moves
    by rate * sign(mean load - its load). `history`: one [E] count vector per optimizer step.
    Simplified vs DeepSeek-V3: softmax scores (theirs: sigmoid), no node-limited routing.
    """

    def __init__(self, router: nn.Module, aux_loss_coef: float = 0.0,
                 bias_update_rate: float = 0.0):
        super().__init__()
        if not (aux_loss_coef >= 0 and bias_update_rate >= 0):
            raise ValueError(f"aux_loss_coef={aux_loss_coef}, bias_update_rate={bias_update_rate}: "
                             "each must be >= 0 (0 turns it off)")
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.norm_topk_prob, self.hidden_dim = router.norm_topk_prob, router.hidden_dim
        self.weight = router.weight                                         # the same Parameter
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))  # synced like a weight
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        self.token_mask: Tensor | None = None              # [N] real tokens of the next forward
        self.pending: list[Tensor] = []                    # counts since the last step
        self.history: list[Tensor] = []
        self.name = "router"

    def forward(self, hidden_states: Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)         # [N, H]
        logits = F.linear(hidden_states, self.weight)                      # [N, E]
        check_router_logits(logits, self.name)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        chosen = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices   # [N, k]
        weights = probs.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training and torch.is_grad_enabled():
            mask = self.token_mask
            mask = mask if mask is not None and mask.numel() == len(chosen) else None
            self.pending.append(expert_counts(chosen, self.num_experts, mask).detach().cpu())
            if self.aux_loss_coef:
                aux = self.aux_loss_coef * load_balancing_loss(logits, self.top_k, mask)
                weights = _AttachAuxLoss.apply(weights, aux)
        return logits, weights.to(logits.dtype), chosen

    def end_step(self) -> None:
        """Close an optimizer step: record its load and, with bias_update_rate, move the biases."""
        if not self.pending:
            return
        counts = torch.stack(self.pending).sum(0)                           # [E]
        self.pending.clear()
        self.history.append(counts)
        if self.bias_update_rate:
            with torch.no_grad():
                step = self.bias_update_rate * torch.sign(counts.mean() - counts)   # to the mean
                self.expert_bias += step.to(self.expert_bias)
