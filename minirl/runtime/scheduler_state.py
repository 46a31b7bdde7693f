"""The scheduler's state and the moves that need no decision: sequences, queues, blocks.

Hand-written; notebook 05's `Scheduler` (`minirl/rollout/engine/scheduler.py`) adds the
decisions of continuous batching (which sequences run next, admission, preemption) on top.

`Sequence` is one completion as the scheduler sees it: its tokens, its block table, how many
of its tokens are already in the cache, its status (waiting, running, finished) and the steps
it spent in the batch. `SchedulerState` holds the waiting queue, the running batch and the
block pool, checks the scheduler's arguments, and makes the plain moves: queue a sequence,
take a block (asking the prefix cache to evict one when the pool is empty), release a
sequence's blocks (last block first, so the pool reuses them before the prompt blocks a
prefix cache may still find), finish a sequence (under `policy="static"` a finished
sequence keeps its row and its blocks until its whole batch is done), `register` the blocks a
sequence fills with the prefix cache, and `preempt` a sequence (free its blocks, requeue it at
the front; it recomputes its tokens when readmitted), and `record` each step in `timeline`.
"""

from collections import deque
from dataclasses import dataclass, field

from minirl.rollout.engine.blocks import BlockPool

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

    def register(self, seq: Sequence) -> None:
        """Tell the cache about the blocks `seq` fills in this step (only when a block becomes full)."""
        done = seq.num_computed + seq.num_new
        fills = done // self.block_size > seq.num_computed // self.block_size
        if self.cache is not None and seq.status == RUNNING and fills:
            self.cache.insert(seq.tokens[:done], seq.block_table)

    def preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and requeue it at the front; it recomputes its tokens when readmitted."""
        self.running.remove(seq)
        self.release(seq)
        seq.spans[-1][1] = len(self.timeline) - 1      # it last ran in the previous step
        if seq.status == FINISHED:                     # a padding row of a static batch: nothing to resume
            return
        seq.status = WAITING
        seq.num_preempted += 1
        self.waiting.appendleft(seq)

    def record(self, work: list, admitted: int, preempted: int) -> None:
        """Append one step to `timeline`: sequences run, admitted, preempted and waiting, blocks in use,
        tokens computed, KV slots filled after the step, and what contiguous reservation would hold."""
        self.timeline.append({"running": len(work), "admitted": admitted, "preempted": preempted,
                              "waiting": len(self.waiting), "blocks_used": self.pool.num_used,
                              "tokens": sum(n for _, n in work),
                              "held": sum(s.num_computed + n for s, n in work),
                              "reserved_max": sum(s.prompt_len + s.max_tokens for s, _ in work)})
