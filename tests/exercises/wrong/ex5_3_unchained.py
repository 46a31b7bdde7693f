"""Exercise 5.3, wrong: hashes each block alone, not chained to its prefix:
equal blocks after different prefixes match."""

from minirl.rollout.engine.blocks import block_hash

EXERCISE = "5.3"


def match_prefix(tokens, block_size, table):
    chained, last_rule, compare, stop = False, True, True, True
    blocks, parent = [], None
    n = (len(tokens) - 1) // block_size if last_rule else len(tokens) // block_size
    for i in range(n):
        chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent if chained else None, chunk)
        hit = table.get(parent)
        if hit is None or (compare and hit[1] != chunk):
            if stop:
                break
            continue
        blocks.append(hit[0])
    return blocks
