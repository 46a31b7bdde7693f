"""The critic (PPO): a value model and its optimizer; values before the update, and its own update.

Hand-written beside its concept (notebook 01 teaches the value loss and GAE it serves; the role
is a wrapper). `values(rollout)`: V(s_t) of every completion token under the value model
(`minirl.models.critic.ValueModel`), before the update; `update(experience)`: one clipped
value-loss step (`minirl.algo.losses.value_loss`) toward the GAE returns, skipped when the loss
or its gradient is not finite (`minirl.runtime.gauges.optimizer_step`). Under FSDP (notebook 04)
or in a Ray actor (notebook 06) a critic keeps these methods.

Simplified vs TRL's PPOTrainer / veRL: one clipped value-loss step per batch.
"""

__all__ = ["Critic"]

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.algo.losses import value_loss
from minirl.config import AlgorithmConfig, OptimizerConfig
from minirl.data import Experience, Rollout
from minirl.models.critic import ValueModel
from minirl.runtime.gauges import optimizer_step


class Critic:
    """V(s_t) for every completion token, fitted to the GAE returns."""

    def __init__(self, value_model: ValueModel, algorithm: AlgorithmConfig, optimizer: OptimizerConfig):
        self.model = value_model.eval()
        self.algorithm = algorithm
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(value_model.parameters(), lr=optimizer.value_learning_rate,
                                           weight_decay=optimizer.weight_decay)

    @torch.no_grad()
    def values(self, rollout: Rollout) -> Tensor:
        """[N, C] float32 values of the states before each completion token; 0 after the completion."""
        return self.model(rollout.input_ids, rollout.attention_mask, rollout.num_completion_tokens) \
            * rollout.completion_mask

    def update(self, exp: Experience) -> dict:
        """One clipped value-loss step toward `exp.returns`."""
        ro = exp.rollout
        self.model.train()
        values = self.model(ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
        loss = value_loss(values, exp.values, exp.returns, ro.completion_mask, self.algorithm.cliprange_value,
                          self.algorithm.loss_type)
        stepped, grad_norm = optimizer_step(self.model.parameters(), self.optimizer, loss, self.max_grad_norm)
        self.model.eval()
        return {"value_loss": loss.item(), "value_grad_norm": grad_norm, "value_skipped": int(not stepped),
                "value_mean": masked_mean(exp.values, ro.completion_mask).item()}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
