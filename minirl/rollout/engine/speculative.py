# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

Each round, for every running sequence: the draft proposes d_1..d_k with probabilities
q_i(d_i); the target computes its distributions p_1..p_{k+1} at all k+1 positions in one
forward pass (the last accepted token and the k drafts); `accept_draft` keeps each d_i with
probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection, where it samples a
replacement from max(0, p_i - q_i) (renormalized); if all k are kept it samples a bonus token
from p_{k+1}. Every emitted token is then distributed exactly as the target alone would have
sampled it (Leviathan et al. 2023, Chen et al. 2023), so its behaviour log-prob is log p_i.

Two drafts: `ModelDraft` (a small model with the same vocabulary, its own paged cache) and
`NgramDraft` (prompt lookup: the tokens that followed the last occurrence of the current
n-gram earlier in the sequence; free to compute, a point mass q).

Simplified vs vLLM: a fixed k for all sequences, no tree of drafts; a step that admits new
sequences runs as a plain step (prefill + one decode token), only pure decode steps speculate.
"""

__all__ = ["accept_draft", "sampling_logprobs", "probabilities", "NgramDraft", "ModelDraft",
           "speculative_step"]

import copy
import time

import torch
from torch import Tensor

from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.blocks import BlockPool, blocks_needed
from minirl.rollout.sampling import sample_tokens


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
    p_draft = p[:, :k].gather(2, draft[..., None]).squeeze(2)                     # [S, k]
    q_draft = q.gather(2, draft[..., None]).squeeze(2)                            # [S, k]
    u = torch.rand(S, k, generator=generator, device=p.device)
    kept = u * q_draft < p_draft                                                  # u < p/q, without dividing by 0
    accepted = kept.long().cumprod(1).sum(1)                                      # [S] the leading run
    rows = torch.arange(S, device=p.device)
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], 1)                      # [S, k+1, V]: q = 0 after the drafts
    residual = (p[rows, accepted] - q_padded[rows, accepted]).clamp(min=0)       # [S, V]
    next_token = torch.multinomial(residual / residual.sum(1, keepdim=True), 1, generator=generator).squeeze(1)
    return accepted, next_token


def sampling_logprobs(logits: Tensor, temperatures: Tensor) -> Tensor:
    """log_softmax(logits / temperature), at temperature 1 where it is 0: what `sample_tokens` records.

    logits: [S, n, V] float32; temperatures: [S]. The verifier's behaviour log-probs.
    """
    t = temperatures[:, None, None]
    return torch.log_softmax(logits / torch.where(t == 0, 1.0, t), -1)


def probabilities(logits: Tensor, temperatures: Tensor) -> Tensor:
    """The distribution `sample_tokens` draws from: exp(sampling_logprobs), a one-hot argmax at temperature 0.

    logits: [S, n, V] float32; temperatures: [S]. The target's p and the model draft's q.
    """
    hard = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.where(temperatures[:, None, None] == 0, hard, sampling_logprobs(logits, temperatures).exp())


class NgramDraft:
    """Prompt lookup: propose the k tokens that followed the latest earlier occurrence of the last n tokens.

    Tries n, n-1, ..., 1; with no occurrence (or fewer than k tokens after it) it proposes the
    last token repeated, which the target will mostly reject. q is a point mass on each proposal.
    """

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"NgramDraft: n={n} must be >= 1")
        self.n = n

    def attach(self, engine) -> None:
        self.vocab_size = engine.model.vocab_size

    def reset(self) -> None:
        pass

    def release(self, seq) -> None:
        pass

    def rollback(self, seq, valid: int) -> None:
        pass

    def grow(self, num_blocks: int) -> None:
        pass

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.n, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [tokens[-1]] * k

    def propose(self, seqs, k: int, generator=None) -> tuple[Tensor, Tensor]:
        draft = torch.tensor([self.lookup(s.tokens, k) for s in seqs])                # [S, k]
        q = torch.nn.functional.one_hot(draft, self.vocab_size).float()               # [S, k, V]
        return draft, q


class ModelDraft:
    """A small causal LM with the target's vocabulary as the draft, with its own paged cache.

    It keeps, per target sequence, a block table and how many of the sequence's tokens it has
    computed; each round it catches up on the tokens it has not seen (1 or 2 after a round,
    the whole prompt the first time), then samples k tokens one step at a time.
    """

    def __init__(self, model):
        self.source = model

    def attach(self, engine) -> None:
        target_vocab, vocab = engine.model.vocab_size, self.source.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"ModelDraft: the draft's vocab_size={vocab} differs from the target's {target_vocab}; "
                             "speculation compares probabilities token by token, so both must share one tokenizer")
        p = next(engine.model.model.parameters())
        self.model = PagedModel(copy.deepcopy(self.source).to(p.device, p.dtype).eval())
        self.block_size, self.num_blocks = engine.block_size, engine.num_blocks
        self.model.allocate_cache(self.num_blocks, self.block_size)
        self.device = p.device
        self.reset()

    def reset(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.state: dict[int, tuple[list[int], int]] = {}     # seq id -> (block table, tokens computed)

    def grow(self, num_blocks: int) -> None:
        """The target's cache grew: so does the draft's (one block per target block)."""
        self.model.grow_cache(num_blocks)
        self.pool.grow(num_blocks)
        self.num_blocks = num_blocks

    def release(self, seq) -> None:
        table, _ = self.state.pop(seq.id, ([], 0))
        for b in table:
            self.pool.release(b)

    def propose(self, seqs, k: int, generator=None) -> tuple[Tensor, Tensor]:
        temperatures = torch.tensor([s.temperature for s in seqs], device=self.device)
        drafts, qs = [], []
        chunks = []
        for s in seqs:
            table, done = self.state.get(s.id, ([], 0))
            while len(table) < blocks_needed(len(s.tokens) + k - 1, self.block_size):
                table.append(self.pool.allocate())
            self.state[s.id] = (table, len(s.tokens) + k - 1)
            chunks.append(Chunk(s.tokens[done:], done, table))
        position = [len(s.tokens) for s in seqs]
        for i in range(k):
            logits = self.model(make_step(chunks, self.block_size, self.model.n_rep, self.device))   # [S, V]
            token, _ = sample_tokens(logits, temperatures, generator)      # [S]: notebook 01's sampling step
            q = probabilities(logits[:, None], temperatures)[:, 0]         # [S, V]: what it drew from
            drafts.append(token)
            qs.append(q)
            tokens = token.tolist()
            chunks = [Chunk([t], position[j] + i, self.state[s.id][0])
                      for j, (s, t) in enumerate(zip(seqs, tokens, strict=True))]
        return torch.stack(drafts, 1), torch.stack(qs, 1)                                           # [S, k], [S, k, V]

    def rollback(self, seq, valid: int) -> None:
        """Only the first `valid` tokens of `seq` have keys/values the draft computed from accepted tokens."""
        if seq.id in self.state:
            table, done = self.state[seq.id]
            self.state[seq.id] = (table, min(done, valid))


def speculative_step(engine, seqs, generator=None) -> None:
    """One round for decoding sequences: propose k, verify k + 1 positions in one pass, keep what passes."""
    k = engine.k
    clock = time.perf_counter()
    draft, q = engine.draft.propose(seqs, k, generator)                                # [S, k], [S, k, V]
    clock = engine.tick("draft", clock)
    drafts = draft.tolist()
    chunks = [Chunk([s.tokens[-1]] + d, s.num_computed, s.block_table, k + 1)
              for s, d in zip(seqs, drafts, strict=True)]
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step).view(len(seqs), k + 1, -1)                             # [S, k+1, V]
    clock = engine.tick("forward", clock)
    temperatures = torch.tensor([s.temperature for s in seqs], device=logits.device)
    accepted, next_token = accept_draft(probabilities(logits, temperatures), q.to(logits.device),
                                        draft.to(logits.device), generator)
    logp = sampling_logprobs(logits, temperatures)                                      # [S, k+1, V]
    clock = engine.tick("sample", clock)
    engine.stats.decode_tokens += len(seqs) * (k + 1)
    engine.stats.draft_tokens += len(seqs) * k
    engine.stats.accepted_tokens += int(accepted.sum())
    engine.stats.verified_rows += len(seqs)
    for i, (s, a, nxt) in enumerate(zip(seqs, accepted.tolist(), next_token.tolist(), strict=True)):
        tokens = drafts[i][:a] + [nxt]
        logprobs = logp[i, torch.arange(a + 1), torch.tensor(tokens)].tolist()
        s.num_computed += 1 + a
        engine.draft.rollback(s, len(s.tokens) + min(a, k - 1))
        engine.append(s, tokens, logprobs)
    engine.tick("postprocess", clock)
