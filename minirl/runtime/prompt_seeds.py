"""A seed per prompt: samples that do not depend on how a batch is split over the ranks.

Hand-written (notebook 04's `--seed-per-prompt`, and vLLM's per-request seeds). Each rank
samples with a generator of its own, so the completions a run sees depend on the world size;
`SeedPerPrompt` instead draws one seed for the batch from the generator every rank shares and
samples each prompt alone from `prompt_seed(seed, prompt)`, so one rank and two compute the
same batch (the tests compare them). It costs a `generate` call per prompt.
"""

import hashlib

import torch

from minirl.config import SamplingConfig
from minirl.data import Batch, Rollout
from minirl.rollout.base import draw_seed


def prompt_seed(seed: int, prompt: str) -> int:
    """A sampling seed that depends only on a batch's seed and the prompt (not on its place in the batch)."""
    digest = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**62


class SeedPerPrompt:
    """An engine whose samples for a prompt depend only on one seed drawn for the batch and on the prompt.

    generate() draws a seed s from the generator, then samples each prompt alone from
    `prompt_seed(s, prompt)`: a batch split over any number of ranks (each drawing s from the
    same shared generator) gets the same completions. One generate call per prompt (slower).
    Everything else is the wrapped engine's.
    """

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):                          # model, dtype, tokenizer, named_weights, ...
        return getattr(self.engine, name)

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def load_weights(self, named_tensors, version: int) -> None:
        self.engine.load_weights(named_tensors, version)

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        seed = draw_seed(generator) or 0
        parts = [self.engine.generate([prompt], sampling, expected_version,
                                      torch.Generator().manual_seed(prompt_seed(seed, prompt))) for prompt in prompts]
        return Batch.concat(parts)
