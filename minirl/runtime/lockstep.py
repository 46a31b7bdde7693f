"""Keeping the ranks of a data-parallel update in lockstep: the same passes, and a skip that every rank makes.

Hand-written for notebook 04's `minirl.parallel.roles`. Under FSDP2 every forward pass
all-gathers weights with the other ranks (and DDP broadcasts its buffers in every forward),
so every rank must make the same passes: `pad_completions` pads a batch with masked columns
to the widest completion of any rank (notebook 01's forward makes one pass when completions
are one token long, two otherwise), and `split_micro_batches` halves a rank's largest
micro-batches until it has as many as the rank with the most (real work, never an empty
pass). `finite_batch` says whether an update's inputs are finite: a rank that skipped its
backward alone would leave the others waiting in the gradient all-reduce. `LockstepActor`
applies them to notebook 04's `DistributedActor`; `ReplicatedState` checkpoints a role whose
state every rank holds whole.
"""

import dataclasses

import torch
from torch import Tensor

from minirl.data import Batch, Experience, Rollout
from minirl.roles.critic import Critic


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


def split_micro_batches(plan: list[list[int]], count: int) -> list[list[int]]:
    """`plan` (lists of rows) with its largest micro-batches halved until it holds `count` of them.

    Every rank then makes as many forward and backward passes as the rank with the most,
    all of them on real rows. Raises ValueError when there are fewer rows than `count` (ranks
    with very different numbers of rows).
    """
    plan = [list(rows) for rows in plan]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda i: len(plan[i]))
        if len(plan[k]) < 2:
            raise ValueError(f"split_micro_batches: {sum(map(len, plan))} rows cannot make {count} micro-batches; "
                             "give every rank as many rows (Batch.split)")
        rows = plan.pop(k)
        plan[k:k] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return plan


def finite_batch(exp: Experience) -> bool:
    """Whether every number computed for the update (rewards, advantages, log-probs, values, returns, IS weights)
    is finite."""
    tensors = [exp.rewards] + [getattr(exp, name) for name in exp.OPTIONAL]
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


class ReplicatedState:
    """Checkpointing a data-parallel role (a base of notebook 04's `DataParallelRole`) whose state every rank
    holds whole (zero 0: DDP replicas): the actor saves its optimizer's state, the critic also its value model by
    the plain names (`self.module`, not the DDP wrapper's). A sharded role (zero > 0) is checkpointed with
    `minirl.runtime.sharded_checkpoint` (DCP) instead: NotImplementedError here."""

    def _replicated(self, what: str) -> None:
        if self.zero:
            raise NotImplementedError(f"{what}: a sharded role (zero={self.zero}) is checkpointed with "
                                      "minirl.runtime.sharded_checkpoint (DCP)")

    def state_dict(self) -> dict:
        self._replicated("state_dict")
        if isinstance(self, Critic):
            return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._replicated("load_state_dict")
        if isinstance(self, Critic):
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            super().load_state_dict(state)


class LockstepActor:
    """The same passes on every rank, for notebook 04's `DistributedActor` (a base before notebook 01's `Actor`;
    it uses `group` and `checkpointing`): as many micro-batches as the rank with the most, log-probs at the
    step's widest completion, and no shared prompt pass when the layers are recomputed in backward
    (transformers turns the KV cache off in training then: same values, more compute)."""

    def micro_batches(self, rollout: Rollout) -> list[list[int]]:
        """This rank's micro-batches, split until there are as many as on the rank with the most."""
        plan = super().micro_batches(rollout)
        return split_micro_batches(plan, self.group.all_max(len(plan)))

    def _shares_prompt(self) -> bool:
        return not (self.checkpointing and self.model.training)   # no KV cache: no shared prompt pass

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """[N, C] log-probs, computed at the step's widest completion (every rank runs the same passes)."""
        C = rollout.num_completion_tokens
        return super().logprobs(pad_completions(rollout, self.group.all_max(C)))[:, :C]
