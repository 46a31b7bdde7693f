"""Guards and gauges of a step: skip a non-finite batch, measure rollout vs trainer, describe the batch.

Hand-written (the actor, the critic and the step of notebook 01 call them; they teach no RL).
`clipped_step` clips the gradients to `max_grad_norm` and steps, unless their norm is not
finite; `optimizer_step` runs backward first, unless the loss is not finite. Either way a
non-finite batch leaves the weights and the optimizer's moments as they were (`skipped` in the
step's metrics): one bad batch must not poison hours of training.

`ratio_statistics` is the gauge notebook 02 is built around, computed on every update: how far
the rollout engine's behaviour log-probs are from the trainer's, as the per-token ratio
exp(trainer - behaviour) (its min, max, std and the share outside [0.8, 1.25]) and as the mean
absolute log-prob gap (`logprob_diff_abs`).

`batch_statistics` is what a step's record says about its batch: the policy version that
generated it, the reward (mean, std), the share of groups whose rewards are all equal (TRL's
`frac_reward_zero_std`: those groups have zero advantage and teach nothing), the completion
lengths (mean, longest: notebook 09's stragglers) and the real prompt and completion tokens
(notebook 09's MFU). In a data-parallel run every rank's rows count (`group.all_gather`).

`clip_metrics` is what the policy loss logs beside its value, as TRL: how often the clip bit.
"""

import math

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.data import Rollout
from minirl.tasks.rewards import frac_reward_zero_std


def clipped_step(params, optimizer, max_grad_norm: float) -> tuple[bool, float]:
    """Clip the gradients in .grad and step, unless their norm is not finite. Returns (stepped, grad_norm)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    return True, grad_norm


def optimizer_step(params, optimizer, loss: Tensor, max_grad_norm: float) -> tuple[bool, float]:
    """backward, clip, step, unless the loss or the gradient norm is not finite. Returns (stepped, grad_norm).

    A non-finite batch leaves the weights and the optimizer's moments as they were.
    """
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False, math.nan
    loss.backward()
    return clipped_step(params, optimizer, max_grad_norm)


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


def batch_statistics(rollout: Rollout, rewards: Tensor, group=None) -> dict:
    """The record's numbers about a batch: its version, reward (mean, std), the share of groups whose rewards
    are all equal (`frac_reward_zero_std`, TRL's name: those groups have zero advantage and teach nothing),
    completion length (mean, longest), real prompt and completion tokens. group: as in `rl_step` (every
    rank's rows; each rank holds whole groups)."""
    lengths = rollout.completion_mask.float().sum(1)                                      # [N]
    prompt_tokens = rollout.prompt_mask.sum()
    if group is not None:                                          # the global batch's rows, every rank's
        rewards, lengths = group.all_gather(rewards), group.all_gather(lengths)
        prompt_tokens = group.all_gather(prompt_tokens.reshape(1)).sum()
    return {"generated_version": rollout.version, "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_reward_zero_std": frac_reward_zero_std(rewards, rollout.num_generations),
            "completion_length": lengths.mean().item(),
            "tokens/prompt": int(prompt_tokens), "tokens/completion": int(lengths.sum()),
            "completion_length_max": lengths.max().item()}                   # for MFU and stragglers (notebook 09)


def clip_metrics(low: Tensor, high: Tensor, ratio: Tensor, mask: Tensor, kl: Tensor | None) -> dict[str, float]:
    """What `minirl.algo.losses.policy_loss` logs, as TRL does: the shares of tokens clipped below, above and
    either way, the mean ratio, and the mean KL term (when there is one). low, high, ratio: [B, C], or [B, 1]
    for sequence-level ratios (then counted per sequence); mask: [B, C]."""
    with torch.no_grad():
        def share(flags):                    # TRL's global masked mean; [B, 1] counts per sequence
            flags = flags.to(mask.dtype)
            return (flags.mean() if flags.shape[1] == 1 and mask.shape[1] != 1
                    else masked_mean(flags.expand_as(mask), mask)).item()
        metrics = {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
                   "clip_ratio/region_mean": share(low | high), "ratio_mean": share(ratio)}
        if kl is not None:
            metrics["kl"] = masked_mean(kl, mask).item()
    return metrics
