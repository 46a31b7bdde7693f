# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""The actor: the policy being trained, with its optimizer, answering the loop's three questions.

`logprobs(rollout)`: the trainer's log-probs of the sampled tokens before the update;
`update(experience)`: `num_iterations` clipped-objective steps, returning metrics;
`named_weights()`: what the weight sync pushes to the rollout engine. Under FSDP
(notebook 04) or inside a Ray actor (notebook 06) an actor keeps these methods, so the step
that calls them never changes.

Simplified vs TRL's GRPOTrainer: one optimizer step per batch and iteration (no gradient
accumulation or micro-batches), no learning-rate schedule.
"""

__all__ = ["optimizer_step", "ratio_statistics", "Actor"]

import math

import torch
from torch import Tensor

from minirl.algo.logprobs import completion_logprobs, masked_mean
from minirl.algo.losses import policy_loss
from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience, Rollout


def optimizer_step(params, optimizer, loss: Tensor, max_grad_norm: float) -> tuple[bool, float]:
    """backward, clip, step, unless the loss or the gradient norm is not finite. Returns (stepped, grad_norm).

    A non-finite batch leaves the weights and the optimizer's moments as they were.
    """
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False, math.nan
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    return True, grad_norm


def ratio_statistics(trainer_logps: Tensor, behavior_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout's behaviour log-probs are from the trainer's, per token (notebook 02's lens).

    ratio = exp(trainer - behaviour) over the tokens where mask is 1: its min, max, std and
    the share outside [0.8, 1.25]; and the mean |trainer - behaviour| log-prob gap.
    """
    valid = mask.bool()
    ratio = torch.exp(trainer_logps - behavior_logps)[valid]
    if ratio.numel() == 0:
        return {}
    return {"logprob_diff_abs": masked_mean((trainer_logps - behavior_logps).abs(), mask).item(),
            "ratio/min": ratio.min().item(), "ratio/max": ratio.max().item(),
            "ratio/std": ratio.std().item() if ratio.numel() > 1 else 0.0,
            "ratio/outside": ((ratio < 0.8) | (ratio > 1.25)).float().mean().item()}


class Actor:
    """The policy being trained and its AdamW optimizer."""

    def __init__(self, model, algorithm: AlgorithmConfig, optimizer: OptimizerConfig, sampling: SamplingConfig):
        self.model = model.eval()
        self.algorithm, self.sampling = algorithm, sampling
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.learning_rate,
                                           weight_decay=optimizer.weight_decay)

    def _logprobs(self, rollout: Rollout, with_entropy: bool = False):
        return completion_logprobs(self.model, rollout.input_ids, rollout.attention_mask,
                                   rollout.num_completion_tokens, self.sampling.temperature,
                                   with_entropy=with_entropy, num_generations=rollout.num_generations)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """log pi(y_t | ...) of every completion token under the current weights: [N, C] float32."""
        return self._logprobs(rollout)[0]

    def update(self, exp: Experience) -> dict:
        """`num_iterations` optimizer steps on this batch; returns the last step's metrics.

        The first iteration's log-probs are pi_old when `exp.old_logps` is None (one update
        per batch: the ratio is 1 and only its gradient matters).
        """
        ro, algo = exp.rollout, self.algorithm
        mask = ro.completion_mask
        self.model.train()
        metrics = {}
        for _ in range(algo.num_iterations):
            logps, entropy = self._logprobs(ro, with_entropy=True)                 # [N, C] each
            old = logps.detach() if exp.old_logps is None else exp.old_logps
            loss, metrics = policy_loss(
                logps, old, exp.advantages, mask, epsilon=algo.epsilon, epsilon_high=algo.epsilon_high,
                loss_type=algo.loss_type, importance_sampling_level=algo.importance_sampling_level,
                beta=algo.beta if algo.algo == "grpo" else 0.0, ref_logps=exp.ref_logps,
                max_completion_length=self.sampling.max_completion_length, is_weights=exp.is_weights,
                use_bias_correction_kl=algo.use_bias_correction_kl)
            stepped, grad_norm = optimizer_step(self.model.parameters(), self.optimizer, loss, self.max_grad_norm)
            metrics.update(loss=loss.item(), grad_norm=grad_norm, skipped=int(not stepped),
                           entropy=masked_mean(entropy.detach(), mask).item(),
                           **ratio_statistics(old, ro.logprobs, mask))   # rollout vs trainer (notebook 02)
        self.model.eval()
        return metrics

    def named_weights(self):
        """(name, tensor) for every entry of the policy's state_dict: what the engine must load."""
        return self.model.state_dict().items()

    def state_dict(self) -> dict:
        """The optimizer's state (the weights are saved in Hugging Face format, beside it)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
