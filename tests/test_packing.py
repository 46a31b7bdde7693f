"""Sequence packing (minirl.parallel.packing): valid plans, utilization, and packed training that computes
the padded batch's loss and gradients."""

import random

import pytest
import torch

from minirl.memory.measure import build_measure_model
from minirl.parallel.packing import (
    best_fit_decreasing,
    block_diagonal_mask,
    next_fit,
    pack_sequences,
    packed_loss,
    utilization,
)
from minirl.runtime.moe_checks import PackingError
from minirl.runtime.packing_bench import (
    PACKERS,
    first_fit_decreasing,
    long_tail_lengths,
    micro_batch_spread,
    pad_sequences,
    padded_loss,
    padded_utilization,
    time_packed_vs_padded,
)


def test_every_plan_is_valid_on_random_lengths():
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.randint(8, 64)
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 40))]
        bins = {name: pack(lengths, budget) for name, pack in PACKERS.items()}
        for name, plan in bins.items():
            assert sorted(i for b in plan for i in b) == list(range(len(lengths))), f"{name}: every sequence once"
            assert all(sum(lengths[i] for i in b) <= budget for b in plan), f"{name}: no bin overflows"
            assert len(plan) >= -(-sum(lengths) // budget)
        assert len(bins["best_fit_decreasing"]) <= len(bins["next_fit"])
        assert len(bins["first_fit_decreasing"]) <= len(bins["next_fit"])


def test_best_fit_picks_the_fullest_bin_first_fit_the_first():
    lengths = [1, 8, 6, 3, 3]                        # sorted: 8, 6, 3, 3, 1; the 1 has room in bins 0 (2) and 1 (1)
    assert first_fit_decreasing(lengths, 10) == [[1, 0], [2, 3], [4]]
    assert best_fit_decreasing(lengths, 10) == [[1], [2, 3, 0], [4]]
    assert next_fit(lengths, 10) == [[0, 1], [2, 3], [4]]


def test_utilization_and_padding():
    lengths = [4, 2, 3, 1]
    assert utilization(lengths, [[0, 2], [1, 3]], 8) == pytest.approx(10 / 16)
    assert padded_utilization(lengths, 2) == pytest.approx(10 / (2 * 4 + 2 * 3))
    assert padded_utilization(lengths, 1) == 1.0
    assert micro_batch_spread(lengths, [[0, 2], [1, 3]]) == pytest.approx(7 / 5)
    tail = long_tail_lengths(2000, seed=3)
    assert tail == long_tail_lengths(2000, seed=3) and min(tail) >= 101 and max(tail) <= 4096 + 400
    assert padded_utilization(tail, 8) < 0.6 < 0.95 < utilization(tail, best_fit_decreasing(tail, 4608), 4608)


def test_bad_lengths_are_named():
    with pytest.raises(PackingError, match=r"lengths\[1\]=700 is longer than the pack budget=512"):
        best_fit_decreasing([100, 700], 512)
    with pytest.raises(PackingError, match=r"lengths\[0\]=0"):
        next_fit([0, 3], 8)
    with pytest.raises(PackingError, match="budget=0"):
        first_fit_decreasing([1], 0)
    with pytest.raises(PackingError, match="longer than the pack budget"):
        pack_sequences([[1] * 9], [[0]], 8, 0)
    with pytest.raises(PackingError, match="bin 0 holds 10 tokens"):
        pack_sequences([[1] * 5, [2] * 5], [[0, 1]], 8, 0)


def test_pack_layout_positions_labels_and_mask():
    pack = pack_sequences([[5, 6, 7], [8, 9]], [[0, 1]], 7, pad_token_id=0)
    assert pack["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0]]
    assert pack["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]], "positions restart per sequence and for the tail"
    assert pack["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100]]
    assert pack["seq_ids"].tolist() == [[0, 0, 0, 1, 1, -1, -1]]
    allowed = block_diagonal_mask(pack["seq_ids"])[0, 0] == 0
    assert allowed[4].tolist() == [False, False, False, True, True, False, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False, False]
    assert allowed.diagonal().all(), "no all-masked row (it would give NaN)"


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(2, 40, (14,), generator=g)]
    sequences = [torch.randint(3, 18, (n,), generator=g).tolist() for n in lengths]
    return sequences, best_fit_decreasing(lengths, 96)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_training_equals_padded(batch, attn):
    sequences, bins = batch
    model = build_measure_model("tiny", attn_implementation=attn)
    pack, padded = pack_sequences(sequences, bins, 96, 0), pad_sequences(sequences, 0)

    def loss_and_grad(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_loss, ref_grad = loss_and_grad(lambda: padded_loss(model, padded))
    for how in ("mask", "position_ids"):
        loss, grad = loss_and_grad(lambda how=how: packed_loss(model, pack, how))
        assert loss == pytest.approx(ref_loss, abs=1e-5), how
        assert torch.allclose(grad, ref_grad, atol=1e-6), how
    leaky, _ = loss_and_grad(lambda: model(input_ids=pack["input_ids"], labels=pack["labels"]).loss)
    assert abs(leaky - ref_loss) > 1e-4, "without position resets the sequences see each other (test is live)"
    with pytest.raises(ValueError, match="how='flash'"):
        packed_loss(model, pack, "flash")


def test_time_packed_vs_padded_reports_both_sides(batch):
    sequences, _ = batch
    speed = time_packed_vs_padded(build_measure_model("tiny"), sequences, 96, 4, 0, repeats=1)
    assert speed["rows_packed"] < speed["rows_padded"] == 14
    assert speed["packed_utilization"] > speed["padded_utilization"]
    assert speed["padded_seconds"] > 0 and speed["packed_seconds"] > 0 and speed["speedup"] > 0
