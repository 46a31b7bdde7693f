"""The paged engine's construction, bookkeeping and rollout-engine protocol, outside the lesson.

Hand-written; notebook 05's `PagedEngine` (`minirl/rollout/engine/engine.py`) subclasses
`EngineCore` and writes what the lesson teaches: one engine step (schedule, one forward pass,
sample) and the serving loop `run`.

Here: `Request` (one completion to generate) and `Stats` (tokens computed by kind, counted by
`count` and `count_round`, and seconds per phase); the argument checks, each one line naming the
value, the limit and the fix (`request_error`, `cache_blocks`, `check_weights`); `EngineCore`,
which copies the policy into a `PagedModel`, allocates the cache in blocks (sized to the work
unless told), builds the pool, the scheduler and the prefix cache (`reset`, after every weight
update: keys and values of old weights must never be found again), grows the cache in place,
queues requests (`add`), and speaks notebook 01's rollout-engine protocol: `load_weights` (the
trainer's HF parameter names, checked before anything is copied) and `generate` (G requests per
prompt, padded into a `Rollout` with the behaviour log-probs and the policy version).
"""

import copy
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, check_tokenizer, draw_seed, make_rollout
from minirl.rollout.engine.attention import PagedModel
from minirl.rollout.engine.blocks import BlockPool, blocks_needed
from minirl.rollout.engine.prefix import PrefixCache
from minirl.rollout.engine.radix import RadixCache
from minirl.rollout.engine.scheduler import Scheduler
from minirl.rollout.hf import DTYPES
from minirl.runtime.scheduler_state import FINISHED, Sequence

CACHES = ("prefix", "radix", "none")
AUTO_CACHE_TOKENS = 65536   # the most a cache sized to the work grows to (pass num_blocks or kv_cache_bytes for more)


@dataclass
class Request:
    """One completion to generate: prompt token ids, at most `max_tokens` new tokens, temperature (0: greedy)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0


@dataclass
class Stats:
    """What the engine computed, by kind, and where the time went (seconds per phase)."""

    prompt_tokens: int = 0         # prompt (and recomputed) tokens admitted
    cached_tokens: int = 0         # of those, found in the prefix cache: no prefill
    prefill_tokens: int = 0        # tokens computed by prefills
    decode_tokens: int = 0         # tokens computed by decode steps (one per running sequence per step)
    generated_tokens: int = 0      # tokens sampled and kept
    padding_tokens: int = 0        # static batching: rows computed for sequences that had finished
    steps: int = 0
    preemptions: int = 0
    draft_tokens: int = 0          # speculation: tokens proposed
    accepted_tokens: int = 0       # speculation: proposals the target accepted
    verified_rows: int = 0         # speculation: sequences verified (each gets accepted + 1 tokens)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "sample", "draft", "postprocess"), 0.0))

    def count(self, seq: Sequence, n: int) -> None:
        """Count `n` scheduled tokens of `seq`: a prefill if it was admitted in this step, else decoding."""
        if seq.num_computed == seq.num_cached:               # admitted in this step: a prefill
            self.prompt_tokens += len(seq.tokens)
            self.cached_tokens += seq.num_cached
            self.prefill_tokens += n
        else:
            self.decode_tokens += n

    def count_round(self, rows: int, k: int, accepted: int) -> None:
        """Count one speculative round: `rows` sequences verified k + 1 tokens each, `accepted` drafts kept."""
        self.decode_tokens += rows * (k + 1)
        self.draft_tokens += rows * k
        self.accepted_tokens += accepted
        self.verified_rows += rows


def request_error(request: Request, max_model_len: int) -> str | None:
    """Why `request` cannot be served (an error message naming the value and the limit), or None."""
    P, M = len(request.prompt_ids), request.max_tokens
    if P == 0:
        return "the prompt is empty (0 tokens); pass at least one token"
    if not isinstance(M, int) or M <= 0:
        return f"max_tokens={M!r} must be an int >= 1"
    if P + M > max_model_len:
        return (f"prompt of {P} tokens + max_tokens={M} = {P + M} tokens exceeds max_model_len="
                f"{max_model_len} (the model's context); shorten the prompt or lower max_tokens")
    if request.temperature < 0:
        return f"temperature={request.temperature} must be >= 0 (0: greedy)"
    return None


def cache_blocks(model: PagedModel, block_size: int, num_blocks: int | None, kv_cache_bytes: int | None,
                 max_model_len: int) -> int:
    """Blocks in the cache: `num_blocks`, or as many as `kv_cache_bytes` holds, or (neither) one sequence's worth.

    Raises if both are given, or if the cache cannot hold one sequence of max_model_len tokens.
    """
    if num_blocks is not None and kv_cache_bytes is not None:
        raise ValueError(f"PagedEngine: num_blocks={num_blocks} and kv_cache_bytes={kv_cache_bytes}: pass one")
    if kv_cache_bytes is not None:
        per_block = model.cache_bytes_per_block(block_size)
        num_blocks = kv_cache_bytes // per_block
        if num_blocks * block_size < max_model_len:
            raise ValueError(f"PagedEngine: kv_cache_bytes={kv_cache_bytes} holds {num_blocks} blocks of "
                             f"{per_block} B, fewer than one sequence of max_model_len={max_model_len}; "
                             f"raise it to >= {blocks_needed(max_model_len, block_size) * per_block}")
    if num_blocks is None:                                   # one sequence now; `run` grows it to the work
        num_blocks = blocks_needed(max_model_len, block_size)
    if num_blocks * block_size < max_model_len:
        raise ValueError(f"PagedEngine: the cache holds num_blocks * block_size = {num_blocks} * {block_size} = "
                         f"{num_blocks * block_size} tokens, fewer than one sequence of max_model_len="
                         f"{max_model_len}; raise num_blocks to >= "
                         f"{blocks_needed(max_model_len, block_size)} or lower max_model_len")
    return num_blocks


def check_weights(state: dict, own: dict, version: int) -> None:
    """Raise, naming what differs, unless `state` has exactly the names and shapes of `own` (the engine's)."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    reshaped = sorted(f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in set(own) & set(state)
                      if own[k].shape != state[k].shape)
    if missing or unexpected or reshaped:
        raise ValueError(f"PagedEngine.load_weights(version={version}): missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, wrong shape {reshaped[:3]} (of {len(own)} tensors); push all of "
                         "the policy's tensors, by the names of the engine's model (same architecture and size)")


class EngineCore:
    """The engine's state without its step: `PagedEngine` (notebook 05) adds `step` and `run`.

    model: a Llama/Qwen2-style HF causal LM (copied; the engine keeps its own weights).
    block_size: token slots per KV block. num_blocks: blocks in the cache, or kv_cache_bytes: a
    byte budget for it (keys and values of every layer); with neither, the cache is sized to
    the work: each `run` grows it to hold its running requests (at most max_num_seqs) at their
    longest (prompt + max_tokens), up to AUTO_CACHE_TOKENS tokens; on a CPU the OS commits a
    block's memory only when it is first used. max_num_seqs: batch slots. max_num_batched_tokens:
    tokens per step (prefills beyond it wait for the next step). max_model_len: longest prompt + completion (default:
    the model's max_position_embeddings). cache: "prefix" (hash chain), "radix" (tree with
    LRU eviction) or "none". policy: "continuous" or "static" (see Scheduler). reserve:
    "on_demand" (paged) or "max_length" (contiguous preallocation, for comparison).
    draft: a `ModelDraft` or `NgramDraft` to speculate `num_speculative_tokens` tokens per step.
    """

    def __init__(self, model, tokenizer, dtype: str = "float32", device=None, block_size: int = 16,
                 num_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, cache: str = "prefix", policy: str = "continuous",
                 reserve: str = "on_demand", draft=None, num_speculative_tokens: int = 0,
                 kv_cache_bytes: int | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"PagedEngine: dtype={dtype!r}; use one of {', '.join(DTYPES)}")
        if cache not in CACHES:
            raise ValueError(f"PagedEngine: cache={cache!r}; use one of {', '.join(CACHES)}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedEngine: {name}={value!r} must be an int >= 1")
        check_tokenizer(tokenizer)
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.padding_side = "left"
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = PagedModel(copy.deepcopy(model).to(self.device, DTYPES[dtype]).eval())
        self.dtype = dtype
        context = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = max_model_len or context
        if self.max_model_len is None or self.max_model_len < 2:
            raise ValueError(f"PagedEngine: max_model_len={self.max_model_len!r}; pass the longest prompt + "
                             "completion (>= 2 tokens) the engine must hold")
        if num_speculative_tokens < 0 or (num_speculative_tokens > 0) != (draft is not None):
            raise ValueError(f"PagedEngine: num_speculative_tokens={num_speculative_tokens} with draft={draft!r}: "
                             "pass both a draft and num_speculative_tokens >= 1 to speculate, or neither")
        self.sized_to_work = num_blocks is None and kv_cache_bytes is None
        num_blocks = cache_blocks(self.model, block_size, num_blocks, kv_cache_bytes, self.max_model_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.cache_kind, self.policy, self.reserve = cache, policy, reserve
        self.draft, self.k = draft, num_speculative_tokens
        self.model.allocate_cache(num_blocks, block_size)
        if draft is not None:
            draft.attach(self)
        self.version = 0
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the cache and the queues (keys/values of other weights must never be reused)."""
        self.pool = BlockPool(self.num_blocks, self.block_size)
        caches = {"prefix": PrefixCache, "radix": RadixCache, "none": lambda pool: None}
        self.cache = caches[self.cache_kind](self.pool)
        self.scheduler = Scheduler(self.pool, self.cache, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.policy, self.reserve, lookahead=self.k)
        self.stats = Stats()
        self.next_id = 0
        self.longest = 0                 # the longest request (prompt + max_tokens) queued since the reset
        if self.draft is not None:
            self.draft.reset()
            self.scheduler.on_release.append(self.draft.release)

    def grow(self, num_blocks: int) -> None:
        """Enlarge the cache to `num_blocks` blocks (never shrinks); blocks in use and cached prefixes stay."""
        if num_blocks <= self.num_blocks:
            return
        self.model.grow_cache(num_blocks)
        self.pool.grow(num_blocks)
        if self.draft is not None:
            self.draft.grow(num_blocks)
        self.num_blocks = num_blocks


    def tick(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.stats.seconds[phase] += now - since
        return now

    # ------------------------------------------------------------------ serving
    def check(self, request: Request) -> str | None:
        """Why `request` cannot be served (an error message naming the value and the limit), or None."""
        return request_error(request, self.max_model_len)

    def add(self, request: Request) -> Sequence:
        """Queue one request; a request that cannot be served comes back finished, with its error.

        A cache sized to the work grows here too (`step` after `add`s decodes them all at once, not
        one sequence at a time): to hold the queued and running sequences (at most max_num_seqs)
        at the longest queued since `reset`, at least doubling when it grows, up to AUTO_CACHE_TOKENS.
        """
        seq = Sequence(self.next_id, list(request.prompt_ids), len(request.prompt_ids), request.max_tokens,
                       request.temperature, self.tokenizer.eos_token_id)
        self.next_id += 1
        error = self.check(request)
        if error is not None:
            seq.status, seq.finish_reason, seq.error = FINISHED, "error", error
            return seq
        self.scheduler.add(seq)
        if self.sized_to_work:
            self.longest = max(self.longest, len(request.prompt_ids) + request.max_tokens)
            queued = len(self.scheduler.waiting) + len(self.scheduler.running)
            wanted = self.blocks_for(queued, self.longest)
            if wanted > self.num_blocks:
                self.grow(min(max(wanted, 2 * self.num_blocks), AUTO_CACHE_TOKENS // self.block_size))
        return seq

    def blocks_for(self, sequences: int, longest: int) -> int:
        """Blocks that hold `sequences` sequences (at most max_num_seqs at once) of `longest` tokens each."""
        return min(sequences, self.max_num_seqs) * blocks_needed(longest + self.k, self.block_size)

    def size_to_work(self, requests: list[Request]) -> None:
        """A cache sized to the work grows to hold the servable requests (at most max_num_seqs) at their longest."""
        if not self.sized_to_work:
            return
        served = [r for r in requests if self.check(r) is None]
        if served:
            longest = max(len(r.prompt_ids) + r.max_tokens for r in served)
            self.longest = max(self.longest, longest)
            self.grow(min(self.blocks_for(len(served), longest), AUTO_CACHE_TOKENS // self.block_size))


    # ------------------------------------------------------------------ the protocol
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy the trainer's weights (HF parameter names) into the engine's copy; it now holds `version`.

        Checks every name and shape before copying anything (a model of another architecture
        or size fails with the names that differ), then empties the cache: keys and values
        computed by the old weights must not be reused by a prefix hit.
        """
        state = dict(named_tensors)
        check_weights(state, self.model.model.state_dict(), version)
        with torch.no_grad():
            self.model.model.load_state_dict(state, strict=True)
        self.model.refresh()                                     # the fused products follow the new weights
        self.version = version
        self.reset()

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        return self.model.model.named_parameters()

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """sampling.num_generations completions per prompt; rows i*G .. i*G+G-1 belong to prompts[i].

        Raises ValueError before any work if a prompt cannot be served (too long for
        max_model_len), naming the prompt, its length and the limit. See `RolloutEngine.generate`.
        """
        check_request(self, prompts, sampling, expected_version)
        G, C = sampling.num_generations, sampling.max_completion_length
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        requests = [Request(x, C, sampling.temperature) for x in ids for _ in range(G)]
        for i, x in enumerate(ids):
            if (error := self.check(Request(x, C, sampling.temperature))) is not None:
                raise ValueError(f"PagedEngine.generate: prompts[{i}]: {error}")
        seed = draw_seed(generator)
        sampler = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        seqs = self.run(requests, sampler)
        pad = self.tokenizer.pad_token_id
        P = max(len(x) for x in ids)
        width = max(len(s.completion) for s in seqs)
        prompt_ids = torch.full((len(seqs), P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(len(seqs), P, dtype=torch.long)
        completion_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        logprobs = torch.zeros(len(seqs), width)
        for row, seq in enumerate(seqs):
            n, m = seq.prompt_len, len(seq.completion)
            prompt_ids[row, P - n:] = torch.tensor(seq.tokens[:n])
            prompt_mask[row, P - n:] = 1
            completion_ids[row, :m] = torch.tensor(seq.completion, dtype=torch.long)
            logprobs[row, :m] = torch.tensor(seq.logprobs)
        return make_rollout(self.tokenizer, prompts, G, prompt_ids.to(self.device), prompt_mask.to(self.device),
                            completion_ids.to(self.device), logprobs.to(self.device), self.version)
