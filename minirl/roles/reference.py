"""The reference: a frozen copy of the initial policy, for the KL penalty.

Simplified vs TRL / veRL: a full copy in the same process and precision (TRL can instead
disable a LoRA adapter to recover the reference; veRL can colocate it with the actor).
"""

__all__ = ["Reference"]

import copy

import torch
from torch import Tensor

from minirl.algo.logprobs import completion_logprobs
from minirl.data import Rollout


class Reference:
    """log pi_ref of the sampled tokens, from a frozen copy of the policy as it was at the start."""

    def __init__(self, model, temperature: float = 1.0):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.temperature = temperature

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """[N, C] float32 log-probs of the completion tokens under the reference."""
        return completion_logprobs(self.model, rollout.input_ids, rollout.attention_mask,
                                   rollout.num_completion_tokens, self.temperature,
                                   num_generations=rollout.num_generations)[0]
