# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The actor on every rank of a data-parallel job: notebook 01's Actor, with a rank's share of the loss.

`DistributedActor` wraps a model prepared by `minirl.parallel.wrap` (DDP, ZeRO-1, FSDP2,
with or without LoRA). Each rank updates on its share of the global batch and the wrapper
averages the gradients; for that average to be the gradient of the whole batch, each rank's
loss is weighted by its share of the global normalization (`rank_loss_weight`), applied as
a gradient scale on the log-probs, so `Actor.update` runs unchanged. Metrics are reduced
over the ranks (token-weighted means, global min / max, the batch's loss), and a
non-finite batch on any rank makes every rank skip the step together.

Simplified: PPO's critic is not sharded (stage 4 trains GRPO); with beta > 0 the reference
is a full, unsharded copy on every rank.
"""

__all__ = ["scale_gradient", "rank_loss_weight", "reduce_metrics", "pad_completions",
           "DistributedActor"]

import dataclasses
import math

import torch
from torch import Tensor

from minirl.config import LOSS_TYPES, AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.algo.logprobs import completion_logprobs
from minirl.data import Batch, Experience, Rollout
from minirl.parallel.wrap import Wrapped, make_optimizer
from minirl.roles.actor import Actor


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


def rank_loss_weight(loss_type: str, local_tokens: int, global_tokens: int, local_rows: int, global_rows: int,
                     world_size: int) -> float:
    """The weight w of this rank's loss such that averaging the ranks' gradients gives the whole batch's.

    Each rank computes notebook 01's `aggregate_loss` over its own rows; the batch's loss is
    (1 / world_size) * sum over ranks of w * (that rank's loss), and DDP / FSDP average the
    gradients, so scaling each rank's gradient by its w makes the average the batch's gradient.
      "dapo":              w = world_size * max(local_tokens, 1) / max(global_tokens, 1)
                           (TRL divides by the global batch's token count)
      "grpo", "dr_grpo":   w = world_size * local_rows / global_rows
                           (1 when every rank holds as many rows)
      "bnpo":              w = 1 (TRL divides by each process's own tokens)
    local_tokens / global_tokens: completion tokens (mask sum) of this rank / of all ranks;
    local_rows / global_rows: completions. Raises ValueError for an unknown loss_type.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")
    if loss_type == "dapo":
        return world_size * max(local_tokens, 1) / max(global_tokens, 1)
    if loss_type in ("grpo", "dr_grpo"):
        return world_size * local_rows / global_rows
    return 1.0


def reduce_metrics(metrics: dict, tokens: float, group) -> dict:
    """The ranks' metrics as one record: keys ending in "/min" and "/max" (and "skipped") take the global
    min / max, "grad_norm" is already global (gradients were averaged first), every other number is the
    token-weighted mean of the ranks' values (exact for per-token means; for "ratio/std" the mean of the
    ranks' stds). Non-numbers are this rank's."""
    everyone = group.gather_objects((metrics, float(tokens)))
    total = sum(w for _, w in everyone) or 1.0
    out = {}
    for key, value in metrics.items():
        values = [m.get(key) for m, _ in everyone]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = value
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith("/max") or key == "skipped":
            out[key] = max(values)
        elif key == "grad_norm":
            out[key] = value
        else:
            out[key] = sum(v * w for v, (_, w) in zip(values, everyone)) / total
    return out


def pad_completions(batch: Batch, width: int) -> Batch:
    """A copy of a Rollout or Experience whose [N, C] tensors are right-padded to `width` columns.

    The new columns are padding (pad id in `*_ids`, 0 elsewhere, mask 0), so no loss or
    metric sees them; earlier positions do not attend to later ones, so no value changes.
    """
    values = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Batch):
            value = pad_completions(value, width)
        elif (isinstance(value, Tensor) and value.dim() == 2 and f.name not in batch.LEFT_PADDED
              and value.shape[1] < width):
            filler = value.new_full((value.shape[0], width - value.shape[1]), batch.pad_value(f.name))
            value = torch.cat([value, filler], 1)
        values[f.name] = value
    return dataclasses.replace(batch, **values)


def _finite(exp: Experience) -> bool:
    tensors = (exp.advantages, exp.old_logps, exp.ref_logps, exp.is_weights, exp.rewards)
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


class DistributedActor(Actor):
    """Notebook 01's Actor on one rank of a data-parallel job.

    wrapped: from `minirl.parallel.wrap.wrap_model`; `self.model` is what gets called (the
    DDP wrapper or the FSDP2 model), `self.module` the model underneath (names, config).
    group: a `minirl.parallel.launch.ProcessGroup` (all_sum, gather_objects, world_size).
    checkpointing: the model recomputes its layers in backward (`set_checkpointing`);
    transformers then turns the KV cache off in training, so the log-probs take one pass over
    every row instead of sharing each group's prompt (same values, more compute).
    """

    def __init__(self, wrapped: Wrapped, algorithm: AlgorithmConfig, optimizer: OptimizerConfig,
                 sampling: SamplingConfig, group, checkpointing: bool = False):
        super().__init__(wrapped.module, algorithm, optimizer, sampling)
        self.module, self.zero, self.group, self.checkpointing = wrapped.model, wrapped.zero, group, checkpointing
        self.optimizer = make_optimizer(wrapped, torch.optim.AdamW, lr=optimizer.learning_rate,
                                        weight_decay=optimizer.weight_decay)
        self.grad_scale = 1.0

    def _logprobs(self, rollout: Rollout, with_entropy: bool = False):
        if self.checkpointing and self.model.training:       # no KV cache: no shared prompt pass
            logps, entropy = completion_logprobs(self.model, rollout.input_ids, rollout.attention_mask,
                                                 rollout.num_completion_tokens, self.sampling.temperature,
                                                 with_entropy=with_entropy)
        else:
            logps, entropy = super()._logprobs(rollout, with_entropy)
        if self.grad_scale != 1.0 and logps.requires_grad:
            logps = scale_gradient(logps, self.grad_scale)        # this rank's share of the batch's loss
        return logps, entropy

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """[N, C] log-probs, computed at the step's widest completion (every rank runs the same passes)."""
        C = rollout.num_completion_tokens
        return super().logprobs(pad_completions(rollout, self.group.all_max(C)))[:, :C]

    def update(self, exp: Experience) -> dict:
        """Actor.update on this rank's rows with its loss weighted by `rank_loss_weight`; global metrics.

        The batch is first padded to the widest completion of any rank: notebook 01's forward
        makes one pass when C is 1 and two otherwise, and under FSDP (and DDP, which
        broadcasts buffers in every forward) all ranks must make the same passes.
        """
        exp = pad_completions(exp, self.group.all_max(exp.rollout.num_completion_tokens))
        mask = exp.rollout.completion_mask
        tokens, rows = float(mask.sum()), len(exp.rollout)
        total_tokens, total_rows, bad = self.group.all_sum([tokens, rows, float(not _finite(exp))]).tolist()
        if bad:                                  # a NaN anywhere: every rank skips, none waits in a collective
            exp.advantages = torch.full_like(exp.advantages, math.nan)
        weight = rank_loss_weight(self.algorithm.loss_type, tokens, total_tokens, rows, total_rows,
                                  self.group.world_size)
        self.grad_scale = weight
        try:
            metrics = super().update(exp)
        finally:
            self.grad_scale = 1.0
        loss = self.group.all_sum(metrics["loss"] * weight / self.group.world_size).item()
        return reduce_metrics(metrics, tokens, self.group) | {"loss": loss, "loss_weight": weight}

    def named_weights(self):
        """(name, tensor) of the model underneath: DTensor shards under FSDP2, whole tensors under DDP."""
        return self.module.state_dict().items()

    def state_dict(self) -> dict:
        raise NotImplementedError("a sharded actor is checkpointed with minirl.parallel.checkpoint (DCP)")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("a sharded actor is restored with minirl.parallel.checkpoint (DCP)")
