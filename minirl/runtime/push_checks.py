"""Checking a push as an in-process engine copies it into place: every name known, every shape right, none missing.

Hand-written for notebook 04's `minirl.rollout.colocated.ColocatedEngine`, which streams a
push into the engine's own tensors one at a time (so the engine never holds a second whole
copy) and therefore cannot check the whole set before copying: `copy_pushed` checks each
tensor as it arrives and the set at the end, with errors that name the tensor and the fix;
`refuse_older` refuses older weights; `EngineNotReady` is a generate without complete weights.
`StreamedLoads` is the loading side of `ColocatedEngine` that teaches nothing about colocation:
the inner engine's model, version and dtype passed through, the engine's own tensors by the
trainer's names, a push copied into them as it arrives, and the copy the stale check reads.
"""

from typing import Iterable

import torch
from torch import Tensor

from minirl.rollout.base import VersionMismatchError
from minirl.rollout.hf import fp8_round_trip


def copy_pushed(own: dict[str, Tensor], named_tensors: Iterable[tuple[str, Tensor]], version: int,
                fp8: bool = False) -> None:
    """Copy each pushed (name, tensor) into `own[name]` as it arrives; ValueError for an unknown name, a wrong
    shape, or names of `own` never pushed. fp8: round 2-D tensors through FP8 first (notebook 02's rollout)."""
    seen = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in own:
                raise ValueError(f"load_weights(version={version}): unexpected tensor {name!r}; the engine takes "
                                 f"{len(own)} tensors named like {next(iter(own))!r}: push them under the engine's "
                                 "names (the policy's state_dict names)")
            if own[name].shape != tensor.shape:
                raise ValueError(f"load_weights(version={version}): {name} has shape {tuple(tensor.shape)}, the "
                                 f"engine's has {tuple(own[name].shape)}: is this the engine's model?")
            if fp8 and tensor.dim() >= 2:
                tensor = fp8_round_trip(tensor)              # notebook 02's simulated FP8 rollout
            own[name].copy_(tensor)
            seen.add(name)
    missing = [n for n in own if n not in seen]
    if missing:
        raise ValueError(f"load_weights(version={version}): {len(missing)} of {len(own)} tensors were "
                         f"never pushed (first: {missing[0]}); push all of them: the engine keeps none from "
                         "the last version")


class EngineNotReady(RuntimeError):
    """The engine is asleep, or its last push did not complete: it holds no usable weights."""


def refuse_older(version: int, held: int, who: str) -> None:
    """VersionMismatchError when a push brings an older version than the engine holds."""
    if version < held:
        raise VersionMismatchError(f"load_weights(version={version}) but {who} holds version {held}: refusing to "
                                   "go back to older weights")


class StreamedLoads:
    """A base class of `minirl.rollout.colocated.ColocatedEngine` (it uses the engine's `engine` and `names`)."""

    @property
    def model(self):
        return self.engine.model

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def dtype(self):
        return self.engine.dtype

    def _tensors(self) -> dict[str, Tensor]:
        state = self.engine.model.state_dict(keep_vars=True)
        return {n: state[n].data for n in self.names}

    def _stream(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy each (name, tensor) into place as it arrives (cast to the engine's dtype)."""
        copy_pushed(self._tensors(), named_tensors, version, fp8=self.engine.dtype == "float8_e4m3fn")

    def named_weights(self):
        """The engine's copy of the weights by the trainer's names (what the stale-parameter check compares)."""
        return self.engine.named_weights()
