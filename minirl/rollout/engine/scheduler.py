# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Continuous batching: which sequences run in the next step, and with which blocks.

Every step the scheduler (1) gives each running sequence one decode token, and a new block
when its last one is full, preempting the most recently admitted sequences when no block is
left (their blocks are freed; they go back to the front of the queue and recompute their
tokens later); then (2) admits waiting sequences, first come first served, while a batch
slot, enough free blocks and the step's token budget allow (`can_admit`). Prefills of the
newly admitted and decode tokens of the running sequences run in the same forward pass.
A sequence leaves at its EOS or its token limit and frees its blocks at once, so a
waiting one can take its place in the very next step: that is continuous batching.

`policy="static"` is the baseline: a batch is admitted only when the previous one has
completely finished, and a finished sequence keeps its row (it is computed as padding)
until the longest one of its batch ends, as HF `generate` and other fixed-shape batchers do.
`reserve="max_length"` allocates blocks for prompt + max_tokens at admission, the
contiguous preallocation paged attention replaces.

Simplified vs vLLM: no chunked prefill (a prompt longer than the token budget runs alone in
its step), no priorities, no swapping preempted blocks to CPU memory (recompute only).
"""

__all__ = ["WAITING", "RUNNING", "FINISHED", "Sequence", "SchedulerState", "can_admit", "Scheduler"]

from collections import deque
from dataclasses import dataclass, field

from minirl.rollout.engine.blocks import BlockPool, blocks_needed, grow_table

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One completion being generated: the prompt, the tokens so far, and where its KV lives.

    Compared by identity (eq=False): the scheduler looks sequences up in its lists every step,
    and a field-by-field comparison of token lists would cost more than the lookup.
    """

    id: int
    tokens: list[int]              # prompt + generated tokens
    prompt_len: int
    max_tokens: int                # generated tokens at most
    temperature: float = 1.0       # 0: greedy
    eos_token_id: int | None = None
    logprobs: list[float] = field(default_factory=list)   # behaviour log-prob of each generated token
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose keys/values are in the cache
    num_cached: int = 0            # of the prompt, tokens found in the prefix cache (last admission)
    num_preempted: int = 0
    status: str = WAITING
    spans: list[list[int]] = field(default_factory=list)   # [first step, last step] of each stay in the batch
    finish_reason: str | None = None   # "eos", "length" or "error"
    error: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_new(self) -> int:
        """Tokens to compute in the next step: all not yet cached; a padding row of a static batch: 1."""
        return 1 if self.status == FINISHED else len(self.tokens) - self.num_computed


class SchedulerState:
    """Waiting queue, running batch, blocks: what the scheduler moves from step to step, and the moves
    that need no decision (queue, take a block, release, finish); `Scheduler` decides each step's work.

    cache: a prefix cache (`PrefixCache` or `RadixCache`) or None. `timeline` records, per
    step, how many sequences ran, were admitted and were preempted, and the blocks in use.
    """

    def __init__(self, pool: BlockPool, cache=None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 policy: str = "continuous", reserve: str = "on_demand", lookahead: int = 0):
        if policy not in ("continuous", "static"):
            raise ValueError(f"Scheduler: policy={policy!r}; use 'continuous' or 'static'")
        if reserve not in ("on_demand", "max_length"):
            raise ValueError(f"Scheduler: reserve={reserve!r}; use 'on_demand' (paged) or 'max_length' (contiguous)")
        self.pool, self.cache = pool, cache
        self.block_size = pool.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.policy, self.reserve, self.lookahead = policy, reserve, lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.timeline: list[dict] = []
        self.on_release: list = []                   # callbacks(seq): a draft model frees its own blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_blocks(self) -> int:
        """Blocks the scheduler may take: free ones, plus those a cache would give back on request."""
        return self.pool.num_free + (self.cache.evictable() if self.cache is not None else 0)

    def take_block(self) -> int:
        if self.pool.num_free == 0 and self.cache is not None:
            self.cache.evict(1)
        return self.pool.allocate()

    def tokens_to_hold(self, seq: Sequence) -> int:
        """Token slots the sequence needs in the next step: what it will have computed (+ lookahead)."""
        if self.reserve == "max_length":
            return max(seq.prompt_len + seq.max_tokens, seq.num_computed + seq.num_new) + self.lookahead
        return seq.num_computed + seq.num_new + self.lookahead

    def release(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):          # last blocks first: they are evicted first
            self.pool.release(b)
        seq.block_table = []
        seq.num_computed = 0
        for callback in self.on_release:
            callback(seq)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """`seq` is done; continuous: its slot and blocks are free now; static: when its batch is done."""
        seq.status, seq.finish_reason, seq.error = FINISHED, reason, error
        if seq.spans:
            seq.spans[-1][1] = len(self.timeline) - 1
        if self.policy == "static" and seq in self.running and any(s.status == RUNNING for s in self.running):
            return                                   # it stays as a padding row of its batch
        if self.policy == "static":
            for s in [s for s in self.running if s.status == FINISHED]:
                self.running.remove(s)
                self.release(s)
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)


def can_admit(num_running: int, max_num_seqs: int, blocks_wanted: int, blocks_free: int,
              new_tokens: int, token_budget: int, step_is_empty: bool) -> bool:
    """The admission rule: may the first waiting sequence join the next step?

    num_running: sequences already running (batch slots in use); max_num_seqs: slots in all.
    blocks_wanted: free blocks its admission takes (all the blocks its tokens need, minus
    those a prefix-cache hit lets it share with running sequences); blocks_free: free blocks
    now. new_tokens: tokens it must compute (those not found in the cache); token_budget:
    tokens the step may still take. step_is_empty: nothing is scheduled in this step yet.
    Admit iff a slot is free, the blocks it wants are free, and its new tokens fit the
    budget; a sequence larger than the whole budget may still run alone in an empty step
    (otherwise it would wait for ever).
    """
    if num_running >= max_num_seqs or blocks_wanted > blocks_free:
        return False
    return new_tokens <= token_budget or step_is_empty


class Scheduler(SchedulerState):
    """Decides each step's work (see the module docstring): decodes first, preempting the most
    recently admitted sequence when blocks run out, then admissions while `can_admit` allows."""

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (sequence, number of new tokens to compute) pairs, decodes first."""
        work, preempted = [], 0
        budget = self.max_num_batched_tokens
        for seq in list(self.running):                                    # 1. one decode token each
            if seq not in self.running:                                   # preempted for an earlier one
                continue
            wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(seq.block_table)
            while wanted > self.free_blocks() and seq in self.running:
                self.preempt(self.running[-1])                            # the most recently admitted
                preempted += 1
            if seq in self.running:
                grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
                work.append((seq, seq.num_new))
                budget -= seq.num_new
        admitted = 0
        static = self.policy == "static"
        batch_running = static and len(self.running) > 0          # static: the next batch waits for this one
        while self.waiting and not preempted and not batch_running:       # 2. admissions, in order
            seq = self.waiting[0]
            # a static batch is prefilled whole in one step, as HF generate does
            if not self.admit(seq, float("inf") if static else budget, step_is_empty=not work):
                break
            self.waiting.popleft()
            self.running.append(seq)
            work.append((seq, seq.num_new))
            budget -= seq.num_new
            admitted += 1
            self.register(seq)                        # its siblings, admitted next, can share its blocks now
        for seq, _ in work[:len(work) - admitted]:
            self.register(seq)
        self.timeline.append({"running": len(work), "admitted": admitted, "preempted": preempted,
                              "waiting": len(self.waiting), "blocks_used": self.pool.num_used,
                              "tokens": sum(n for _, n in work),
                              "held": sum(s.num_computed + n for s, n in work),          # KV slots filled after it
                              "reserved_max": sum(s.prompt_len + s.max_tokens for s, _ in work)})
        return work

    def register(self, seq: Sequence) -> None:
        """Tell the cache about the blocks `seq` fills in this step (only when a block becomes full)."""
        done = seq.num_computed + seq.num_new
        if self.cache is not None and seq.status == RUNNING and done // self.block_size > seq.num_computed // \
                self.block_size:
            self.cache.insert(seq.tokens[:done], seq.block_table)

    def admit(self, seq: Sequence, budget: int, step_is_empty: bool) -> bool:
        """Give `seq` its blocks (cached ones shared, the rest new) if `can_admit` says it fits."""
        cached = self.cache.match(seq.tokens) if self.cache is not None else []
        # a cached block still in use by another sequence costs nothing; a free (or evictable) one is taken
        evictable = self.cache.evictable_blocks() if cached else set()
        taken = sum(1 for b in cached if self.pool.ref[b] == 0 or b in evictable)
        wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(cached) + taken
        new_tokens = len(seq.tokens) - len(cached) * self.block_size
        if not can_admit(len(self.running), self.max_num_seqs, wanted, self.free_blocks(), new_tokens, budget,
                         step_is_empty):
            return False
        for b in cached:
            self.pool.retain(b)
        seq.block_table = list(cached)
        grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
        seq.num_computed = seq.num_cached = len(cached) * self.block_size
        seq.status = RUNNING
        seq.spans.append([len(self.timeline), len(self.timeline)])
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and requeue it at the front; it recomputes its tokens when readmitted."""
        self.running.remove(seq)
        self.release(seq)
        seq.spans[-1][1] = len(self.timeline) - 1      # it last ran in the previous step
        if seq.status == FINISHED:                   # a padding row of a static batch: nothing to resume
            return
        seq.status = WAITING
        seq.num_preempted += 1
        self.waiting.appendleft(seq)
