"""The argument checks of notebook 01's functions, each raising a ValueError that names the argument.

Hand-written plumbing (a wrong shape or setting must fail at the call, saying what is wrong;
the checks teach no RL). Each function checks the arguments of one lesson function and returns
nothing: `check_same_shape` for `minirl.algo.logprobs.masked_sum`, `check_logit_args` for
`completion_logits` (a positive temperature, groups of at least one row), `check_group_rewards`
for `minirl.algo.advantages.group_advantages` (a flat [B * G] reward vector, G >= 2, a known
scaling), `check_loss_args` for `minirl.algo.losses.policy_loss` (a known importance-sampling
level, and reference log-probs whenever beta is not 0), `check_reward_weights` for
`minirl.train.step.score` (one weight per reward function).
"""

from minirl.config import SCALE_REWARDS
from minirl.runtime.validate import check_choice


def check_same_shape(name: str, values, mask) -> None:
    """ValueError unless `values` and `mask` have the same shape [B, T]."""
    if values.shape != mask.shape:
        raise ValueError(f"{name}: values {tuple(values.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape [B, T]")


def check_logit_args(temperature: float, num_generations: int) -> None:
    """ValueError unless temperature > 0 and num_generations >= 1 (1: no prompt sharing)."""
    if temperature <= 0:
        raise ValueError(f"completion_logprobs: temperature={temperature} must be > 0")
    if num_generations < 1:
        raise ValueError(f"completion_logprobs: num_generations={num_generations} must be >= 1 (1: no sharing)")


def check_group_rewards(rewards, num_generations: int, scale_rewards: str) -> None:
    """ValueError unless num_generations >= 2, rewards is flat [B * num_generations], scale_rewards is known."""
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: GRPO compares completions within a group; "
                         "use num_generations >= 2")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: need a flat [B * num_generations] tensor "
                         f"with num_generations={num_generations}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {SCALE_REWARDS}")


def check_loss_args(importance_sampling_level: str, levels, beta: float, ref_logps) -> None:
    """ConfigError for an unknown importance_sampling_level (not in `levels`); ValueError for beta != 0
    without ref_logps (the reference model's log-probs)."""
    check_choice("importance_sampling_level", importance_sampling_level, levels)
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs)")


def check_reward_weights(weights: list[float], reward_funcs: list) -> None:
    """ValueError unless there is one weight per reward function."""
    if len(weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(reward_funcs)} reward functions: "
                         "give one weight per function")
