"""Installing notebook 08's balancing router into any model, so that any training loop balances its experts.

Hand-written (hooks and module surgery; the balancing itself, the auxiliary loss and DeepSeek-V3's bias,
is taught in notebook 08 and lives in `minirl.models.moe_balance.BalancedTopKRouter`).

- `install_balancing(model, aux_loss_coef, bias_update_rate)` replaces every top-k router of a
  transformers MoE by a `BalancedTopKRouter` that shares its weight (the state dict keeps its names and
  gains one buffer, `expert_bias`), and installs two hooks: a forward pre-hook on the model that hands the
  routers the attention mask of the call's new tokens (padding never counts as load), and a global
  optimizer-step hook that calls each router's `end_step` whenever an optimizer that owns the router's
  weight steps. The training loop needs to know nothing: it steps its optimizer, the routers record one
  load vector per step and, with a bias rate, move their biases.
- `load_history(model)` reads those load vectors back: [steps, layers, experts] token counts.
- `balancing_runs(moe, tokenizer, settings, steps)` is notebook 08's experiment: one RL run per setting
  (none, auxiliary loss, bias) from copies of one MoE, returning each run's load history and accuracy.

Call `install_balancing` before building the optimizer or a rollout copy (the copy then gets the same
routers, and `expert_bias` travels with the weights). The step hook holds weak references: once the routers
are gone it does nothing, and the next install removes it (a hook cannot remove itself while the optimizer
iterates over its hooks).
"""
import weakref

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from minirl.models.moe_balance import BalancedTopKRouter
from minirl.runtime.moe_routes import routers


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
    their weights (see the module docstring for why it holds weak references)."""
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
    """Token counts per expert of every optimizer step so far: [steps, L, E] float."""
    found = [r for r in routers(model) if isinstance(r, BalancedTopKRouter)]
    if not found:
        raise ValueError("no BalancedTopKRouter in this model: call install_balancing(model) before training")
    steps = min(len(r.history) for r in found)
    if steps == 0:
        return torch.zeros(0, len(found), found[0].num_experts)
    return torch.stack([torch.stack(r.history[:steps]) for r in found], dim=1)


def balancing_runs(moe: nn.Module, tokenizer, settings: dict[str, dict], steps: int, prompts_per_step: int = 16,
                   progress: bool = False) -> dict[str, dict]:
    """One RL run of the stage-1 loop per entry of `settings` (name -> install_balancing keyword arguments),
    each from a copy of `moe`: {name: {"history": [steps, L, E] load, "per_step": [steps] hottest expert
    over the mean (averaged over layers), "accuracy": held-out accuracy at the start and the end}}."""
    import copy

    from minirl.config import RLConfig
    from minirl.models.moe_balance import load_imbalance
    from minirl.train.run import train

    runs = {}
    for name, kwargs in settings.items():
        model = copy.deepcopy(moe)
        install_balancing(model, **kwargs)
        config = RLConfig.from_flat(steps=steps, prompts_per_step=prompts_per_step, eval_every=steps)
        metrics = train(config, model, tokenizer, progress=progress)
        history = load_history(model)
        runs[name] = {"history": history, "accuracy": [m["accuracy"] for m in metrics if "accuracy" in m],
                      "per_step": torch.tensor([load_imbalance(h)["max_over_mean"] for h in history])}
    return runs
