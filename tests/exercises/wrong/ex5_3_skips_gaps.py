"""Exercise 5.3, wrong: skips a missing block and keeps matching after it (a prefix with a hole)."""

from minirl.rollout.engine.blocks import block_hash

EXERCISE = "5.3"


def match_prefix(tokens, block_size, table):
    chained, last_rule, compare, stop = True, True, True, False
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
