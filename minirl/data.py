"""The batch that travels: `Rollout` (what an engine sampled) and `Experience` (what the update needs).

Both are dataclasses of per-row tensors and lists, N = B * G rows in generation order (rows
i*G .. i*G+G-1 are the G completions of prompt i), plus a few values shared by all rows
(the policy version, G, the pad id). Each knows how to move and split itself, which is all
an orchestration needs: `to(device)`, `split(n)` into n parts of whole groups (one per
data-parallel rank), `Batch.concat(parts)` (padding to the widest part), and `select(keys)`
(a copy carrying only the optional tensors a receiver needs).

Simplified vs veRL's `DataProto` (a TensorDict plus non-tensor arrays and meta info): two
typed dataclasses and one small base class, so that every field has a name, a shape comment
and a type a reader can look up.
"""

__all__ = ["Batch", "Rollout", "Experience"]

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


class Batch:
    """Row-wise operations shared by Rollout and Experience.

    A field is one of: a tensor whose first dimension is the N rows (2-D ones are padded to
    the widest part when parts are concatenated: on the left for the names in LEFT_PADDED,
    on the right otherwise), a list with one entry per row, a nested Batch, None (an absent
    optional tensor; it must be absent in every part), or a shared value (an int such as the
    version) that every part must agree on.
    """

    LEFT_PADDED: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()

    def __len__(self) -> int:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Tensor, list, Batch)):
                return len(value)
        raise TypeError(f"{type(self).__name__} has no per-row field")

    def _map(self, fn) -> "Batch":
        """A copy with `fn(name, value)` applied to every per-row field (shared values kept)."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values[f.name] = fn(f.name, value) if isinstance(value, (Tensor, list, Batch)) else value
        return dataclasses.replace(self, **values)

    def to(self, device) -> "Batch":
        """The same batch with every tensor on `device`."""
        return self._map(lambda name, v: v.to(device) if isinstance(v, (Tensor, Batch)) else v)

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows start..stop-1 (a view for tensors)."""
        return self._map(lambda name, v: v.rows(start, stop) if isinstance(v, Batch) else v[start:stop])

    def split(self, n: int) -> list["Batch"]:
        """n contiguous parts of equal size, each made of whole groups of `group_size` rows.

        Raises ValueError when the N rows do not divide into n parts of whole groups: a
        prompt's G completions must stay together (GRPO normalizes within the group).
        """
        N, G = len(self), self.group_size
        if n < 1 or N % (n * G):
            raise ValueError(f"{type(self).__name__}.split({n}): {N} rows in groups of {G} do not split into "
                             f"{n} equal parts of whole groups; use a number of parts that divides {N // G} "
                             "prompts")
        size = N // n
        return [self.rows(i * size, (i + 1) * size) for i in range(n)]

    @staticmethod
    def concat(parts: list["Batch"]) -> "Batch":
        """The parts' rows one after another; 2-D tensors padded to the widest part."""
        if not parts:
            raise ValueError("Batch.concat: no parts to concatenate")
        first = parts[0]
        values = {}
        for f in dataclasses.fields(first):
            column = [getattr(p, f.name) for p in parts]
            if isinstance(column[0], Batch):
                values[f.name] = Batch.concat(column)
            elif isinstance(column[0], list):
                values[f.name] = [x for part in column for x in part]
            elif isinstance(column[0], Tensor):
                if any(c is None for c in column):
                    raise ValueError(f"{type(first).__name__}.concat: {f.name} is missing in some parts")
                values[f.name] = _cat_padded(column, left=f.name in first.LEFT_PADDED,
                                             value=first.pad_value(f.name))
            else:
                if any(c != column[0] for c in column):
                    raise ValueError(f"{type(first).__name__}.concat: parts disagree on {f.name} "
                                     f"({sorted(set(map(str, column)))}); only batches of one "
                                     f"{f.name} can be concatenated")
                values[f.name] = column[0]
        return dataclasses.replace(first, **values)

    def select(self, keys) -> "Batch":
        """A copy whose optional tensors not named in `keys` are dropped (None): less to ship."""
        keys = set(keys)
        unknown = keys - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"{type(self).__name__}.select: no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **{name: None for name in self.OPTIONAL if name not in keys})

    def pad_value(self, name: str) -> int:
        return 0


def _cat_padded(tensors: list[Tensor], left: bool, value) -> Tensor:
    """Concatenate along rows, padding dimension 1 of 2-D (or more) tensors to the widest."""
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = width - t.shape[1]
        if pad:
            filler = t.new_full((t.shape[0], pad, *t.shape[2:]), value)
            t = torch.cat([filler, t] if left else [t, filler], 1)
        padded.append(t)
    return torch.cat(padded)


@dataclass
class Rollout(Batch):
    """What a rollout engine returns: G consecutive completions per prompt, N = B * G rows."""

    prompt_ids: Tensor        # [N, P] long, left-padded
    prompt_mask: Tensor       # [N, P] long
    completion_ids: Tensor    # [N, C] long, right-padded
    completion_mask: Tensor   # [N, C] long, 1 up to and including the first EOS
    logprobs: Tensor          # [N, C] float32 behaviour log-probs, as the engine computed them (0 where masked)
    completions: list[str]    # N decoded completions (special tokens removed)
    prompts: list[str]        # N prompts (each repeated G times)
    version: int              # the policy version that generated them
    num_generations: int = 1  # G: rows come in groups of G completions of one prompt
    pad_token_id: int = 0     # fills the padding when parts of different widths are concatenated
    token_versions: Tensor | None = None  # [N, C] long: each token's policy version, when they differ (stage 7)

    LEFT_PADDED = ("prompt_ids", "prompt_mask")
    OPTIONAL = ("token_versions",)

    @property
    def group_size(self) -> int:
        return self.num_generations

    def pad_value(self, name: str) -> int:
        return self.pad_token_id if name.endswith("_ids") else 0

    @property
    def input_ids(self) -> Tensor:       # [N, P+C]
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def attention_mask(self) -> Tensor:  # [N, P+C]
        return torch.cat([self.prompt_mask, self.completion_mask], 1)

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_ids.shape[1]


@dataclass
class Experience(Batch):
    """One generation batch and everything computed from it before the update. N = B * G rows."""

    rollout: Rollout
    rewards: Tensor                      # [N] float, summed over reward functions
    advantages: Tensor | None = None     # [N] (GRPO) or [N, C] (PPO)
    old_logps: Tensor | None = None      # [N, C] the trainer's log-probs before the update (None: = logps.detach())
    ref_logps: Tensor | None = None      # [N, C] the frozen reference's
    values: Tensor | None = None         # [N, C] the critic's values before the update (PPO)
    returns: Tensor | None = None        # [N, C] the critic's targets (PPO)
    is_weights: Tensor | None = None     # [N, C] importance-sampling weights against the rollout (notebook 02)

    OPTIONAL = ("advantages", "old_logps", "ref_logps", "values", "returns", "is_weights")

    @property
    def group_size(self) -> int:
        return self.rollout.num_generations

    @property
    def version(self) -> int:
        return self.rollout.version
