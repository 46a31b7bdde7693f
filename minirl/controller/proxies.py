# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The roles as the driver sees them: stage 1's methods (Actor, Reference, Critic, RolloutEngine, a
reward function), each call forwarded to the WorkerGroup that hosts the role with a dispatch mode.
"""

__all__ = ["ActorGroup", "ReferenceGroup", "CriticGroup", "EngineGroup", "RemoteReward"]

import copy

import ray

from minirl.controller.worker_group import DP_COMPUTE, DP_UPDATE, split_by_rank
from minirl.data import Batch
from minirl.rollout.base import draw_seed
from minirl.runtime.reward_extras import joined_rewards, remote_rows
from minirl.runtime.role_checkpoints import CheckpointedRole
from minirl.runtime.sync_ends import RemoteWeights, one_version


class ActorGroup(CheckpointedRole):
    """The actor role on a WorkerGroup, with stage 1's Actor methods (its checkpoints:
    `CheckpointedRole`; `RemoteWeights`, a handle on rank 0's weights: runtime/sync_ends.py)."""

    role = "actor"

    def __init__(self, group, model):
        self.group, self._model, self._fresh = group, model, True

    @property
    def model(self):
        """The driver's copy of the policy, refreshed from rank 0 if the workers updated since."""
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


class ReferenceGroup:
    def __init__(self, group):
        self.group = group

    def logprobs(self, rollout):
        return self.group.execute(DP_COMPUTE, "reference", "logprobs", rollout)


class CriticGroup(CheckpointedRole):
    role = "critic"

    def __init__(self, group):
        self.group = group

    def values(self, rollout):
        return self.group.execute(DP_COMPUTE, "critic", "values", rollout)

    def update(self, exp) -> dict:
        return self.group.execute(DP_UPDATE, "critic", "update", exp)


class EngineGroup:
    """The rollout workers as one RolloutEngine: prompts split by rank, Rollouts concatenated."""

    def __init__(self, group):
        self.group, self.version = group, 0

    def generate(self, prompts, sampling, expected_version=None, generator=None):
        calls = []
        for (part,) in split_by_rank(len(self.group), list(prompts)):
            rng = copy.deepcopy(generator)
            calls.append(("rollout", "generate", part, sampling, expected_version, rng))
            draw_seed(generator)                  # the driver's generator moves on by that draw
        return Batch.concat(self.group.run("call", calls))

    def load_weights(self, named_tensors, version: int) -> None:
        ref = ray.put(list(named_tensors))
        self.confirm(self.group.run("receive", [(ref, version)] * len(self.group)))

    def confirm(self, versions: list[int]) -> None:
        """The versions the workers report after a sync: all equal, or VersionMismatchError."""
        self.version = one_version(self.group.name, versions)


class RemoteReward:
    """Reward function `index` of the reward workers, callable with TRL's signature."""

    def __init__(self, group, index: int, name: str):
        self.group, self.index, self.__name__ = group, index, name

    def __call__(self, prompts, completions, **columns) -> list[float]:
        N, n = len(completions), len(self.group)
        bounds = [(r * N // n, (r + 1) * N // n) for r in range(n)]      # contiguous, near equal
        calls = [("reward", "score", self.index, prompts[a:b], completions[a:b],
                  remote_rows(columns, a, b)) if b > a else None for a, b in bounds]   # TRL's extras too
        return joined_rewards(self.group.run("call", calls), columns)    # in order; their log_metric calls here
