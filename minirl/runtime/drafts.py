"""The two drafts of speculative decoding: n-gram prompt lookup and a small model with its own paged cache.

Hand-written; notebook 05 (`minirl/rollout/engine/speculative.py`) writes the rule that keeps
the target's distribution (`accept_draft`) and the round that verifies k drafts in one forward
pass (`speculative_step`); a draft only proposes. Both drafts have the same interface: `attach`
(to an engine), `reset`, `grow`, `release(seq)`, `rollback(seq, valid)` and `propose(seqs, k)`
-> (draft [S, k] tokens, q [S, k, V] the probabilities each was drawn from).

`NgramDraft` (prompt lookup) proposes the tokens that followed the latest earlier occurrence of
the current n-gram: free to compute, a point mass q. `ModelDraft` is a small causal LM with the
target's vocabulary; it keeps a block table per target sequence in a paged cache of its own,
catches up on the tokens it has not seen, samples k tokens one step at a time, and rolls its
cache back to what the target accepted. `probabilities` (what `sample_tokens` draws from) gives
both the draft's q and the target's p; `sampling_logprobs` the behaviour log-probs it records.
"""

import copy

import torch
from torch import Tensor

from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.blocks import BlockPool, blocks_needed
from minirl.rollout.sampling import sample_tokens


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
