# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""A radix-tree prefix cache, SGLang's RadixAttention at block granularity.

Each edge holds a run of full blocks; a node's children are keyed by the tokens of their first
block. Edge splits and LRU eviction: `minirl.runtime.cache_upkeep`. Simplified vs SGLang: whole
blocks only, no cache-aware reordering of the waiting queue.
"""

__all__ = ["Node", "RadixCache"]

import itertools

from minirl.rollout.engine.blocks import BlockPool
from minirl.runtime.cache_upkeep import RadixUpkeep


class Node:
    """A tree node: the edge from its parent (tokens and the blocks holding them), its children."""

    __slots__ = ("parent", "first", "tokens", "blocks", "children", "last_access")

    def __init__(self, parent, tokens: tuple, blocks: list[int], clock: int, block_size: int):
        self.parent, self.tokens, self.blocks = parent, tokens, blocks
        self.first = tokens[:block_size]             # the key under which the parent finds it
        self.children: dict[tuple, "Node"] = {}
        self.last_access = clock


class RadixCache(RadixUpkeep):
    """Prefix cache over a BlockPool as a radix tree of block runs; PrefixCache's interface."""

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.root = Node(None, (), [], 0, pool.block_size)
        self.held: set[int] = set()                  # blocks the tree holds a reference to
        self.clock = itertools.count(1)
        self.hit_tokens = self.lookup_tokens = 0

    def chunk(self, tokens, i: int) -> tuple:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def walk(self, tokens: list[int], limit: int):
        """Follow `tokens` down the tree for at most `limit` blocks.

        Returns (blocks found, last node reached, number of that node's edge blocks matched).
        """
        node, blocks, now = self.root, [], next(self.clock)
        node.last_access = now
        while len(blocks) < limit:
            child = node.children.get(self.chunk(tokens, len(blocks)))
            if child is None:
                return blocks, node, len(node.blocks)
            child.last_access = now
            n = 0
            while n < len(child.blocks) and len(blocks) < limit and \
                    self.chunk(child.tokens, n) == self.chunk(tokens, len(blocks)):
                blocks.append(child.blocks[n])
                n += 1
            if n < len(child.blocks):
                return blocks, child, n
            node = child
        return blocks, node, len(node.blocks)

    def match(self, tokens: list[int]) -> list[int]:
        blocks, _, _ = self.walk(tokens, (len(tokens) - 1) // self.block_size)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def insert(self, tokens: list[int], block_table: list[int]) -> None:
        """Add the full blocks of `tokens` (held in `block_table`), sharing what the tree has."""
        full = len(tokens) // self.block_size
        found, node, n = self.walk(tokens, full)
        if n < len(node.blocks):                     # the sequence leaves this edge midway: split it
            node = self.split(node, n)
        if len(found) < full:
            bs = self.block_size
            leaf = Node(node, tuple(tokens[len(found) * bs:full * bs]),
                        list(block_table[len(found):full]), next(self.clock), bs)
            node.children[leaf.first] = leaf
            for b in leaf.blocks:
                self.pool.retain(b)
                self.held.add(b)
