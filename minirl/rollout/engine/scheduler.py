# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Continuous batching: which sequences run in the next step, and with which blocks.

`policy="static"` is the baseline (a batch waits for the previous one to finish);
`reserve="max_length"` is contiguous preallocation. Simplified vs vLLM: no chunked prefill, no
priorities, no swapping to CPU memory (preempted sequences recompute).
"""

__all__ = ["can_admit", "Scheduler"]

from minirl.rollout.engine.blocks import blocks_needed, grow_table
from minirl.runtime.scheduler_state import RUNNING, SchedulerState, Sequence


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
    """Decides each step's work: decodes first, preempting the most recently admitted sequence
    when blocks run out, then admissions while `can_admit` allows."""

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (sequence, new tokens to compute) pairs, decodes first."""
        work, preempted = [], 0
        budget = self.max_num_batched_tokens
        for seq in list(self.running):                       # 1. one decode token each
            if seq not in self.running:                      # preempted for an earlier one
                continue
            wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(seq.block_table)
            while wanted > self.free_blocks() and seq in self.running:
                self.preempt(self.running[-1])               # the most recently admitted
                preempted += 1
            if seq in self.running:
                grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size,
                           self.take_block)
                work.append((seq, seq.num_new))
                budget -= seq.num_new
        admitted = 0
        static = self.policy == "static"
        batch_running = static and len(self.running) > 0     # static: the next batch waits
        while self.waiting and not preempted and not batch_running:   # 2. admissions, in order
            seq = self.waiting[0]
            # a static batch is prefilled whole in one step, as HF generate does
            if not self.admit(seq, float("inf") if static else budget, step_is_empty=not work):
                break
            self.waiting.popleft()
            self.running.append(seq)
            work.append((seq, seq.num_new))
            budget -= seq.num_new
            admitted += 1
            self.register(seq)               # its siblings, admitted next, can share its blocks
        for seq, _ in work[:len(work) - admitted]:
            self.register(seq)
        self.record(work, admitted, preempted)               # the step's line of `timeline`
        return work

    def admit(self, seq: Sequence, budget: int, step_is_empty: bool) -> bool:
        """Give `seq` its blocks (cached ones shared, the rest new) if `can_admit` says it fits."""
        cached = self.cache.match(seq.tokens) if self.cache is not None else []
        # a cached block in use by another sequence costs nothing; a free (or evictable) one is taken
        evictable = self.cache.evictable_blocks() if cached else set()
        taken = sum(1 for b in cached if self.pool.ref[b] == 0 or b in evictable)
        wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(cached) + taken
        new_tokens = len(seq.tokens) - len(cached) * self.block_size
        if not can_admit(len(self.running), self.max_num_seqs, wanted, self.free_blocks(), new_tokens,
                         budget, step_is_empty):
            return False
        for b in cached:
            self.pool.retain(b)
        seq.block_table = list(cached)
        grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
        seq.num_computed = seq.num_cached = len(cached) * self.block_size
        seq.status = RUNNING
        seq.spans.append([len(self.timeline), len(self.timeline)])
        return True
