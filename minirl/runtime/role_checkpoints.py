"""What a checkpoint needs of stage 6's roles on Ray workers: their state from rank 0, and back into every rank.

Hand-written (checkpoint plumbing; notebook 06 teaches the roles and their proxies). Stage 1's
checkpointer saves `roles.actor.state_dict()` (and the critic's) and `restore_checkpoint` loads
a checkpoint's weights into the driver's copy of the policy, then calls `load_state_dict`.
On workers that becomes:

- `CheckpointedRole`, a base of the driver's `ActorGroup` and `CriticGroup` proxies:
  `state_dict()` asks rank 0 (every data-parallel rank holds the same state);
  `load_state_dict(state)` sends the optimizer state to every rank, and for the actor the
  driver's copy's weights too (through Ray's object store, once).
- `RestoringWorker`, a base of the `RoleWorker`: `restore(role, weights, state)` loads them.
"""

import ray

from minirl.controller.worker_group import RANK_ZERO


class CheckpointedRole:
    """state_dict / load_state_dict of a role proxy with `group` (its WorkerGroup) and `role` (its name)."""

    role = ""

    def state_dict(self) -> dict:
        return self.group.execute(RANK_ZERO, self.role, "state_dict")

    def load_state_dict(self, state: dict) -> None:
        """The optimizer state into every rank; for the actor also the driver's copy's weights."""
        weights = ray.put(self.model.state_dict()) if self.role == "actor" else {}
        self.group.run("restore", [(self.role, weights, state)] * len(self.group))


class RestoringWorker:
    """The worker's side: load a checkpoint's weights and optimizer state into one of its roles."""

    def restore(self, role: str, weights: dict, state: dict) -> None:
        """weights {}: the optimizer state only (the critic; the actor's weights come from the driver)."""
        target = self.roles[role]
        if weights:
            getattr(target, "module", target.model).load_state_dict(weights)
        target.load_state_dict(state)
