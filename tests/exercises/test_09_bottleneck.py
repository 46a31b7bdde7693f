"""Graded checks of notebook 09's exercises (python -m minirl.grade --only 09).

Each check is a plain function of the implementation under test (`ex`); the wrong versions it
must fail are in tests/exercises/wrong/ex9_*.py.
"""

import math

import pytest
import torch

# ---------------------------------------------------------------- 9.2 forward_flops (the MFU of a given step)


def check_forward_by_hand(ex):
    assert ex.forward_flops(10, 0, 0, 3, 2) == pytest.approx(120), "2 FLOPs per weight per token: 2 x 10 x 3 x 2"
    assert ex.forward_flops(0, 1, 1, 3, 1) == pytest.approx(24), \
        "causal attention over 3 tokens: 1 + 2 + 3 = 6 (query, key) pairs, 4 FLOPs each (QK^T and AV, 2 A each)"
    assert ex.forward_flops(0, 2, 8, 4, 3) == pytest.approx(3 * 2 * 2 * 8 * 4 * 5), "per layer, per sequence"
    assert ex.forward_flops(1, 0, 0, 2.5, 2) == pytest.approx(10), "seq_len may be a mean length (a float)"


def check_mfu_of_a_given_step(ex):
    # a 7 B dense model (N = 6.5e9 multiplying weights, 32 layers, attention width 4096) trains on 512 sequences
    # of 2048 tokens; the update takes 13 s on 8 GPUs of 989 TFLOP/s
    N, L, A, T, S = 6.5e9, 32, 4096, 2048, 512
    needed = 3 * S * (2 * N * T + 2 * L * A * T * (T + 1))                # forward + backward, by hand
    expected = needed / (8 * 989e12 * 13)
    got = ex.mfu(3 * ex.forward_flops(N, L, A, T, S), 13, 8 * 989e12)
    assert got == pytest.approx(expected, rel=1e-9), f"MFU of the step: expected {expected:.4f}, got {got:.4f}"
    assert 0.40 < got < 0.45
    # the same model on GRPO groups: 64 prompts of 512 tokens, 8 completions of 1536 tokens each, 10 s
    P, C, G, B = 512, 1536, 8, 64

    def one(length):
        return 2 * N * length + 2 * L * A * length * (length + 1)
    grouped = 3 * B * (one(P) + G * (one(P + C) - one(P)))
    got = ex.mfu(ex.training_flops(N, L, A, P, C, G, B), 10, 8 * 989e12)
    assert got == pytest.approx(grouped / (8 * 989e12 * 10), rel=1e-9), \
        "a group's prompt counts once: F(P) + G (F(P + C) - F(P)) per group, times 3 for the update"


def check_matches_torchs_counter(ex):
    from minirl.models.policy import PolicyConfig, build_policy, build_tokenizer

    model = build_policy(PolicyConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=4),
                         build_tokenizer())
    params = sum(p.numel() for p in model.parameters())             # tied embeddings: every weight multiplies
    ids = torch.randint(3, 18, (6, 9), generator=torch.Generator().manual_seed(1))
    with torch.profiler.profile(with_flops=True) as prof:
        model(ids, labels=ids).loss.backward()
    counted = sum(e.flops for e in prof.key_averages())              # matrix products only (no attention)
    ours = 3 * ex.forward_flops(params, 0, 0, 9, 6)
    assert ours == pytest.approx(counted, rel=0.01), \
        f"forward + backward = 3 forwards = 6 N per token: torch counts {counted:.4g}, yours x 3 gives {ours:.4g}"


# ---------------------------------------------------------------- 9.1 stage_shares


RECORDS = [{"step": 0, "version": 0, "accuracy": 0.5, "time/eval": 9.0},
           {"step": 1, "reward": 0.1, "time/generate": 1.0, "time/update": 1.0, "time/step": 4.0},
           {"step": 2, "reward": 0.2, "time/generate": 6.0, "time/step": 6.0, "time/eval": 5.0}]


def check_shares_by_hand(ex):
    shares = ex.stage_shares(RECORDS)
    assert set(shares) == {"generate", "update", "other"}, \
        f"stages are the time/ keys except time/step and time/eval, plus 'other'; got {sorted(shares)}"
    assert shares["generate"] == pytest.approx(0.7), "7 s of generation over a 10 s run (a ratio of totals)"
    assert shares["update"] == pytest.approx(0.1)
    assert shares["other"] == pytest.approx(0.2), "what no stage timed: 2 s of step 1"


def check_shares_edge_cases(ex):
    assert ex.stage_shares([{"step": 0, "time/eval": 1.0}]) == {}, "no step record: {}"
    over = ex.stage_shares([{"step": 1, "time/a": 3.0, "time/b": 2.0, "time/step": 4.0}])
    assert over["other"] == 0.0, "stages adding up to more than the step leave no 'other' (not a negative one)"
    assert math.isclose(over["a"], 0.75)


# ---------------------------------------------------------------- 9.3 rules_that_fire


GIVEN = {"slow_rollout": 0.85, "slow_sync": 0.02, "heavy_communication": None, "activation_oom": 0.0,
         "expert_imbalance": 1.2, "stragglers": 1.1, "low_mfu": 0.12}


def check_the_given_decomposition(ex):
    fired = ex.rules_that_fire(GIVEN)
    assert fired == ["slow_rollout", "low_mfu"], \
        f"generation at 85 % (> 80 %) and MFU at 12 % (< 30 %) fire, nothing else: got {fired}"
    assert ex.rules_that_fire(dict(reversed(list(GIVEN.items())))) == fired, "in the order of the rules"
    healthy = GIVEN | {"slow_rollout": 0.5, "low_mfu": 0.45}
    assert ex.rules_that_fire(healthy) == [], "MFU 45 % is healthy: low_mfu fires *below* its threshold"


def check_boundaries_and_unmeasured(ex):
    assert ex.rules_that_fire({"slow_sync": 0.05, "low_mfu": 0.30}) == [], "strictly above / strictly below"
    assert ex.rules_that_fire({"slow_sync": 0.0501}) == ["slow_sync"]
    assert ex.rules_that_fire({"low_mfu": None, "slow_rollout": float("nan")}) == [], "not measured never fires"
    assert ex.rules_that_fire({}) == []


def check_custom_rules(ex):
    rule = ex.Rule("tiny_batch", "tiny batch", "rows per step", 8.0, False, "-", "raise the batch size")
    assert ex.rules_that_fire({"tiny_batch": 4.0, "slow_rollout": 0.99}, rules=(rule,)) == ["tiny_batch"], \
        "apply the rules you are given"


# ---------------------------------------------------------------- graded tests


@pytest.mark.exercise("9.2")
def test_forward_flops_by_hand(ex):
    check_forward_by_hand(ex)


@pytest.mark.exercise("9.2")
def test_mfu_of_a_given_step(ex):
    check_mfu_of_a_given_step(ex)


@pytest.mark.exercise("9.2")
def test_forward_flops_match_torchs_counter(ex):
    check_matches_torchs_counter(ex)


@pytest.mark.exercise("9.1")
def test_stage_shares_by_hand(ex):
    check_shares_by_hand(ex)


@pytest.mark.exercise("9.1")
def test_stage_shares_edge_cases(ex):
    check_shares_edge_cases(ex)


@pytest.mark.exercise("9.3")
def test_the_rule_that_fires_for_a_decomposition(ex):
    check_the_given_decomposition(ex)


@pytest.mark.exercise("9.3")
def test_rule_boundaries_and_unmeasured_values(ex):
    check_boundaries_and_unmeasured(ex)


@pytest.mark.exercise("9.3")
def test_rules_given_are_the_rules_applied(ex):
    check_custom_rules(ex)
