# Generated from notebooks/01_single_process.py, notebooks/02_mismatch.py
# by tools/build.py -- edit the notebook, not this file.
"""One RL step over roles: generate -> score -> make experience -> advantages -> update -> sync.

`rl_step` is the loop body every stage runs, through the seams' protocols only. Simplified vs
TRL's GRPOTrainer: every reward must be a number, one generation batch per step, and the engine
holds its own copy of the policy with a version.
"""

__all__ = ["Roles", "sample_prompts", "score", "make_experience", "BEHAVIOUR_CORRECTIONS",
           "correct_behaviour", "compute_advantages", "learn", "sync_and_record", "rl_step",
           "importance_weights"]

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
from minirl.runtime.arg_checks import check_reward_weights
from minirl.runtime.gauges import batch_statistics
from minirl.runtime.inputs import checked_rewards
from minirl.runtime.reward_extras import RewardExtras
from minirl.runtime.timing import StageTimer
from minirl.tasks.rewards import combine_rewards, reward_name


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


def score(reward_funcs: list, rollout: Rollout, rows: list[dict], reward_errors: str = "raise",
          reward_weights: list[float] | None = None, trainer_state=None) -> tuple[Tensor, dict]:
    """Stage 2: rewards [N] (the weighted sum over functions) and metrics (each function's mean, error count).

    Each function is called with TRL's signature, f(prompts, completions, **columns), the columns
    being the rows' other fields repeated G times (`minirl.runtime.inputs.checked_rewards`), and
    TRL's extras (`minirl.runtime.reward_extras`: completion_ids, trainer_state, log_metric, log_extra).
    """
    G = rollout.num_generations
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    weights = [1.0] * len(reward_funcs) if reward_weights is None else list(reward_weights)
    check_reward_weights(weights, reward_funcs)
    errors, extras = [], RewardExtras(rollout, trainer_state)
    per_func = [checked_rewards(f, rollout.prompts, rollout.completions, columns, reward_errors, errors, **extras)
                for f in reward_funcs]                                                     # [N] each
    total, metrics = combine_rewards(torch.stack(per_func, 1), weights,
                                     [reward_name(f) for f in reward_funcs])              # [N], per-function means
    metrics |= extras.metrics() | {"reward_errors": len(errors)}                         # + what they log_metric'd
    if errors:
        metrics["reward_error_examples"] = errors[:3]
    return total, metrics


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

    group: None in one process; data-parallel (04): "batch" scaling needs every rank's rewards.
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

    rollout: the batch, N = B * G rows; rewards: [N]. correct(exp) -> exp: the behaviour correction
    (default `correct_behaviour`; notebook 07 passes its own). group: as in `rl_step`."""
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
            generator: torch.Generator | None = None, group=None, reward_weights: list[float] | None = None,
            trainer_state=None) -> dict:
    """One pass generate -> score -> learn (experience, advantages, update) -> sync; returns the step's record.

    rows: this step's B dataset rows; engine: a RolloutEngine; sync: a WeightSync. group: None in
    one process; in a data-parallel run (04), `world_size` and `all_gather(tensor)` over the ranks.
    trainer_state: what the reward functions get as TRL's (`RunState.trainer_state`), or None.
    """
    timer = StageTimer()
    with timer("generate"):
        rollout = engine.generate([r["prompt"] for r in rows], config.sampling, expected_version=roles.version,
                                  generator=generator)
    with timer("score"):
        rewards, metrics = score(reward_funcs, rollout, rows, config.algorithm.reward_errors, reward_weights,
                                 trainer_state)
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
