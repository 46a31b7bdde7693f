"""Graded checks of notebook 09's exercises (python -m minirl.grade --only 09), and the checks' own tests.

Each check is a plain function of the implementation under test (`ex`), so that the bottom of
this file can run it against plausible wrong versions and insist that it fails them.
"""

import math
import types

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
    # a 7 B dense model, 64 prompts x 8 completions of 512 + 1536 tokens, one update in 10 s on 8 GPUs at 989 TFLOP/s
    N, L, A, P, C, G, B = 6.5e9, 32, 4096, 512, 1536, 8, 64
    one = lambda T: 2 * N * T + 2 * L * A * T * (T + 1)                       # noqa: E731 -- the formula, by hand
    needed = 3 * B * (one(P) + G * (one(P + C) - one(P)))
    expected = needed / (8 * 989e12 * 10)
    got = ex.mfu(ex.training_flops(N, L, A, P, C, G, B), 10, 8 * 989e12)
    assert got == pytest.approx(expected, rel=1e-9), f"MFU of the step: expected {expected:.4f}, got {got:.4f}"
    assert 0.40 < got < 0.45


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


# ---------------------------------------------------------------- the checks fail plausible wrong versions


def _forward_half_params(params, layers, attn_dim, seq_len, sequences):
    return sequences * (params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1))


def _forward_no_attention(params, layers, attn_dim, seq_len, sequences):
    return sequences * 2 * params * seq_len


def _forward_full_square(params, layers, attn_dim, seq_len, sequences):   # PaLM's count: every token sees every key
    return sequences * (2 * params * seq_len + 4 * layers * attn_dim * seq_len ** 2)


def _forward_attention_once(params, layers, attn_dim, seq_len, sequences):
    return sequences * 2 * params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1)


def _forward_qk_only(params, layers, attn_dim, seq_len, sequences):
    return sequences * (2 * params * seq_len + layers * attn_dim * seq_len * (seq_len + 1))


def _mean_of_step_shares(records):
    steps = [r for r in records if "time/step" in r]
    if not steps:
        return {}
    per_step = []
    for r in steps:
        shares = {k[5:]: v / r["time/step"] for k, v in r.items() if k.startswith("time/") and k not in
                  ("time/step", "time/eval")}
        per_step.append(shares | {"other": max(0.0, 1 - sum(shares.values()))})
    keys = {k for s in per_step for k in s}
    return {k: sum(s.get(k, 0.0) for s in per_step) / len(per_step) for k in keys}


def _shares_of_the_stages_sum(records):
    steps = [r for r in records if "time/step" in r]
    seconds = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("time/") and k not in ("time/step", "time/eval"):
                seconds[k[5:]] = seconds.get(k[5:], 0.0) + v
    total = sum(seconds.values())
    return {k: v / total for k, v in seconds.items()} | {"other": 0.0} if total else {}


def _eval_counted(records):
    steps = [r for r in records if "time/step" in r]
    total = sum(r["time/step"] for r in steps)
    if not total:
        return {}
    seconds = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("time/") and k != "time/step":
                seconds[k[5:]] = seconds.get(k[5:], 0.0) + v
    shares = {k: v / total for k, v in seconds.items()}
    return shares | {"other": max(0.0, 1 - sum(shares.values()))}


def _negative_other(records):
    from minirl.profiling.decompose import stage_shares
    shares = stage_shares(records)
    if shares:
        shares["other"] = 1 - sum(v for k, v in shares.items() if k != "other")
    return shares


def _reference_rules():
    from minirl.profiling.rules import RULES, Rule
    return RULES, Rule


def _fires_above_always(measured, rules=None):
    rules = rules or _reference_rules()[0]
    return [r.name for r in rules if measured.get(r.name) is not None and not math.isnan(measured[r.name])
            and measured[r.name] > r.threshold]


def _inclusive(measured, rules=None):
    rules = rules or _reference_rules()[0]
    out = []
    for r in rules:
        v = measured.get(r.name)
        if v is not None and not math.isnan(v) and ((v >= r.threshold) if r.above else (v <= r.threshold)):
            out.append(r.name)
    return out


def _none_is_zero(measured, rules=None):
    rules = rules or _reference_rules()[0]
    out = []
    for r in rules:
        v = measured.get(r.name)
        v = 0.0 if v is None or math.isnan(v) else v
        if (v > r.threshold) if r.above else (v < r.threshold):
            out.append(r.name)
    return out


def _in_measured_order(measured, rules=None):
    from minirl.profiling.rules import rules_that_fire
    fired = set(rules_that_fire(measured, rules or _reference_rules()[0]))
    return [name for name in measured if name in fired]


def _ignores_given_rules(measured, rules=None):
    from minirl.profiling.rules import rules_that_fire
    return rules_that_fire(measured)


def _namespace(**functions):
    """A fake `ex` holding the reference code, with some functions replaced by wrong versions."""
    from minirl.profiling import decompose, mfu, rules
    ns = {**vars(mfu), **vars(decompose), **vars(rules)}
    ns.update(functions)
    if "forward_flops" in functions:                    # the package's builders call the (wrong) forward pass
        wrong = functions["forward_flops"]

        def group(params, layers, attn_dim, prompt_len, completion_len, group_size, groups):
            def one(length):
                return wrong(params, layers, attn_dim, length, 1)
            return groups * (one(prompt_len) + group_size * (one(prompt_len + completion_len) - one(prompt_len)))
        ns["training_flops"] = lambda *a: 3 * group(*a)
    return types.SimpleNamespace(**ns)


WRONG = {
    "N FLOPs per weight": ("forward_flops", _forward_half_params, [check_forward_by_hand, check_mfu_of_a_given_step,
                                                                   check_matches_torchs_counter]),
    "no attention": ("forward_flops", _forward_no_attention, [check_forward_by_hand, check_mfu_of_a_given_step]),
    "full T x T square": ("forward_flops", _forward_full_square, [check_forward_by_hand, check_mfu_of_a_given_step]),
    "attention of one sequence": ("forward_flops", _forward_attention_once, [check_forward_by_hand]),
    "QK^T without AV": ("forward_flops", _forward_qk_only, [check_forward_by_hand, check_mfu_of_a_given_step]),
    "mean of per-step shares": ("stage_shares", _mean_of_step_shares, [check_shares_by_hand]),
    "shares of the stages' sum": ("stage_shares", _shares_of_the_stages_sum, [check_shares_by_hand]),
    "evaluation as a stage": ("stage_shares", _eval_counted, [check_shares_by_hand]),
    "negative other": ("stage_shares", _negative_other, [check_shares_edge_cases]),
    "every rule fires above": ("rules_that_fire", _fires_above_always, [check_the_given_decomposition]),
    "thresholds inclusive": ("rules_that_fire", _inclusive, [check_boundaries_and_unmeasured]),
    "not measured as 0": ("rules_that_fire", _none_is_zero, [check_boundaries_and_unmeasured]),
    "order of the measurements": ("rules_that_fire", _in_measured_order, [check_the_given_decomposition]),
    "the package's rules, always": ("rules_that_fire", _ignores_given_rules, [check_custom_rules]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_checks_fail_a_wrong_version(name):
    function, wrong, checks = WRONG[name]
    fake = _namespace(**{function: wrong})
    for check in checks:
        with pytest.raises(Exception):
            check(fake)


def test_checks_pass_the_reference():
    ref = _namespace()
    for _, _, checks in WRONG.values():
        for check in checks:
            check(ref)
