"""Upkeep of the paged KV memory: growing and checking the block pool, and evicting from the caches.

Hand-written; notebook 05 builds the pool (`BlockPool`), the hash-chain prefix cache
(`PrefixCache`) and the radix tree (`RadixCache`), and each inherits its upkeep from here:

- `PoolUpkeep`: `grow` (more blocks when the engine's cache grows; the new ones are handed out
  before any freed one, so freed blocks keep their content longer) and `check` (the invariant
  everything relies on: the free list is exactly the blocks nobody holds).
- `NoEviction`: the hash-chain cache keeps its blocks in the pool's free list, so it has nothing
  to evict (the pool reuses freed blocks least recently freed first).
- `RadixUpkeep`: the radix tree's edge splitting and its eviction, below.

The tree holds a reference to each of its blocks, so cached blocks are not in the free list:
when the pool runs dry the scheduler asks the tree to `evict`, and the tree frees blocks from
the least recently used leaves first, each leaf from its last block back, so a shared prefix
goes last. A block some running sequence still holds (reference count above the tree's own 1)
is never evicted, and an inner node goes only after its children.
"""

import heapq
from collections import OrderedDict


class PoolUpkeep:
    """`num_free`, `num_used`, `grow` and `check` for a block pool (`num_blocks`, `ref`, `free`)."""

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

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


class NoEviction:
    """A cache whose blocks sit in the pool's free list: nothing to evict on request."""

    def evictable(self) -> int:
        return 0

    def evictable_blocks(self) -> set[int]:
        return set()

    def evict(self, n: int) -> None:
        pass


class RadixUpkeep:
    """Splitting an edge of a radix tree (`root`, `pool`, `held`, `block_size`; nodes with `parent`,
    `first`, `tokens`, `blocks`, `children`, `last_access`), and what it can give back to the pool."""

    def split(self, node, n: int):
        """Cut `node`'s edge after n blocks; returns the new upper node (the old one hangs below it)."""
        bs = self.block_size
        upper = type(node)(node.parent, node.tokens[:n * bs], node.blocks[:n], node.last_access, bs)
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
