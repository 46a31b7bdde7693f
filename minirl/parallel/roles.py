# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""Notebook 01's Actor and Critic on every rank of a data-parallel job, each loss weighted.

The weight (the loss type's `rank_weight`) is applied as a gradient scale on the output of
the training forward (the actor's log-probs, the critic's values), so notebook 01's `update`
runs unchanged. Simplified: with beta > 0 the reference is a whole copy on every rank.
"""

__all__ = ["scale_gradient", "LOSSES", "reduce_metrics", "DataParallelRole", "DistributedActor",
           "DistributedCritic"]

import math

import torch
from torch import Tensor

from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience
from minirl.loss_types import loss_type_entry
from minirl.memory.wrap import Wrapped, make_optimizer
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.runtime.lockstep import LockstepActor, ReplicatedState, finite_batch, pad_completions


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    """`x` unchanged in value; the gradient flowing back through it is multiplied by `scale`."""
    return _ScaleGradient.apply(x, scale)


LOSSES = ("loss", "value_loss")       # a role's loss: the batch's is (1/W) sum_r w_r loss_r


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def reduce_metrics(records: list[dict], tokens: list[float], loss_weights: list[float] | None = None
                   ) -> dict:
    """The ranks' update metrics as one record (the same on every rank that reduces the same lists).

    records[r], tokens[r]: rank r's metrics and completion tokens; loss_weights[r]: its w_r, or
    None. "/min" keys: the global min; "/max" and "skipped": the global max; "grad_norm": rank
    0's (already global); a loss (`LOSSES`) with weights: (1 / W) sum_r w_r loss_r; any other
    number: the token-weighted mean of the ranks'. Anything else, or a key some rank lacks:
    rank 0's. One rank: its record unchanged.
    """
    if len(records) == 1:
        return dict(records[0])
    total = sum(tokens) or 1.0
    out = {}
    for key, value in records[0].items():
        values = [r.get(key) for r in records]
        if not all(_number(v) for v in values):
            out[key] = value
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith(("/max", "skipped")):
            out[key] = max(values)
        elif key.endswith("grad_norm"):
            out[key] = value
        elif key in LOSSES and loss_weights is not None:
            out[key] = sum(w * v for w, v in zip(loss_weights, values, strict=True)) / len(records)
        else:
            out[key] = sum(v * t for v, t in zip(values, tokens, strict=True)) / total
    return out


class DataParallelRole(ReplicatedState):
    """What makes one of notebook 01's trained roles data-parallel; before `Actor` or `Critic`.

    A role calls `_join` and passes the output of its training forward through `_weighted`.
    Every rank must call `update` together. Checkpointing: `ReplicatedState` (runtime/lockstep.py).
    """

    skip_field = "advantages"           # the field the role's loss reads, made NaN to skip
    loss_key = "loss"

    def _join(self, wrapped: Wrapped, group) -> None:
        self.module, self.zero, self.group = wrapped.module, wrapped.zero, group
        self.grad_scale, self.skipping = 1.0, False

    def _weighted(self, output: Tensor) -> Tensor:
        """The training forward's output: NaN on every rank if it is not finite on one; its gradient
        scaled by w_r. Forwards without gradient pass untouched."""
        if not output.requires_grad:
            return output
        bad = float(not torch.isfinite(output).all())
        if not self.skipping and self.group.all_sum([bad]).item():
            output = output * math.nan                       # not finite on a rank: all skip
        if self.grad_scale != 1.0:
            output = scale_gradient(output, self.grad_scale)
        return output

    def update(self, exp: Experience) -> dict:
        """The role's update on this rank's rows, weighted by its `rank_weight`; the ranks' record
        (plus "<loss_key>_weight": rank 0's w). A batch not finite on any rank: every rank skips."""
        exp = pad_completions(exp, self.group.all_max(exp.rollout.num_completion_tokens))
        mask = exp.rollout.completion_mask
        tokens, rows = float(mask.sum()), len(exp.rollout)
        bad = float(not finite_batch(exp))
        total_tokens, total_rows, bad = self.group.all_sum([tokens, rows, bad]).tolist()
        if bad:                                  # a NaN on any rank: every rank skips, none waits
            setattr(exp, self.skip_field, torch.full_like(getattr(exp, self.skip_field), math.nan))
        rank_weight = loss_type_entry(self.algorithm.loss_type).rank_weight
        weight = rank_weight(tokens, total_tokens, rows, total_rows, self.group.world_size)
        self.grad_scale, self.skipping = weight, bool(bad)
        try:
            metrics = super().update(exp)
        finally:
            self.grad_scale, self.skipping = 1.0, False
        records, rank_tokens, weights = (list(column) for column in zip(*self.group.gather_objects(
            (metrics, tokens, weight)), strict=True))
        record = reduce_metrics(records, rank_tokens, weights)
        return record | {f"{self.loss_key}_weight": weights[0]}


class DistributedActor(DataParallelRole, LockstepActor, Actor):
    """Notebook 01's Actor on one rank of a data-parallel job.

    wrapped: from `wrap_model`; `self.model` is what gets called (the DDP wrapper or the FSDP2
    model), `self.module` the model underneath. checkpointing: the layers are recomputed in
    backward, and transformers then turns the KV cache off (no shared prompt pass).
    """

    def __init__(self, wrapped: Wrapped, algorithm: AlgorithmConfig, optimizer: OptimizerConfig,
                 sampling: SamplingConfig, group, checkpointing: bool = False):
        super().__init__(wrapped.wrapper, algorithm, optimizer, sampling)
        self._join(wrapped, group)
        self.checkpointing = checkpointing
        self.optimizer = make_optimizer(wrapped, torch.optim.AdamW, lr=optimizer.learning_rate,
                                        weight_decay=optimizer.weight_decay)

    def _micro_logprobs(self, scorer, k: int, with_entropy: bool = False):
        logps, entropy = super()._micro_logprobs(scorer, k, with_entropy)
        return self._weighted(logps), entropy

    def named_weights(self):
        """(name, tensor) of the model underneath: DTensor shards under FSDP2, whole under DDP."""
        return self.module.state_dict().items()


class DistributedCritic(DataParallelRole, Critic):
    """Notebook 01's Critic on one rank of a data-parallel job (notebook 06's PPO on a pool).
    wrapped: the value model from `wrap_model` (zero 0 or 1). A skip makes the returns NaN."""

    skip_field, loss_key = "returns", "value_loss"

    def __init__(self, wrapped: Wrapped, algorithm: AlgorithmConfig, optimizer: OptimizerConfig,
                 group):
        super().__init__(wrapped.wrapper, algorithm, optimizer)
        self._join(wrapped, group)
        self.optimizer = make_optimizer(wrapped, torch.optim.AdamW,
                                        lr=optimizer.value_learning_rate,
                                        weight_decay=optimizer.weight_decay)
        self.model.register_forward_hook(lambda module, args, values: self._weighted(values))
