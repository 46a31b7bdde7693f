"""Exercise 5.2, wrong: lets one sequence too many in (> instead of >=)."""

EXERCISE = "5.2"


def can_admit(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget, step_is_empty):
    if num_running > max_num_seqs or blocks_wanted > blocks_free:
        return False
    return new_tokens <= token_budget or step_is_empty
