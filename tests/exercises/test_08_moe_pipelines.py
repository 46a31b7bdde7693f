"""Graded checks of notebook 08's exercises (python -m minirl.grade --only 08).

Each check is a plain function of the implementation under test (`ex`); the wrong versions it
must fail are in tests/exercises/wrong/ex8_*.py.
"""


import pytest
import torch

from minirl.runtime.moe_checks import PackingError
from minirl.runtime.pipeline_sim import simulate
from minirl.runtime.pipeline_types import FORWARD, Costs

# ---------------------------------------------------------------- 8.1 load_balancing_loss


def check_balancing_range(ex):
    even = ex.load_balancing_loss(torch.zeros(40, 8), top_k=2)
    assert abs(float(even) - 1.0) < 1e-5, f"an even router (all logits equal) scores 1, got {float(even):.4f}"
    collapsed = ex.load_balancing_loss(torch.tensor([[25.0, 25.0] + [0.0] * 6]).repeat(16, 1), top_k=2)
    assert abs(float(collapsed) - 4.0) < 1e-3, \
        f"every token to the same 2 of 8 experts scores E / top_k = 4, got {float(collapsed):.4f}"
    assert torch.as_tensor(even).dim() == 0, "return a 0-dim tensor"


def check_balancing_matches_transformers(ex):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    logits = torch.randn(2 * 12, 6, generator=torch.Generator().manual_seed(3)) * 2.5
    mask = (torch.arange(12) < torch.tensor([[12], [5]])).long()
    ours = ex.load_balancing_loss(logits, top_k=2, token_mask=mask.reshape(-1))
    theirs = load_balancing_loss_func((logits,), num_experts=6, top_k=2, attention_mask=mask)
    assert torch.allclose(2 * torch.as_tensor(ours).float(), theirs, atol=1e-5), \
        f"top_k x yours ({2 * float(ours):.5f}) must equal transformers' load_balancing_loss_func ({float(theirs):.5f})"
    kept = ex.load_balancing_loss(logits[mask.reshape(-1).bool()], top_k=2)
    assert abs(float(ours) - float(kept)) < 1e-5, "masked-out tokens count in neither f nor P"


def check_balancing_counts_every_slot(ex):
    # each token's 2 experts: (0, 1) with probabilities tilted to 0; top-1 counting would see only expert 0
    logits = torch.log(torch.tensor([[0.5, 0.4, 0.05, 0.05]])).repeat(10, 1)
    value = float(ex.load_balancing_loss(logits, top_k=2))
    expected = 4 * (0.5 * 0.5 + 0.5 * 0.4)                     # f = (1/2, 1/2, 0, 0) over the 2 slots
    assert abs(value - expected) < 1e-4, \
        f"f counts both chosen experts of every token: expected {expected}, got {value}"


def check_balancing_gradient(ex):
    logits = (torch.randn(30, 4, generator=torch.Generator().manual_seed(5)) * 2).requires_grad_()
    ex.load_balancing_loss(logits, top_k=1).backward()
    assert logits.grad is not None, "the loss must be differentiable in the router logits (through P)"
    probs = torch.softmax(logits.detach(), -1)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / 30
    ref = logits.detach().clone().requires_grad_()
    (4 * (f * torch.softmax(ref, -1).mean(0)).sum()).backward()
    assert torch.allclose(logits.grad, ref.grad, atol=1e-6), "only P carries a gradient; f is a count"


@pytest.mark.exercise("8.1")
def test_balancing_loss_range(ex):
    check_balancing_range(ex)


@pytest.mark.exercise("8.1")
def test_balancing_loss_matches_transformers_and_mask(ex):
    check_balancing_matches_transformers(ex)


@pytest.mark.exercise("8.1")
def test_balancing_loss_counts_every_slot(ex):
    check_balancing_counts_every_slot(ex)


@pytest.mark.exercise("8.1")
def test_balancing_loss_gradient(ex):
    check_balancing_gradient(ex)


# ---------------------------------------------------------------- 8.2 bubble_share


def check_bubble_by_hand(ex):
    assert abs(ex.bubble_share([(0, 0.0, 1.0), (1, 1.0, 2.0)], 2) - 0.5) < 1e-9, \
        "two ranks, each busy half of the 2-unit span: idle share 0.5"
    assert abs(ex.bubble_share([(0, 5.0, 6.0), (0, 6.0, 7.0), (1, 5.0, 7.0)], 2)) < 1e-9, \
        "the span runs from the first start (5), not from 0: nobody idles here"
    assert abs(ex.bubble_share([(0, 0.0, 3.0)], 3) - 2 / 3) < 1e-9, "a rank without events idles the whole span"


def check_bubble_on_a_schedule(ex):
    from minirl.parallel.pipeline import simulate_schedule

    for P, M in [(4, 8), (3, 2)]:
        t = simulate_schedule("gpipe", P, M, Costs(1.0, 2.0))
        share = ex.bubble_share([(e.rank, e.start, e.end) for e in t.events], P)
        assert abs(share - (P - 1) / (M + P - 1)) < 1e-9, \
            f"GPipe, P={P}, M={M}: the idle share is (P-1)/(M+P-1) = {(P - 1) / (M + P - 1):.4f}, got {share:.4f}"


def check_bubble_empty(ex):
    with pytest.raises(ValueError):
        ex.bubble_share([], 2)


@pytest.mark.exercise("8.2")
def test_bubble_share_by_hand(ex):
    check_bubble_by_hand(ex)


@pytest.mark.exercise("8.2")
def test_bubble_share_of_gpipe(ex):
    check_bubble_on_a_schedule(ex)


@pytest.mark.exercise("8.2")
def test_bubble_share_empty_timeline(ex):
    check_bubble_empty(ex)


# ---------------------------------------------------------------- 8.3 one_f_one_b_order


def check_1f1b_small(ex):
    names = lambda ops: [f"{op.kind}{op.microbatch}" for op in ops]   # noqa: E731
    assert names(ex.one_f_one_b_order(2, 3, 3)) == ["F0", "B0", "F1", "B1", "F2", "B2"], \
        "the last stage alternates from the start"
    assert names(ex.one_f_one_b_order(0, 3, 4)) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"], \
        "stage 0 of 3: 2 warm-up forwards, then F/B pairs, then the cool-down backwards"
    assert names(ex.one_f_one_b_order(0, 4, 2)) == ["F0", "F1", "B0", "B1"], "warm-up is capped at M"
    assert all(op.stage == 1 for op in ex.one_f_one_b_order(1, 3, 4)), "every Op carries the stage index"


def check_1f1b_bubble(ex):
    for P, M in [(4, 8), (5, 3)]:
        orders = {s: ex.one_f_one_b_order(s, P, M) for s in range(P)}
        t = simulate(orders, Costs(1.0, 2.0))
        assert abs(t.bubble_share - (P - 1) / (M + P - 1)) < 1e-9, \
            f"P={P}, M={M}: 1F1B's idle share is (P-1)/(M+P-1), got {t.bubble_share:.4f}"
        for s, order in orders.items():
            in_flight = peak = 0
            for op in order:
                in_flight += 1 if op.kind == FORWARD else -1
                peak = max(peak, in_flight)
            assert peak == min(P - s, M), f"stage {s} keeps at most {min(P - s, M)} micro-batches in flight"


@pytest.mark.exercise("8.3")
def test_one_f_one_b_small_cases(ex):
    check_1f1b_small(ex)


@pytest.mark.exercise("8.3")
def test_one_f_one_b_bubble_and_memory(ex):
    check_1f1b_bubble(ex)


# ---------------------------------------------------------------- 8.4 best_fit_decreasing


def check_best_fit_example(ex):
    plan = ex.best_fit_decreasing([1, 8, 6, 3, 3], 10)
    assert plan == [[1], [2, 3, 0], [4]], \
        f"8, 6, 3, 3, 1 into 10: the last 1 goes to the bin with the least room (1 left), got {plan}"
    assert ex.best_fit_decreasing([4, 4, 2], 6) == [[0, 2], [1]], \
        "equal lengths in index order; equal room: the earliest opened bin"


def check_best_fit_valid(ex):
    import random

    rng = random.Random(1)
    for _ in range(50):
        budget = rng.randint(5, 40)
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 25))]
        plan = ex.best_fit_decreasing(lengths, budget)
        assert sorted(i for b in plan for i in b) == list(range(len(lengths))), "every sequence exactly once"
        assert all(sum(lengths[i] for i in b) <= budget for b in plan), "no bin above the budget"
        assert len(plan) <= len([b for b in _next_fit(lengths, budget)]), "never worse than arrival order"
    with pytest.raises(PackingError):             # the package's own error (a ValueError), via check_lengths
        ex.best_fit_decreasing([3, 11], 10)


def _next_fit(lengths, budget):
    from minirl.parallel.packing import next_fit
    return next_fit(lengths, budget)


@pytest.mark.exercise("8.4")
def test_best_fit_example_and_ties(ex):
    check_best_fit_example(ex)


@pytest.mark.exercise("8.4")
def test_best_fit_plans_are_valid(ex):
    check_best_fit_valid(ex)


# The wrong versions these checks must fail live in tests/exercises/wrong/ex8_*.py
# (run by tests/exercises/test_wrong_versions.py).
