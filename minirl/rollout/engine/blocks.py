# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Paged KV memory: fixed-size blocks, a free list, reference counts and content hashes.

The KV cache is cut into `num_blocks` blocks of `block_size` token slots each. A sequence
owns a block table (a list of block ids) and gets a new block only when its last one is
full, so it never holds more than block_size - 1 empty slots (vLLM's PagedAttention). A
block shared by several sequences (the G completions of one prompt) has a reference count;
it goes back to the free list when the count drops to 0.

Free blocks keep their content and their hash until they are handed out again, and the free
list hands out the block freed longest ago first: a block that a prefix cache still knows
survives as long as the memory allows (least recently used is reused first).

Simplified vs vLLM: one pool on one device, no swapping to CPU memory, no copy-on-write of a
partly filled shared block (only full blocks are shared).
"""

__all__ = ["blocks_needed", "grow_table", "block_hash", "BlockPool"]

from collections import OrderedDict
from typing import Callable


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` token slots: ceil(num_tokens / block_size); 0 for 0 tokens."""
    return -(-num_tokens // block_size)


def grow_table(table: list[int], num_tokens: int, block_size: int, take: Callable[[], int]) -> int:
    """Append blocks to a sequence's block table until it has room for `num_tokens` tokens.

    table: the sequence's block ids, in order (block i holds positions i*block_size ..
    (i+1)*block_size - 1); take(): hands out one free block id (for example BlockPool.allocate).
    Blocks are taken only when needed: a table that already covers num_tokens slots is left
    as it is (it never shrinks here). Returns the number of blocks appended.
    """
    added = 0
    while len(table) * block_size < num_tokens:
        table.append(take())
        added += 1
    return added


def block_hash(parent: int | None, tokens) -> int:
    """The hash of one full block: its tokens, chained with the hash of the block before it.

    Chaining makes a block's hash stand for the whole prefix up to its end, so two sequences
    share block i only if they agree on every token up to the end of block i. Python's hash
    of a tuple of ints is deterministic across runs (only str/bytes hashes are salted).
    """
    return hash((parent, *tokens))


class BlockPool:
    """num_blocks blocks, each with a reference count; the free ones in least-recently-freed order.

    allocate() hands out the free block freed longest ago (ref count 1); retain(b) adds a
    holder (taking b off the free list if it was free: a cache hit on a freed block);
    release(b) drops one and frees b at 0. Callbacks in `on_reuse` hear about a free block
    being handed out again, so that a cache forgets the content it is about to lose.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse: list[Callable[[int], None]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A free block with reference count 1; RuntimeError if none is free (the scheduler checks first)."""
        if not self.free:
            raise RuntimeError(f"BlockPool: all {self.num_blocks} blocks are in use")
        block, _ = self.free.popitem(last=False)        # the one freed longest ago
        for forget in self.on_reuse:
            forget(block)
        self.ref[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of `block` (a sequence sharing it, or a cache keeping it)."""
        if self.ref[block] == 0:
            del self.free[block]                         # a freed block brought back: its content is intact
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at 0 the block joins the free list (content kept until reused)."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"BlockPool.release({block}): the block is already free (double free)")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

    def grow(self, num_blocks: int) -> None:
        """Add blocks up to `num_blocks` in all; the new ones are handed out before any freed one."""
        new = range(self.num_blocks, num_blocks)
        self.ref += [0] * len(new)
        self.free = OrderedDict.fromkeys([*new, *self.free])   # freed blocks keep their content longer
        self.num_blocks = max(self.num_blocks, num_blocks)

    def check(self) -> None:
        """Raise AssertionError unless the free list is exactly the blocks with reference count 0."""
        zero = {b for b, r in enumerate(self.ref) if r == 0}
        assert zero == set(self.free), f"free list {sorted(self.free)[:8]} != blocks with ref 0 {sorted(zero)[:8]}"
        assert all(r >= 0 for r in self.ref), "a negative reference count"
