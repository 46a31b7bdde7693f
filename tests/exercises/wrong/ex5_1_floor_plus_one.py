"""Exercise 5.1, wrong: takes num_tokens // block_size + 1 blocks: one too many on a block boundary."""

EXERCISE = "5.1"


def grow_table(table, num_tokens, block_size, take):
    added = 0
    while num_tokens and len(table) < num_tokens // block_size + 1:
        table.append(take())
        added += 1
    return added
