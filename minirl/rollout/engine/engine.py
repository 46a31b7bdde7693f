# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""`PagedEngine`: the paged KV cache, the scheduler and the caches behind the rollout protocol.

    engine = PagedEngine(model, tokenizer)                # its own copy of the policy, version 0
    rollout = engine.generate(prompts, SamplingConfig(num_generations=8, max_completion_length=256))

Construction, checks and the protocol: `minirl.runtime.engine_core`. Simplified vs vLLM: one
process, one device, no CUDA graphs, plain temperature sampling.
"""

__all__ = ["forward_step", "PagedEngine"]

import time

import torch

from minirl.rollout.engine.attention import Chunk, make_step
from minirl.rollout.engine.speculative import speculative_step
from minirl.rollout.sampling import sample_tokens
from minirl.runtime.engine_core import EngineCore, Request, Stats
from minirl.runtime.scheduler_state import RUNNING, Sequence


def forward_step(engine: "PagedEngine", work: list[tuple[Sequence, int]], clock: float,
                 generator: torch.Generator | None = None) -> None:
    """One plain step: the scheduled chunks (prefills and decode tokens) in one forward pass, then
    one token sampled for every sequence whose pending tokens are now all computed.

    clock: perf_counter() when the step's scheduling ended (phase seconds go to `engine.stats`).
    """
    chunks = []
    for seq, n in work:
        if seq.status != RUNNING:                            # a padding row of a static batch
            pad = [engine.tokenizer.pad_token_id]
            chunks.append(Chunk(pad, seq.num_computed, seq.block_table, 0))
            engine.stats.padding_tokens += 1
            continue
        chunks.append(Chunk(seq.tokens[seq.num_computed:], seq.num_computed, seq.block_table, 1))
        engine.stats.count(seq, n)                           # a prefill, or decode tokens
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step)                                              # [R, V]
    clock = engine.tick("forward", clock)
    live = [seq for seq, _ in work if seq.status == RUNNING]
    temperatures = torch.tensor([s.temperature for s in live], device=logits.device)
    tokens, logprobs = sample_tokens(logits, temperatures, generator)   # notebook 01's sampling
    clock = engine.tick("sample", clock)
    for seq, n in work:
        seq.num_computed += n
    for seq, token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
        engine.append(seq, [token], [logprob])
    engine.tick("postprocess", clock)


class PagedEngine(EngineCore):
    """A paged, continuously batched, prefix-caching (optionally speculative) engine on an HF
    causal LM; the constructor's arguments, `generate` and `load_weights` are `EngineCore`'s."""

    def step(self, generator: torch.Generator | None = None) -> None:
        """Schedule, run one forward pass over the scheduled tokens, sample, update sequences."""
        clock = time.perf_counter()
        work = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.timeline[-1]["preempted"]
        clock = self.tick("schedule", clock)
        self.stats.steps += 1
        if not work:
            return
        decoding = [seq for seq, n in work
                    if seq.status == RUNNING and seq.num_computed > seq.num_cached and n == 1]
        if self.draft is not None and len(decoding) == len(work):
            speculative_step(self, decoding, generator)
            return
        forward_step(self, work, clock, generator)

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Add sampled tokens to `seq`, stopping at EOS or max_tokens; finish it if it stopped."""
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            self.stats.generated_tokens += 1
            if token == seq.eos_token_id or seq.num_generated >= seq.max_tokens:
                self.scheduler.finish(seq, "eos" if token == seq.eos_token_id else "length")
                return

    def run(self, requests: list[Request], generator: torch.Generator | None = None
            ) -> list[Sequence]:
        """Serve every request; returns their sequences in order (see Sequence.completion / .error).

        `stats` and the scheduler's `timeline` then describe this run alone.
        """
        self.stats = Stats()
        self.scheduler.timeline = []
        self.size_to_work(requests)          # a cache sized to the work grows to hold them
        seqs = [self.add(r) for r in requests]
        while self.scheduler.has_work():
            self.step(generator)
        return seqs
