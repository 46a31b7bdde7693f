# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""A radix-tree prefix cache with LRU eviction, SGLang's RadixAttention at block granularity.

The cached token sequences form a tree: each edge holds a run of full blocks (their tokens
and block ids) and each node's children are keyed by the tokens of their first block. A
lookup walks down from the root as far as the tokens agree; an insertion walks the same way,
splits an edge where the new sequence departs from it, and hangs the rest as a new leaf.
This suits multi-turn and branching prompts: turn t + 1 of a conversation starts with all of
turn t (prompt and answer), and branches of one context share their trunk.

The tree holds a reference to each of its blocks, so cached blocks are not in the free list:
when the pool runs dry the scheduler asks the tree to `evict`, and the tree frees blocks
from the least recently used leaves first (a running sequence's blocks are never evicted:
their reference count is above the tree's own 1). An inner node goes only after its children.

Simplified vs SGLang: whole blocks only (SGLang can match single tokens); no cache-aware
reordering of the waiting queue (SGLang serves the longest shared prefix first).
"""

__all__ = ["Node", "RadixCache"]

import heapq
import itertools

from minirl.rollout.engine.blocks import BlockPool


class Node:
    """A tree node: the edge from its parent (tokens and the blocks that hold them) and its children."""

    __slots__ = ("parent", "first", "tokens", "blocks", "children", "last_access")

    def __init__(self, parent, tokens: tuple, blocks: list[int], clock: int, block_size: int):
        self.parent, self.tokens, self.blocks = parent, tokens, blocks
        self.first = tokens[:block_size]             # the key under which the parent finds it
        self.children: dict[tuple, "Node"] = {}
        self.last_access = clock


class RadixCache:
    """Prefix cache over a BlockPool as a radix tree of block runs; same interface as PrefixCache."""

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
                    child.tokens[n * self.block_size:(n + 1) * self.block_size] == self.chunk(tokens, len(blocks)):
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
        """Add the full blocks of `tokens` (held in `block_table`) to the tree, sharing what is there."""
        full = len(tokens) // self.block_size
        found, node, n = self.walk(tokens, full)
        if n < len(node.blocks):                     # the sequence leaves this edge midway: split it
            node = self.split(node, n)
        if len(found) < full:
            bs = self.block_size
            leaf = Node(node, tuple(tokens[len(found) * bs:full * bs]), list(block_table[len(found):full]),
                        next(self.clock), bs)
            node.children[leaf.first] = leaf
            for b in leaf.blocks:
                self.pool.retain(b)
                self.held.add(b)

    def split(self, node: Node, n: int) -> Node:
        """Cut `node`'s edge after n blocks; returns the new upper node (the old one hangs below it)."""
        bs = self.block_size
        upper = Node(node.parent, node.tokens[:n * bs], node.blocks[:n], node.last_access, bs)
        node.parent.children[upper.first] = upper
        node.tokens, node.blocks, node.parent = node.tokens[n * bs:], node.blocks[n:], upper
        node.first = node.tokens[:bs]
        upper.children[node.first] = node
        return upper

    def evictable_blocks(self) -> set[int]:
        """Blocks `evict` can free: held by the tree alone, with nothing below them in use.

        A block is in use when its reference count exceeds the tree's own 1. Usually a block in
        use keeps its whole path in use, but a sequence that computed a duplicate of a tree block
        (the last prompt block is always computed) can hold a deeper block and not the tree's copy
        of an earlier one: that earlier block must wait for the deeper one (evicting it would
        orphan the subtree).
        """
        free: set[int] = set()

        def visit(node) -> bool:                     # True: the whole subtree is evictable
            below = all([visit(child) for child in node.children.values()])
            for b in reversed(node.blocks):
                if not below or self.pool.ref[b] != 1:
                    return False
                free.add(b)
            return below

        visit(self.root)
        return free

    def evictable(self) -> int:
        return len(self.evictable_blocks())

    def evict(self, n: int) -> int:
        """Free up to n blocks, least recently used leaves first, each leaf from its last block back."""
        heap = [(node.last_access, id(node), node) for node in self.nodes() if not node.children]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            while node.blocks and freed < n and self.pool.ref[node.blocks[-1]] == 1:
                block = node.blocks.pop()
                node.tokens = node.tokens[:-self.block_size]
                self.held.discard(block)
                self.pool.release(block)
                freed += 1
            if not node.blocks:
                parent = node.parent
                del parent.children[node.first]
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
