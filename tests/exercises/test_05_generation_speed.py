"""Graded checks of notebook 05's exercises (python -m minirl.grade --only 05).

Each check is a plain function of the implementation (`check_*`); the wrong versions in
tests/exercises/wrong/ex5_*.py must each fail one (tests/exercises/test_wrong_versions.py), and
tests/test_exercise_checks_05.py runs 5.4's statistical checks on a correct rule over other seeds.
"""

import pytest
import torch

from minirl.rollout.engine.blocks import BlockPool, block_hash

# ---------------------------------------------------------------- 5.1 grow_table


def check_grow_table_counts(grow_table):
    for tokens, blocks in ((0, 0), (1, 1), (4, 1), (5, 2), (16, 4), (17, 5)):
        table, taken = [], iter(range(100, 200))
        added = grow_table(table, tokens, 4, lambda taken=taken: next(taken))
        assert table == list(range(100, 100 + blocks)), \
            f"{tokens} tokens in blocks of 4 need ceil({tokens}/4) = {blocks} blocks, taken in order; got {table}"
        assert added == blocks, "return the number of blocks appended"


def check_grow_table_keeps_what_is_there(grow_table):
    table = [7, 3]
    assert grow_table(table, 8, 4, lambda: 99) == 0 and table == [7, 3], \
        "a table that already holds 8 slots for 8 tokens takes no block"
    assert grow_table(table, 9, 4, lambda: 99) == 1 and table == [7, 3, 99], "the 9th token needs a third block"
    assert grow_table(table, 5, 4, lambda: 99) == 0 and table == [7, 3, 99], "the table never shrinks here"


def check_grow_table_for_a_set_of_sequences(grow_table):
    pool = BlockPool(12, 4)
    tables = [[] for _ in range(4)]
    for table, length in zip(tables, (5, 9, 3, 16), strict=True):
        grow_table(table, length, 4, pool.allocate)
    assert [len(t) for t in tables] == [2, 3, 1, 4], "sequences of 5, 9, 3, 16 tokens hold 2, 3, 1, 4 blocks of 4"
    assert pool.num_free == 2 and len({b for t in tables for b in t}) == 10, "10 distinct blocks taken from the pool"
    pool.check()


@pytest.mark.exercise("5.1")
def test_grow_table_counts(ex):
    check_grow_table_counts(ex.grow_table)


@pytest.mark.exercise("5.1")
def test_grow_table_keeps_what_is_there(ex):
    check_grow_table_keeps_what_is_there(ex.grow_table)


@pytest.mark.exercise("5.1")
def test_grow_table_for_a_set_of_sequences(ex):
    check_grow_table_for_a_set_of_sequences(ex.grow_table)


# ---------------------------------------------------------------- 5.2 can_admit


def check_can_admit_slots_and_blocks(can_admit):
    ok = dict(num_running=3, max_num_seqs=4, blocks_wanted=5, blocks_free=5, new_tokens=10, token_budget=10,
              step_is_empty=False)
    assert can_admit(**ok) is True, "a free slot, exactly enough blocks and exactly the budget: admit"
    assert can_admit(**ok | {"num_running": 4}) is False, "4 running of 4 slots: no slot is free"
    assert can_admit(**ok | {"blocks_wanted": 6}) is False, "6 blocks wanted, 5 free: wait"
    assert can_admit(**ok | {"blocks_wanted": 0, "blocks_free": 0}) is True, \
        "a sequence whose blocks are all shared wants none"


def check_can_admit_token_budget(can_admit):
    ok = dict(num_running=0, max_num_seqs=4, blocks_wanted=2, blocks_free=8, new_tokens=100, token_budget=30,
              step_is_empty=False)
    assert can_admit(**ok) is False, "100 new tokens do not fit a remaining budget of 30"
    assert can_admit(**ok | {"step_is_empty": True}) is True, \
        "a prompt longer than the whole budget may run alone in an empty step (else it waits for ever)"
    assert can_admit(**ok | {"step_is_empty": True, "blocks_wanted": 9}) is False, \
        "the empty-step exception is about the token budget, not about memory: 9 blocks wanted, 8 free"
    assert can_admit(**ok | {"step_is_empty": True, "num_running": 4}) is False, "nor about batch slots"


@pytest.mark.exercise("5.2")
def test_can_admit_slots_and_blocks(ex):
    check_can_admit_slots_and_blocks(ex.can_admit)


@pytest.mark.exercise("5.2")
def test_can_admit_token_budget(ex):
    check_can_admit_token_budget(ex.can_admit)


# ---------------------------------------------------------------- 5.3 match_prefix


def chained_table(tokens, block_size, blocks):
    """{chained hash: (block id, tokens)} for the full blocks of `tokens`, stored in `blocks`."""
    table, parent = {}, None
    for i, block in enumerate(blocks):
        chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent, chunk)
        table[parent] = (block, chunk)
    return table


def check_match_prefix_chain(match_prefix):
    tokens = list(range(1, 14))                                   # 13 tokens: blocks of 4, 4, 4 and 1
    table = chained_table(tokens, 4, [9, 2, 5])
    assert match_prefix(tokens, 4, table) == [9, 2, 5], "all three full blocks are cached: [9, 2, 5], in order"
    assert match_prefix(tokens + [99, 98], 4, table) == [9, 2, 5], "tokens after the cached blocks change nothing"
    assert match_prefix([0] + tokens[1:], 4, table) == [], "a different first token: the chain breaks at block 0"
    other = tokens[:4] + [0] + tokens[5:]
    assert match_prefix(other, 4, table) == [9], "a difference in block 1 keeps block 0 and stops there"
    assert match_prefix(tokens, 4, {}) == [], "an empty cache matches nothing"


def check_match_prefix_last_token(match_prefix):
    tokens = list(range(1, 13))                                   # exactly 3 full blocks
    table = chained_table(tokens, 4, [9, 2, 5])
    assert match_prefix(tokens, 4, table) == [9, 2], \
        "12 tokens: only (12 - 1) // 4 = 2 blocks may match, the last token must be computed for its logits"
    assert match_prefix(tokens[:4], 4, table) == [], "a prompt of one full block matches nothing"


def check_match_prefix_gaps_and_collisions(match_prefix):
    tokens = list(range(1, 14))
    table = chained_table(tokens, 4, [9, 2, 5])
    del table[next(h for h, (b, _) in table.items() if b == 2)]
    assert match_prefix(tokens, 4, table) == [9], "block 1 is missing: stop there, even though block 2 is cached"
    table = chained_table(tokens, 4, [9, 2, 5])
    h = next(h for h, (b, _) in table.items() if b == 9)
    table[h] = (9, (0, 0, 0, 0))                                  # the same hash, other tokens: a collision
    assert match_prefix(tokens, 4, table) == [], "compare the stored tokens: a hash collision is a miss"


@pytest.mark.exercise("5.3")
def test_match_prefix_chain(ex):
    check_match_prefix_chain(ex.match_prefix)


@pytest.mark.exercise("5.3")
def test_match_prefix_last_token(ex):
    check_match_prefix_last_token(ex.match_prefix)


@pytest.mark.exercise("5.3")
def test_match_prefix_gaps_and_collisions(ex):
    check_match_prefix_gaps_and_collisions(ex.match_prefix)


# ---------------------------------------------------------------- 5.4 accept_draft


def bigram_pvalue(accept, n=8000, V=4, k=3, seed=0) -> float:
    """p-value of a chi-square test: the first 3 tokens of n speculative runs against the target's joint.

    Target p and draft q are bigram models over V tokens (fixed random matrices); every run
    starts from token 0; a round drafts k tokens from q, builds the target's k + 1
    distributions and calls `accept`. For a correct rule the p-value is uniform on (0, 1), so
    a check that fails below 1e-3 fails a correct rule with probability 0.1 % per seed (the
    seed is fixed, so the outcome is the same on every run of one machine).
    """
    mats = torch.Generator().manual_seed(1234)
    P = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    g = torch.Generator().manual_seed(seed)
    out, filled = torch.full((n, 3), -1), torch.zeros(n, dtype=torch.long)
    last, rows = torch.zeros(n, dtype=torch.long), torch.arange(n)
    while int(filled.min()) < 3:
        drafts, qs, prev = [], [], last
        for _ in range(k):
            qs.append(Q[prev])
            drafts.append(torch.multinomial(qs[-1], 1, generator=g).squeeze(1))
            prev = drafts[-1]
        draft = torch.stack(drafts, 1)
        accepted, nxt = accept(P[torch.cat([last[:, None], draft], 1)], torch.stack(qs, 1), draft, g)
        assert accepted.shape == nxt.shape == (n,), "accepted and next_token are [S] tensors"
        for j in range(k + 1):
            token = torch.where(j < accepted, draft[:, min(j, k - 1)], nxt)
            ok = (j <= accepted) & (filled < 3)
            out[rows[ok], filled[ok]] = token[ok]
            filled = filled + ok.long()
        last = nxt
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    t1, t2, t3 = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    expected = (P[0][t1] * P[t1, t2] * P[t2, t3]).flatten().double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V ** 3 - 1) / 2, dtype=torch.double), chi2 / 2))


def bonus_pvalue(accept, n=8000, V=5, k=3, seed=0) -> float:
    """p-value of a chi-square test: the token after k accepted drafts against the target's p_{k+1}.

    bigram_pvalue's first 3 tokens never reach the bonus position (with k = 3 it is the 4th
    token of a round at the earliest), so this test reaches it directly: the draft's
    probabilities equal the target's at the k draft positions (every draft is kept), the
    target's k + 1 distributions differ from each other (fixed random), and the n rounds'
    next tokens must follow p_{k+1}, not p_k nor max(0, p_{k+1} - q_k). Uniform p-value for a
    correct rule, as above.
    """
    p = torch.softmax(torch.randn(k + 1, V, generator=torch.Generator().manual_seed(4321)) * 1.5, -1)
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(p[:k], n, replacement=True, generator=g).T                # [n, k] drawn from q = p
    accepted, nxt = accept(p.expand(n, k + 1, V), p[:k].expand(n, k, V), draft, g)
    assert (accepted == k).all(), "when the draft's probabilities equal the target's, every draft token is kept"
    counts, expected = torch.bincount(nxt, minlength=V).double(), p[k].double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.double), chi2 / 2))


def check_accept_draft_distribution(accept_draft):
    pvalue = bigram_pvalue(accept_draft)
    assert pvalue > 1e-3, f"the emitted tokens do not follow the target's distribution (chi-square p = {pvalue:.1e})"


def check_accept_draft_bonus_token(accept_draft):
    pvalue = bonus_pvalue(accept_draft)
    assert pvalue > 1e-3, ("after k accepted drafts the next token must be drawn from the target's p_{k+1} "
                           f"(p[:, k]), nothing subtracted (chi-square p = {pvalue:.1e})")


def check_accept_draft_edge_cases(accept_draft):
    V, k, S = 5, 3, 64
    p = torch.softmax(torch.randn(S, k + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.multinomial(p[:, :k].reshape(-1, V), 1).view(S, k)
    accepted, _ = accept_draft(p, p[:, :k].clone(), draft, torch.Generator().manual_seed(1))
    assert (accepted == k).all(), "when the draft's probabilities equal the target's, every draft token is kept"
    q = torch.zeros(S, k, V)
    q[..., 0] = 1.0                                               # the draft always proposes token 0 ...
    p = torch.full((S, k + 1, V), 1.0 / (V - 1))
    p[:, 0, 0] = 0.0                                              # ... which the target never emits first
    p[:, 0] /= p[:, 0].sum(-1, keepdim=True)
    accepted, nxt = accept_draft(p, q, torch.zeros(S, k, dtype=torch.long), torch.Generator().manual_seed(2))
    assert (accepted == 0).all(), "a token the target gives probability 0 is never kept, and nothing after it"
    assert (nxt != 0).all(), "the replacement comes from max(0, p - q): never the rejected token here"
    p = torch.full((S, k + 1, V), 1.0 / V)
    q = torch.full((S, k, V), 1.0 / V)
    q[:, 0] = 0.0
    q[:, 0, 0] = 1.0
    p[:, 0, 0] = 0.0
    p[:, 0] /= p[:, 0].sum(-1, keepdim=True)
    accepted, _ = accept_draft(p, q, torch.zeros(S, k, dtype=torch.long), torch.Generator().manual_seed(3))
    assert (accepted == 0).all(), "drafts after a rejected one are discarded even if they would pass: a leading run"


@pytest.mark.exercise("5.4")
def test_accept_draft_distribution(ex):
    check_accept_draft_distribution(ex.accept_draft)


@pytest.mark.exercise("5.4")
def test_accept_draft_bonus_token(ex):
    check_accept_draft_bonus_token(ex.accept_draft)


@pytest.mark.exercise("5.4")
def test_accept_draft_edge_cases(ex):
    check_accept_draft_edge_cases(ex.accept_draft)
