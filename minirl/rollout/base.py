"""The rollout-engine protocol: what the loop asks of any engine that samples completions.

An engine holds its own copy of the policy at some version. The loop asks it for G
completions per prompt from the version it expects, and hands it new weights after every
update. HF `generate` (`rollout/hf.py`), the shared-prefix sampler
(`rollout/shared_prefix.py`), vLLM (notebook 04) and a paged engine written from scratch
(notebook 05) all stand behind this one protocol, so the loop never knows which it drives.

Colocated engines, which share devices with the trainer, also offer `sleep()` (release
their weights and KV cache during the update) and `wake_up()`: the `Colocated` protocol.
The loop never calls them. Such an engine sleeps at the end of its own `generate` and wakes
at the start of the next `load_weights` (notebook 04's `ColocatedEngine`, used by stages 4
and 6, and the vLLM engine), so the step reads the same whether the engine shares the
trainer's devices or not.
"""

__all__ = ["VersionMismatchError", "RolloutEngine", "Colocated", "check_request", "draw_seed",
           "completion_mask_from_ids", "check_tokenizer", "make_rollout"]

from typing import Iterable, Protocol, runtime_checkable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout


class VersionMismatchError(RuntimeError):
    """The engine holds other weights than the loop expects."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions from its copy of the policy; takes new weights with a version."""

    version: int

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """sampling.num_generations completions per prompt, from policy `expected_version`.

        Rows i*G .. i*G+G-1 of the Rollout continue prompts[i]. With a `generator`, the
        completions depend on it alone (one seed is drawn from it); the global RNG is left
        as it was. Raises VersionMismatchError if `expected_version` is not `self.version`.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy these weights (all of them, by the trainer's names) into the engine; it now holds `version`."""
        ...


@runtime_checkable
class Colocated(Protocol):
    """An engine that shares devices with the trainer and can free its memory meanwhile."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def check_request(engine, prompts: list[str], sampling: SamplingConfig, expected_version: int | None) -> None:
    """The checks every engine makes before sampling: the version, and a non-empty request."""
    if expected_version is not None and expected_version != engine.version:
        raise VersionMismatchError(
            f"{type(engine).__name__} holds policy version {engine.version} but the loop expected version "
            f"{expected_version}: push the trainer's weights (sync.push / load_weights) before generating")
    if not prompts:
        raise ValueError("generate: prompts is empty; pass at least one prompt")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"generate: sampling must be a SamplingConfig, got {type(sampling).__name__}")


def draw_seed(generator: torch.Generator | None) -> int | None:
    """One sampling seed from `generator` (None without one), whatever the engine does with it."""
    if generator is None:
        return None
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


def completion_mask_from_ids(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """[N, C] long mask: 1 for every token up to and including the first EOS, 0 after it.

    A completion that never emits EOS (truncated at max_completion_length) keeps all C tokens.
    """
    is_eos = completion_ids == eos_token_id                                    # [N, C]
    C = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(is_eos[:, 0], C, dtype=torch.long))
    return (torch.arange(C, device=completion_ids.device)[None] <= first[:, None]).long()


def check_tokenizer(tokenizer) -> None:
    """Raise a clear error for a tokenizer that cannot pad a batch or end a completion."""
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer.pad_token is None: batched generation needs a pad token; "
                         "set tokenizer.pad_token = tokenizer.eos_token (what TRL does) or add one")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.eos_token is None: completions need an end-of-sequence token")


def make_rollout(tokenizer, prompts: list[str], num_generations: int, prompt_ids: Tensor, prompt_mask: Tensor,
                 completion_ids: Tensor, logprobs: Tensor, version: int) -> Rollout:
    """Assemble a Rollout from what an engine sampled: masks after EOS, decoded texts, masked log-probs.

    prompt_ids, prompt_mask: [N, P]; completion_ids, logprobs: [N, C], N = len(prompts) * G.
    """
    completion_mask = completion_mask_from_ids(completion_ids, tokenizer.eos_token_id)       # [N, C]
    pad = tokenizer.pad_token_id
    completions = tokenizer.batch_decode(completion_ids * completion_mask + pad * (1 - completion_mask),
                                         skip_special_tokens=True)
    repeated = [p for p in prompts for _ in range(num_generations)]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs.float() * completion_mask,
                   completions, repeated, version, num_generations=num_generations, pad_token_id=pad)
