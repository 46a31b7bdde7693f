"""Exercise 5.2, wrong: forgets the empty step: a prompt longer than the budget waits for ever."""

EXERCISE = "5.2"


def can_admit(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget, step_is_empty):
    return num_running < max_num_seqs and blocks_wanted <= blocks_free and new_tokens <= token_budget
