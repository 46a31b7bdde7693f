# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Prefix caching: full blocks found again by the chained hash of their content, and shared.

A registered block stays findable after its last user frees it, until the pool hands it out
again. Simplified vs vLLM: Python's tuple hash instead of SHA-256 (a collision is caught by
comparing the tokens).
"""

__all__ = ["match_prefix", "PrefixCache"]

from minirl.rollout.engine.blocks import BlockPool, block_hash
from minirl.runtime.cache_upkeep import NoEviction


def match_prefix(tokens: list[int], block_size: int,
                 table: dict[int, tuple[int, tuple]]) -> list[int]:
    """The blocks holding the longest cached prefix of `tokens`, whole blocks only.

    table maps a block hash (`block_hash(parent_hash, block_tokens)`, parent_hash None for
    the first block) to (block id, the block's tokens as a tuple). Walk the full blocks of
    `tokens` in order, chaining the hashes, and collect the block ids until the first block
    that is missing or whose stored tokens differ (a hash collision). Only the first
    (len(tokens) - 1) // block_size blocks are candidates: the last token is always computed.
    """
    blocks, parent = [], None
    for i in range((len(tokens) - 1) // block_size):
        chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent, chunk)
        hit = table.get(parent)
        if hit is None or hit[1] != chunk:
            break
        blocks.append(hit[0])
    return blocks


class PrefixCache(NoEviction):
    """Hash-chained full-block prefix cache over a BlockPool (vLLM's automatic prefix caching).

    match(tokens) -> block ids to share; insert(tokens, block_table) registers the full
    blocks of a sequence whose keys/values are (or are being) computed. `hit_tokens` /
    `lookup_tokens` count tokens found / tokens asked for at admission.
    """

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.table: dict[int, tuple[int, tuple]] = {}      # hash -> (block, tokens)
        self.hash_of: dict[int, int] = {}                  # block -> hash
        self.hit_tokens = self.lookup_tokens = 0
        pool.on_reuse.append(self.forget)

    def match(self, tokens: list[int]) -> list[int]:
        blocks = match_prefix(tokens, self.block_size, self.table)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def insert(self, tokens: list[int], block_table: list[int]) -> None:
        """Register every full block of `tokens` (held in `block_table`) not registered yet.

        A registered block stands for its whole prefix (its hash is chained), so hashing
        resumes after the last registered block instead of from the first.
        """
        full = len(tokens) // self.block_size
        start = full
        while start > 0 and block_table[start - 1] not in self.hash_of:
            start -= 1
        parent = self.hash_of[block_table[start - 1]] if start > 0 else None
        for i in range(start, full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, chunk)
            if parent not in self.table:          # first copy wins; a duplicate stays private
                self.table[parent] = (block_table[i], chunk)
                self.hash_of[block_table[i]] = parent

    def forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.table.get(h, (None,))[0] == block:
            del self.table[h]
