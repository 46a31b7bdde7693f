"""Exercise 5.1, wrong: takes num_tokens // block_size blocks: too few for a partial last block."""

EXERCISE = "5.1"


def grow_table(table, num_tokens, block_size, take):
    added = 0
    while len(table) < num_tokens // block_size:
        table.append(take())
        added += 1
    return added
