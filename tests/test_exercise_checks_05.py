"""The checks of notebook 05's exercises fail plausible wrong versions (a check that cannot fail is a defect)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from minirl.rollout.engine.blocks import block_hash

spec = importlib.util.spec_from_file_location(
    "checks05", Path(__file__).parent / "exercises" / "test_05_generation_speed.py")
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)


# ---------------------------------------------------------------- 5.1


def grow_floor_plus_one(table, num_tokens, block_size, take):
    """Takes num_tokens // block_size + 1 blocks: one too many on a block boundary."""
    added = 0
    while len(table) < num_tokens // block_size + 1 and num_tokens:
        table.append(take())
        added += 1
    return added


def grow_floor(table, num_tokens, block_size, take):
    """Takes num_tokens // block_size blocks: too few for a partial last block."""
    added = 0
    while len(table) < num_tokens // block_size:
        table.append(take())
        added += 1
    return added


def grow_ignoring_the_table(table, num_tokens, block_size, take):
    """Appends ceil(num_tokens / block_size) blocks whatever the table already holds."""
    n = -(-num_tokens // block_size)
    table += [take() for _ in range(n)]
    return n


@pytest.mark.parametrize("wrong", [grow_floor_plus_one, grow_floor, grow_ignoring_the_table])
def test_grow_table_checks_fail_wrong_versions(wrong):
    with pytest.raises(AssertionError):
        checks.check_grow_table_counts(wrong)
        checks.check_grow_table_keeps_what_is_there(wrong)
        checks.check_grow_table_for_a_set_of_sequences(wrong)


# ---------------------------------------------------------------- 5.2


def admit_full_batch(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget, step_is_empty):
    """Lets one sequence too many in (> instead of >=)."""
    if num_running > max_num_seqs or blocks_wanted > blocks_free:
        return False
    return new_tokens <= token_budget or step_is_empty


def admit_strict_blocks(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget, step_is_empty):
    """Wants a spare block (>= instead of >)."""
    if num_running >= max_num_seqs or blocks_wanted >= blocks_free:
        return False
    return new_tokens <= token_budget or step_is_empty


def admit_without_exception(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget,
                            step_is_empty):
    """Forgets the empty step: a prompt longer than the budget waits for ever."""
    return num_running < max_num_seqs and blocks_wanted <= blocks_free and new_tokens <= token_budget


def admit_empty_step_always(num_running, max_num_seqs, blocks_wanted, blocks_free, new_tokens, token_budget,
                            step_is_empty):
    """Lets an empty step take anything, memory included."""
    if step_is_empty:
        return True
    return num_running < max_num_seqs and blocks_wanted <= blocks_free and new_tokens <= token_budget


@pytest.mark.parametrize("wrong", [admit_full_batch, admit_strict_blocks, admit_without_exception,
                                   admit_empty_step_always])
def test_can_admit_checks_fail_wrong_versions(wrong):
    with pytest.raises(AssertionError):
        checks.check_can_admit_slots_and_blocks(wrong)
        checks.check_can_admit_token_budget(wrong)


# ---------------------------------------------------------------- 5.3


def match(tokens, block_size, table, chained=True, last_rule=True, compare=True, stop=True):
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


@pytest.mark.parametrize("flaw", ["chained", "last_rule", "compare", "stop"])
def test_match_prefix_checks_fail_wrong_versions(flaw):
    wrong = lambda tokens, bs, table: match(tokens, bs, table, **{flaw: False})   # noqa: E731
    with pytest.raises(AssertionError):
        checks.check_match_prefix_chain(wrong)
        checks.check_match_prefix_last_token(wrong)
        checks.check_match_prefix_gaps_and_collisions(wrong)


# ---------------------------------------------------------------- 5.4


def accept(p, q, draft, generator=None, rule="right", run="leading", residual="p - q"):
    S, k = draft.shape
    p_d = p[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_d = q.gather(2, draft[..., None]).squeeze(2)
    u = torch.rand(S, k, generator=generator)
    kept = {"right": u * q_d < p_d, "p >= q": p_d >= q_d, "q / p": u * p_d < q_d}[rule]
    accepted = kept.long().cumprod(1).sum(1) if run == "leading" else kept.long().sum(1)
    rows = torch.arange(S)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    dist = p[rows, accepted] if residual == "p" else (p[rows, accepted] - q_pad[rows, accepted]).clamp(min=0)
    return accepted, torch.multinomial(dist / dist.sum(1, keepdim=True), 1, generator=generator).squeeze(1)


@pytest.mark.parametrize("flaw", [{"rule": "p >= q"}, {"rule": "q / p"}, {"run": "any"}, {"residual": "p"}])
def test_accept_draft_checks_fail_wrong_versions(flaw):
    wrong = lambda p, q, d, g=None: accept(p, q, d, g, **flaw)   # noqa: E731
    with pytest.raises(AssertionError):
        checks.check_accept_draft_distribution(wrong)
    assert checks.bigram_pvalue(wrong) < 1e-6, "a wrong rule is rejected by far, not by luck"


def test_accept_draft_checks_pass_a_correct_rule_on_other_seeds():
    """The check's false-failure rate: p-values of a correct rule spread over (0, 1) from seed to seed."""
    pvalues = [checks.bigram_pvalue(accept, n=2000, seed=s) for s in range(5)]
    assert min(pvalues) > 1e-3 and max(pvalues) > 0.2, pvalues
