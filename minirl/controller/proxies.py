# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The roles as the driver sees them: stage 1's methods, run on WorkerGroups.

`rl_step` calls `roles.actor.update(exp)`, `engine.generate(...)`, `reward(prompts,
completions, **columns)`; the objects here forward each call to the workers that host the
role, with an explicit dispatch mode, and return what stage 1's objects return:

- `ActorGroup`: logprobs (DP_COMPUTE), update (DP_UPDATE: the ranks reduce their metrics
  together, stage 4's `reduce_metrics`, and return one record), named_weights (a
  `RemoteWeights` handle), state_dict (RANK_ZERO), load_state_dict (every rank), `.model`
  (the driver's copy);
- `ReferenceGroup`: logprobs (DP_COMPUTE);
- `CriticGroup`: values (DP_COMPUTE), update (DP_UPDATE), state_dict, load_state_dict;
- `EngineGroup`: version, generate (prompts split by rank, one generator per rank),
  load_weights (every rank);
- `RemoteReward`: a reward function with TRL's signature (completions split across the
  reward workers).

Sampling: rollout worker r gets a copy of the loop's generator as it is after r seed draws,
and the driver's generator advances by one draw per worker; with one rollout worker the
completions are stage 1's. The driver keeps a copy of the policy (`ActorGroup.model`),
refreshed from rank 0 when the workers have updated since it was last read: evaluation,
checkpoints and `restore_checkpoint` use it.
"""

__all__ = ["RemoteWeights", "ActorGroup", "ReferenceGroup", "CriticGroup", "EngineGroup",
           "RemoteReward"]

import copy

import ray

from minirl.controller.worker_group import DP_COMPUTE, DP_UPDATE, RANK_ZERO, split_by_rank
from minirl.data import Batch
from minirl.rollout.base import VersionMismatchError, draw_seed


class RemoteWeights:
    """The actor's named weights, left on its workers: a sync between workers moves them without the
    driver; iterating fetches rank 0's (for a sync that needs them in the driver's process)."""

    def __init__(self, group):
        self.group = group

    def __iter__(self):
        return iter(self.group.run("named_weights", [("actor",)] + [None] * (len(self.group) - 1))[0])


class ActorGroup:
    """The actor role on a WorkerGroup, with stage 1's Actor methods."""

    def __init__(self, group, model):
        self.group, self._model, self._fresh = group, model, True

    @property
    def model(self):
        """The driver's copy of the policy, refreshed from rank 0 if the workers have updated since."""
        if not self._fresh:
            self._model.load_state_dict(dict(RemoteWeights(self.group)))
            self._fresh = True
        return self._model

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "actor", "logprobs", rollout)

    def update(self, exp) -> dict:
        self._fresh = False
        return self.group.execute(DP_UPDATE, "actor", "update", exp)

    def named_weights(self) -> RemoteWeights:
        return RemoteWeights(self.group)

    def state_dict(self) -> dict:
        return self.group.execute(RANK_ZERO, "actor", "state_dict")

    def load_state_dict(self, state: dict) -> None:
        """The optimizer state, and the driver's copy's weights, into every rank."""
        weights = ray.put(self.model.state_dict())
        self.group.run("restore", [("actor", weights, state)] * len(self.group))


class ReferenceGroup:
    def __init__(self, group):
        self.group = group

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "reference", "logprobs", rollout)


class CriticGroup:
    def __init__(self, group):
        self.group = group

    def values(self, rollout):
        return self.group.execute(DP_COMPUTE, "critic", "values", rollout)

    def update(self, exp) -> dict:
        return self.group.execute(DP_UPDATE, "critic", "update", exp)

    def state_dict(self) -> dict:
        return self.group.execute(RANK_ZERO, "critic", "state_dict")

    def load_state_dict(self, state: dict) -> None:
        self.group.run("restore", [("critic", {}, state)] * len(self.group))


class EngineGroup:
    """The rollout workers as one RolloutEngine: prompts split by rank, Rollouts concatenated."""

    def __init__(self, group):
        self.group, self.version = group, 0

    def generate(self, prompts, sampling, expected_version=None, generator=None):
        calls = []
        for (part,) in split_by_rank(len(self.group), list(prompts)):
            calls.append(("rollout", "generate", part, sampling, expected_version, copy.deepcopy(generator)))
            draw_seed(generator)                  # the driver's generator moves on by the draw that worker makes
        return Batch.concat(self.group.run("call", calls))

    def load_weights(self, named_tensors, version: int) -> None:
        ref = ray.put(list(named_tensors))
        self.confirm(self.group.run("receive", [(ref, version)] * len(self.group)))

    def confirm(self, versions: list[int]) -> None:
        """The versions the workers report after a sync: all equal, or VersionMismatchError."""
        if len(set(versions)) != 1:
            raise VersionMismatchError(f"rollout workers of {self.group.name} hold versions {versions} after a sync; "
                                       "each must load every push")
        self.version = versions[0]


class RemoteReward:
    """Reward function `index` of the reward workers, callable with TRL's signature from the driver."""

    def __init__(self, group, index: int, name: str):
        self.group, self.index, self.__name__ = group, index, name

    def __call__(self, prompts, completions, **columns) -> list[float]:
        N, n = len(completions), len(self.group)
        bounds = [(r * N // n, (r + 1) * N // n) for r in range(n)]      # contiguous, as equal as N allows
        calls = [("reward", "score", self.index, prompts[a:b], completions[a:b],
                  {k: v[a:b] for k, v in columns.items()}) if b > a else None for a, b in bounds]
        return [x for part in self.group.run("call", calls) for x in part]
