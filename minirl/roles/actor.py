# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""The actor: the policy being trained, with its optimizer, answering the loop's three questions.

`logprobs(rollout)` before the update, `update(experience)`, and `named_weights()` for the sync.
Simplified vs TRL: one optimizer step per batch and iteration, no learning-rate schedule.
"""

__all__ = ["Actor"]

import math

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.algo.losses import policy_loss
from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience, Rollout
from minirl.loss_types import loss_type_entry
from minirl.runtime.gauges import clipped_step, ratio_statistics
from minirl.runtime.prefix_sharing import MicroBatchedLogprobs, micro_batches


class Actor:
    """The policy being trained and its AdamW optimizer."""

    def __init__(self, model, algorithm: AlgorithmConfig, optimizer: OptimizerConfig, sampling: SamplingConfig):
        self.model = model.eval()
        self.algorithm, self.sampling = algorithm, sampling
        self.max_grad_norm = optimizer.max_grad_norm
        self.max_tokens_per_microbatch = optimizer.max_tokens_per_microbatch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.learning_rate,
                                           weight_decay=optimizer.weight_decay)

    def micro_batches(self, rollout: Rollout) -> list[list[int]]:
        """The rows of each micro-batch of this rollout (section 10.3)."""
        return micro_batches(rollout.completion_mask.sum(1).tolist(), self.max_tokens_per_microbatch)

    def _shares_prompt(self) -> bool:
        return True                          # each group's prompt computed once (section 10.1)

    def _scorer(self, rollout: Rollout, requires_grad: bool) -> MicroBatchedLogprobs:
        return MicroBatchedLogprobs(self.model, rollout, self.micro_batches(rollout), self.sampling.temperature,
                                    self._shares_prompt(), requires_grad)

    def _micro_logprobs(self, scorer: MicroBatchedLogprobs, k: int, with_entropy: bool = False):
        return scorer(k, with_entropy)       # micro-batch k's (logps, entropy); notebook 04 weights its gradient here

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """log pi(y_t | ...) of every completion token under the current weights: [N, C] float32, 0 where masked."""
        scorer = self._scorer(rollout, requires_grad=False)
        out = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        for k, (rows, width) in enumerate(zip(scorer.rows, scorer.widths, strict=True)):
            out[rows, :width] = self._micro_logprobs(scorer, k)[0]
        return out * rollout.completion_mask

    def backward(self, exp: Experience) -> dict:
        """The gradient of the batch's loss, accumulated in .grad over the micro-batches; returns the metrics.

        Each micro-batch's loss is weighted by its share of the batch's normalization, so the
        gradients add up to the whole batch's. A non-finite loss ends the backward passes (loss NaN).
        """
        ro, algo = exp.rollout, self.algorithm
        mask = ro.completion_mask                                                  # [N, C]
        logps, entropy = torch.zeros(mask.shape, device=mask.device), torch.zeros(mask.shape, device=mask.device)
        total_rows, total_tokens = len(ro), float(mask.sum())
        weigh = loss_type_entry(algo.loss_type).micro_batch_weight
        scorer, finite = self._scorer(ro, requires_grad=True), True
        for k, (rows, width) in enumerate(zip(scorer.rows, scorer.widths, strict=True)):
            part = lambda t, rows=rows, width=width: (  # noqa: E731
                t if t is None else t[rows] if t.dim() == 1 else t[rows, :width])
            lp, ent = self._micro_logprobs(scorer, k, with_entropy=True)            # [n, width] each
            loss, _ = self._loss(lp, lp.detach() if exp.old_logps is None else part(exp.old_logps),
                                 part(exp.advantages), mask[rows, :width], part(exp.ref_logps), part(exp.is_weights))
            weight = weigh(len(rows), total_rows, float(mask[rows].sum()), total_tokens)
            finite = finite and bool(torch.isfinite(loss))
            if finite:
                (loss * weight).backward()
            logps[rows, :width], entropy[rows, :width] = lp.detach(), ent.detach()
        if finite:
            scorer.backward()                                                      # the shared prompts' share
        old = logps if exp.old_logps is None else exp.old_logps
        with torch.no_grad():                                                      # the batch's loss, as one pass
            loss, metrics = self._loss(logps, old, exp.advantages, mask, exp.ref_logps, exp.is_weights)
        return metrics | {"loss": loss.item() if finite else math.nan,
                          "entropy": masked_mean(entropy, mask).item(),
                          **ratio_statistics(old, ro.logprobs, mask)}              # rollout vs trainer (notebook 02)

    def _loss(self, logps, old_logps, advantages, mask, ref_logps, is_weights):
        algo = self.algorithm
        return policy_loss(logps, old_logps, advantages, mask, epsilon=algo.epsilon, epsilon_high=algo.epsilon_high,
                           loss_type=algo.loss_type, importance_sampling_level=algo.importance_sampling_level,
                           beta=algo.beta if algo.algo == "grpo" else 0.0, ref_logps=ref_logps,
                           max_completion_length=self.sampling.max_completion_length, is_weights=is_weights,
                           use_bias_correction_kl=algo.use_bias_correction_kl)

    def update(self, exp: Experience) -> dict:
        """`num_iterations` optimizer steps on this batch; returns the last step's metrics.

        The first iteration's log-probs are pi_old when `exp.old_logps` is None (one update
        per batch: the ratio is 1 and only its gradient matters).
        """
        self.model.train()
        metrics = {}
        for _ in range(self.algorithm.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            metrics = self.backward(exp)
            if math.isfinite(metrics["loss"]):
                stepped, grad_norm = clipped_step(self.model.parameters(), self.optimizer, self.max_grad_norm)
            else:
                self.optimizer.zero_grad(set_to_none=True)
                stepped, grad_norm = False, math.nan
            metrics.update(grad_norm=grad_norm, skipped=int(not stepped))
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
