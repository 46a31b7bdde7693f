"""Exercise 5.1, wrong: appends ceil(num_tokens / block_size) blocks whatever the table already holds."""

EXERCISE = "5.1"


def grow_table(table, num_tokens, block_size, take):
    n = -(-num_tokens // block_size)
    table += [take() for _ in range(n)]
    return n
