# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

`accept_draft` keeps every emitted token distributed as the target alone would sample it
(Leviathan et al. 2023, Chen et al. 2023). The drafts: `minirl.runtime.drafts`. Simplified vs
vLLM: a fixed k, no tree of drafts; only pure decode steps speculate.
"""

__all__ = ["accept_draft", "speculative_step"]

import time

import torch
from torch import Tensor

from minirl.rollout.engine.attention import Chunk, make_step
from minirl.runtime.drafts import probabilities, sampling_logprobs


def accept_draft(p: Tensor, q: Tensor, draft: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The rejection-sampling rule of speculative decoding, for S sequences at once.

    p: [S, k+1, V] the target's probabilities at the k+1 verified positions; q: [S, k, V] the
    draft's probabilities it sampled d_1..d_k from; draft: [S, k] long, the proposed tokens.
    Draw u ~ U(0, 1) per draft token (from `generator`); d_i is accepted iff u_i < p_i(d_i) /
    q_i(d_i), and only while every earlier one was accepted. Returns (accepted [S] long in
    0..k, next_token [S] long): next_token is drawn from max(0, p_a - q_a) renormalized at the
    first rejected position a, or from p_{k+1} when all k are accepted.
    """
    S, k = draft.shape
    p_draft = p[:, :k].gather(2, draft[..., None]).squeeze(2)             # [S, k]
    q_draft = q.gather(2, draft[..., None]).squeeze(2)                    # [S, k]
    u = torch.rand(S, k, generator=generator, device=p.device)
    kept = u * q_draft < p_draft                                          # u < p/q, never / 0
    accepted = kept.long().cumprod(1).sum(1)                              # [S] the leading run
    rows = torch.arange(S, device=p.device)
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], 1)              # [S, k+1, V]
    residual = (p[rows, accepted] - q_padded[rows, accepted]).clamp(min=0)   # [S, V]
    next_token = torch.multinomial(residual / residual.sum(1, keepdim=True), 1,
                                   generator=generator).squeeze(1)
    return accepted, next_token


def speculative_step(engine, seqs, generator=None) -> None:
    """One round for decoding sequences: propose k, verify k + 1 positions in one pass."""
    k = engine.k
    clock = time.perf_counter()
    draft, q = engine.draft.propose(seqs, k, generator)                   # [S, k], [S, k, V]
    clock = engine.tick("draft", clock)
    drafts = draft.tolist()
    chunks = [Chunk([s.tokens[-1]] + d, s.num_computed, s.block_table, k + 1)
              for s, d in zip(seqs, drafts, strict=True)]
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step).view(len(seqs), k + 1, -1)                # [S, k+1, V]
    clock = engine.tick("forward", clock)
    temperatures = torch.tensor([s.temperature for s in seqs], device=logits.device)
    accepted, next_token = accept_draft(probabilities(logits, temperatures), q.to(logits.device),
                                        draft.to(logits.device), generator)
    logp = sampling_logprobs(logits, temperatures)                        # [S, k+1, V]
    clock = engine.tick("sample", clock)
    engine.stats.count_round(len(seqs), k, int(accepted.sum()))
    for i, (s, a, nxt) in enumerate(zip(seqs, accepted.tolist(), next_token.tolist(), strict=True)):
        tokens = drafts[i][:a] + [nxt]
        logprobs = logp[i, torch.arange(a + 1), torch.tensor(tokens)].tolist()
        s.num_computed += 1 + a
        engine.draft.rollback(s, len(s.tokens) + min(a, k - 1))
        engine.append(s, tokens, logprobs)
    engine.tick("postprocess", clock)
