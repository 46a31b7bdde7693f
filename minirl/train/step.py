# Generated from notebooks/01_single_process.py, notebooks/02_mismatch.py
# by tools/build.py -- edit the notebook, not this file.
"""One RL step over roles: generate -> score -> make experience -> advantages -> update -> sync.

`rl_step` is the loop body every stage runs. It talks to the three seams only through
their protocols: a rollout engine (`generate`, `load_weights`), the roles (`Actor`,
`Reference`, `Critic`), and a weight sync (`push`). Stage 1 passes plain in-process
objects; notebook 04 passes FSDP-wrapped roles on every rank; notebook 06 passes Ray
worker groups with the same methods. The step never changes, so what it computes never
changes with where it runs. Its middle, `learn` (experience -> correction -> advantages ->
update), is a function of its own: the asynchronous trainer of notebook 07, whose batches
come from a queue instead of an engine call, runs the same `learn` on them.

Simplified vs TRL's GRPOTrainer: the weighted sum of the reward functions must be a number
for every sample (TRL's skips a function's NaN, "does not apply"), one generation batch per
step, and the engine holds its own copy of the policy with a version (TRL samples with the
training model itself). PPO puts its KL penalty in the per-token
reward (as TRL's PPOTrainer); GRPO adds the k3 KL to the loss (as TRL's GRPOTrainer).
"""

__all__ = ["Roles", "sample_prompts", "score", "make_experience", "BEHAVIOUR_CORRECTIONS",
           "correct_behaviour", "compute_advantages", "learn", "batch_statistics",
           "sync_and_record", "rl_step", "importance_weights"]

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from minirl.algo.advantages import gae, group_advantages, terminal_rewards, whiten
from minirl.algo.corrections import importance_sampling_weights
from minirl.config import AlgorithmConfig, RLConfig
from minirl.data import Experience, Rollout
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.runtime.timing import StageTimer
from minirl.tasks.rewards import combine_rewards, frac_reward_zero_std, reward_name


@dataclass
class Roles:
    """The models of a run, and the policy version the engine must hold for the next batch."""

    actor: Actor
    reference: Reference | None = None   # only with a KL penalty (beta > 0)
    critic: Critic | None = None         # only for PPO
    version: int = 0


def sample_prompts(rows: list[dict], n: int, generator: torch.Generator) -> list[dict]:
    """n distinct dataset rows, drawn with `generator` (all rows if the dataset is smaller)."""
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    picks = torch.randperm(len(rows), generator=generator)[:n].tolist()
    return [rows[i] for i in picks]


def _call_reward(func, prompts, completions, columns, reward_errors, errors: list) -> list[float]:
    try:
        return list(func(prompts=prompts, completions=completions, **columns))
    except Exception as err:
        if reward_errors == "raise":
            raise RuntimeError(f"reward function {reward_name(func)} raised {type(err).__name__}: {err}; "
                               "fix it, or pass reward_errors='zero' to score failing samples 0") from err
    values = []
    for i in range(len(completions)):            # find the failing samples one by one
        try:
            values.append(float(func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                                     **{k: v[i:i + 1] for k, v in columns.items()})[0]))
        except Exception as err:
            errors.append(f"{reward_name(func)}[{i}]: {type(err).__name__}: {err}")
            values.append(0.0)
    return values


def score(reward_funcs: list, rollout: Rollout, rows: list[dict], reward_errors: str = "raise",
          reward_weights: list[float] | None = None) -> tuple[Tensor, dict]:
    """Stage 2: rewards [N] (the weighted sum over functions) and metrics (each function's mean, error count).

    Each function is called with TRL's signature, f(prompts, completions, **columns), where the
    columns are the dataset rows' other fields, repeated G times. A wrong number of rewards, a
    non-numeric or non-finite reward is an error naming the function; with reward_errors="zero"
    a failing sample scores 0 and is counted in metrics["reward_errors"]. reward_weights: one
    per function (TRL's `reward_weights`; None: 1 each); `rewards/<name>` is the function's
    unweighted mean, as TRL logs it.
    """
    G = rollout.num_generations
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    weights = [1.0] * len(reward_funcs) if reward_weights is None else list(reward_weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(reward_funcs)} reward functions: "
                         "give one weight per function")
    per_func, errors = [], []
    for func in reward_funcs:
        values = _call_reward(func, rollout.prompts, rollout.completions, columns, reward_errors, errors)
        name = reward_name(func)
        if len(values) != len(rollout.completions):
            raise ValueError(f"reward function {name} returned {len(values)} rewards for "
                             f"{len(rollout.completions)} completions: reward_funcs must return one float each")
        values = torch.tensor([_as_float(v) for v in values], dtype=torch.float32)
        if not torch.isfinite(values).all():
            if reward_errors == "raise":
                raise ValueError(f"reward function {name} returned non-numeric or non-finite rewards "
                                 f"({(~torch.isfinite(values)).sum().item()} of {len(values)}); return finite "
                                 "floats, or pass reward_errors='zero' to score them 0")
            bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
            errors += [f"{name}[{i}]: not a finite number" for i in bad]
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        per_func.append(values)
    total, metrics = combine_rewards(torch.stack(per_func, 1), weights,
                                     [reward_name(f) for f in reward_funcs])              # [N], per-function means
    metrics["reward_errors"] = len(errors)
    if errors:
        metrics["reward_error_examples"] = errors[:3]
    return total, metrics


def _as_float(value) -> float:
    """A reward as a float; NaN for anything that is not a number (None, a string, a list, ...)."""
    if isinstance(value, (str, bytes)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@torch.no_grad()
def make_experience(rollout: Rollout, rewards: Tensor, roles: Roles, algorithm: AlgorithmConfig) -> Experience:
    """The log-probs and values the update needs, computed before it: old, reference, critic.

    old_logps are only needed when pi_old differs from the first update's own log-probs
    (several iterations per batch, importance-sampling correction, or PPO's KL-in-reward).
    """
    needs_old = (algorithm.num_iterations > 1 or algorithm.importance_sampling_correction
                 or (algorithm.algo == "ppo" and algorithm.beta > 0))
    return Experience(
        rollout, rewards,
        old_logps=roles.actor.logprobs(rollout) if needs_old else None,                   # [N, C]
        ref_logps=roles.reference.logprobs(rollout) if roles.reference is not None else None,
        values=roles.critic.values(rollout) if roles.critic is not None else None)


# Behaviour corrections, by name: (exp, algorithm) -> exp, each doing nothing unless the config turns it on.
# Notebook 02 registers truncated importance sampling; `learn` applies them in order.
BEHAVIOUR_CORRECTIONS: dict[str, Callable[[Experience, AlgorithmConfig], Experience]] = {}


def correct_behaviour(exp: Experience, algorithm: AlgorithmConfig) -> Experience:
    """Every registered behaviour correction, in order (notebook 02's truncated IS, when the config asks)."""
    for correction in BEHAVIOUR_CORRECTIONS.values():
        exp = correction(exp, algorithm)
    return exp


def compute_advantages(exp: Experience, algorithm: AlgorithmConfig, group=None) -> Experience:
    """GRPO: group-normalized [N]. PPO: terminal reward (minus beta * k1 KL per token), GAE, whitened [N, C].

    group: None in one process. In a data-parallel run (notebook 04) each rank holds whole
    groups, so "group" scaling stays local, but "batch" scaling divides by the std of the
    whole global batch: `group.all_gather` brings every rank's rewards.
    """
    if algorithm.algo == "grpo":
        G = exp.rollout.num_generations
        if algorithm.scale_rewards == "batch" and group is not None and group.world_size > 1:
            batch_std = group.all_gather(exp.rewards).std()                              # over all ranks' rewards
            exp.advantages = group_advantages(exp.rewards, G, "none") / (batch_std + 1e-4)
        else:
            exp.advantages = group_advantages(exp.rewards, G, algorithm.scale_rewards)
        return exp
    mask = exp.rollout.completion_mask
    token_rewards = terminal_rewards(exp.rewards, mask)                                   # [N, C]
    if algorithm.beta > 0:
        token_rewards = token_rewards - algorithm.beta * (exp.old_logps - exp.ref_logps) * mask
    advantages, exp.returns = gae(token_rewards, exp.values, mask, algorithm.gamma, algorithm.lam)
    exp.advantages = whiten(advantages, mask)
    return exp


def learn(roles: Roles, rollout: Rollout, rewards: Tensor, config: RLConfig, group=None,
          timer: StageTimer | None = None, correct=None) -> dict:
    """The update half of a step: experience -> correction -> advantages -> actor update (+ critic); its metrics.

    rollout: the batch, N = B * G rows; rewards: [N]. correct(exp) -> exp fills the
    behaviour correction (`is_weights`, and `old_logps` if it needs them); default
    `correct_behaviour` (notebook 02's truncated IS, when the config turns it on).
    Notebook 07 passes its corrections for stale batches here. timer: a StageTimer that
    gets the "reference", "advantages", "update" (and "update_critic") seconds.
    group: as in `rl_step`.
    """
    timer = StageTimer() if timer is None else timer
    with timer("reference"):
        exp = make_experience(rollout, rewards, roles, config.algorithm)
    with timer("advantages"):
        exp = correct_behaviour(exp, config.algorithm) if correct is None else correct(exp)
        exp = compute_advantages(exp, config.algorithm, group)
    with timer("update"):
        metrics = roles.actor.update(exp)
    if roles.critic is not None:
        with timer("update_critic"):
            metrics |= roles.critic.update(exp)
    return metrics


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


def sync_and_record(roles: Roles, engine, sync, rollout: Rollout, rewards: Tensor, metrics: dict,
                    timer: StageTimer, group=None) -> dict:
    """The step's tail: push the actor's weights into `engine` as the next version (timed as "sync"), then the
    record: the update's `metrics`, the new version, the sync's bytes, the batch's statistics and every stage's
    seconds. Notebook 07's trainer ends its steps with it too. group: as in `rl_step`."""
    with timer("sync"):
        report = sync.push(roles.actor.named_weights(), engine, roles.version + 1)
    roles.version = report.version
    return (metrics | {"version": roles.version, "sync/bytes": report.bytes} | batch_statistics(rollout, rewards, group)
            | timer.times)


def rl_step(roles: Roles, engine, sync, rows: list[dict], reward_funcs: list, config: RLConfig,
            generator: torch.Generator | None = None, group=None, reward_weights: list[float] | None = None) -> dict:
    """One pass generate -> score -> learn (experience, advantages, update) -> sync; returns the step's record.

    rows: this step's B dataset rows ({"prompt", **columns}); engine: any RolloutEngine;
    sync: any WeightSync. The record holds the update's metrics, the batch's reward and
    completion length (mean and longest), its real prompt and completion tokens
    (`tokens/prompt`, `tokens/completion`), the versions, and `time/<stage>` seconds for
    every stage.
    group: None in one process. In a data-parallel run (notebook 04) every rank calls rl_step
    on its share of the batch, and `group` (with `world_size` and `all_gather(tensor)`, the
    ranks' tensors concatenated along dim 0) makes the batch-wide numbers global: the
    "batch" reward std and the record's reward, length and token statistics.
    reward_weights: one per reward function (None: 1 each).
    """
    timer = StageTimer()
    with timer("generate"):
        rollout = engine.generate([r["prompt"] for r in rows], config.sampling, expected_version=roles.version,
                                  generator=generator)
    with timer("score"):
        rewards, metrics = score(reward_funcs, rollout, rows, config.algorithm.reward_errors, reward_weights)
    metrics |= learn(roles, rollout, rewards, config, group, timer)
    return sync_and_record(roles, engine, sync, rollout, rewards, metrics, timer, group)


def importance_weights(exp: Experience, algorithm: AlgorithmConfig) -> Experience:
    """Truncated IS weights pi_old / pi_rollout per token (`is_weights`), if the config asks."""
    if not algorithm.importance_sampling_correction:
        return exp
    ro = exp.rollout
    exp.is_weights = importance_sampling_weights(exp.old_logps, ro.logprobs, ro.completion_mask,
                                                 algorithm.importance_sampling_mode,
                                                 algorithm.importance_sampling_cap)       # [N, C]
    return exp


BEHAVIOUR_CORRECTIONS["importance_sampling"] = importance_weights
