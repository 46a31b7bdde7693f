# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Paged KV memory: fixed-size blocks, a free list, reference counts and content hashes.

A sequence owns a block table and gets a new block only when its last one is full (vLLM's
PagedAttention). Shared blocks are reference-counted. Simplified vs vLLM: one pool on one
device, no swapping to CPU memory, no copy-on-write (only full blocks are shared).
"""

__all__ = ["blocks_needed", "grow_table", "block_hash", "BlockPool"]

from collections import OrderedDict
from typing import Callable

from minirl.runtime.cache_upkeep import PoolUpkeep


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


class BlockPool(PoolUpkeep):
    """num_blocks blocks, each with a reference count; the free ones in least-recently-freed order.

    allocate() hands out the free block freed longest ago (ref count 1); retain(b) adds a
    holder (taking b off the free list if it was free: a cache hit on a freed block);
    release(b) drops one and frees b at 0. Callbacks in `on_reuse` hear about a free block
    being handed out again, so that a cache forgets the content it is about to lose.
    `num_free`, `num_used`, `grow` and `check`: `minirl.runtime.cache_upkeep`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} and block_size={block_size} "
                             "must both be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse: list[Callable[[int], None]] = []

    def allocate(self) -> int:
        """A free block with reference count 1; RuntimeError if none is free."""
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
            del self.free[block]                 # a freed block brought back: its content is intact
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at 0 the block joins the free list (content kept until reused)."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"BlockPool.release({block}): a double free")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None
