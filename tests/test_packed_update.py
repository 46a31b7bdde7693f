"""The update at the cost of real tokens: micro-batches of similar length equal the padded update.

notebook 01, section 10.3: `micro_batches` plans, `MicroBatchedLogprobs` scores each micro-batch
at its own width (every group's prompt once, through `PromptCache`), and `Actor.backward` weights
each micro-batch's loss by its share of the batch's normalization. Against the padded path
(max_tokens_per_microbatch=0, one micro-batch): the same log-probs per token, loss, metrics and
gradients for every loss_type, token and sequence ratios, a KL term, IS weights and per-token
(PPO) advantages; fewer tokens per forward pass; the same skip on a non-finite batch.
"""

import math

import pytest
import torch

from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience, Rollout
from minirl.loss_types import LOSS_TYPES
from minirl.roles.actor import Actor
from minirl.runtime.prefix_sharing import MicroBatchedLogprobs, micro_batches

G = 4
LENGTHS = [1, 3, 2, 14, 4, 2, 9, 5, 2, 2, 3, 1, 6, 14, 2, 4]     # completion tokens per row: a long tail
PROMPTS = ["27+35=", "4+5=", "99+1=", "7+8="]                     # different lengths: left padding


def long_tail_rollout(tok, lengths=LENGTHS, seed=0) -> Rollout:
    """G completions per prompt with the given lengths (EOS last, except rows at the cap C), right-padded."""
    g = torch.Generator().manual_seed(seed)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    N, C = len(lengths), max(lengths)
    digits = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    ids = digits[torch.randint(10, (N, C), generator=g)]
    mask = (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).long()
    for i, n in enumerate(lengths):
        if n < C:
            ids[i, n - 1] = tok.eos_token_id
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    return Rollout(prompt_ids=enc.input_ids.repeat_interleave(G, 0),
                   prompt_mask=enc.attention_mask.repeat_interleave(G, 0),
                   completion_ids=ids, completion_mask=mask, logprobs=-torch.rand(N, C, generator=g) * mask,
                   completions=[""] * N, prompts=[p for p in PROMPTS for _ in range(G)], version=0,
                   num_generations=G, pad_token_id=tok.pad_token_id)


def experience(ro: Rollout, per_token=False, off_policy=False, kl=False, is_weights=False, seed=1) -> Experience:
    g = torch.Generator().manual_seed(seed)
    N, C = ro.completion_ids.shape
    mask = ro.completion_mask
    advantages = torch.randn(N, C, generator=g) * mask if per_token else torch.randn(N, generator=g)
    noise = lambda scale: scale * torch.randn(N, C, generator=g) * mask   # noqa: E731
    return Experience(ro, torch.zeros(N), advantages=advantages,
                      old_logps=(ro.logprobs * 0 - 2.5 + noise(0.4)) if off_policy else None,
                      ref_logps=(-2.5 + noise(0.3)) * mask if kl else None,
                      is_weights=(1 + noise(0.2)).clamp(min=0) if is_weights else None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: steadier on a shared machine (nothing here is timed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def actor_for(make_tiny_policy, max_tokens, loss_type="dapo", **algorithm):
    model, _ = make_tiny_policy(seed=3, num_layers=2)
    with torch.no_grad():                       # sharpen the random init: gradients far from 0
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return Actor(model, AlgorithmConfig(loss_type=loss_type, **algorithm),
                 OptimizerConfig(max_tokens_per_microbatch=max_tokens),
                 SamplingConfig(num_generations=G, max_completion_length=16, temperature=0.8))


def gradients(actor, exp):
    actor.model.train()
    actor.model.zero_grad(set_to_none=True)
    metrics = actor.backward(exp)
    actor.model.eval()
    return metrics, {n: p.grad.clone() for n, p in actor.model.named_parameters()}


# ---- the plan --------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 8, 20, 64])
def test_micro_batches_cover_every_row_within_the_budget(budget):
    plan = micro_batches(LENGTHS, budget)
    assert sorted(i for rows in plan for i in rows) == list(range(len(LENGTHS))), "every row exactly once"
    widths = [max(LENGTHS[i] for i in rows) for rows in plan]
    for rows, width in zip(plan, widths, strict=True):
        assert len(rows) * width <= budget or len(rows) == 1, (rows, width, budget)
        assert rows == sorted(rows)
    assert widths == sorted(widths, reverse=True), "longest first: each micro-batch padded to its own longest"
    assert plan == micro_batches(LENGTHS, budget), "deterministic"
    assert sum(len(r) * w for r, w in zip(plan, widths, strict=True)) <= len(LENGTHS) * max(LENGTHS)


def test_micro_batches_zero_is_the_padded_path_and_negative_is_refused():
    assert micro_batches(LENGTHS, 0) == [list(range(len(LENGTHS)))]
    assert micro_batches(LENGTHS, 10_000) == [list(range(len(LENGTHS)))], "a batch within the budget: one"
    with pytest.raises(ValueError, match="max_tokens=-1 must be >= 0"):
        micro_batches(LENGTHS, -1)
    from minirl.runtime.validate import ConfigError
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch"):
        OptimizerConfig(max_tokens_per_microbatch=-4)


def test_micro_batch_weights_add_up_to_the_batch():
    for loss_type in LOSS_TYPES:
        plan = micro_batches(LENGTHS, 8)
        weigh = LOSS_TYPES[loss_type].micro_batch_weight
        total = sum(weigh(len(rows), len(LENGTHS), sum(LENGTHS[i] for i in rows), sum(LENGTHS)) for rows in plan)
        assert total == pytest.approx(1.0), loss_type


# ---- the numbers equal the padded path's ------------------------------------------------------------

@pytest.mark.parametrize("share", [True, False])
def test_packed_logprobs_equal_the_padded_ones(tiny, share):
    model, tok = tiny
    ro = long_tail_rollout(tok)
    mask = ro.completion_mask.bool()
    out = {}
    for budget in (0, 8):
        scorer = MicroBatchedLogprobs(model, ro, micro_batches(LENGTHS, budget), 0.8, share_prompt=share,
                                      requires_grad=False)
        logps = torch.zeros(mask.shape)
        with torch.no_grad():
            for k, (rows, width) in enumerate(zip(scorer.rows, scorer.widths, strict=True)):
                logps[rows, :width] = scorer(k)[0]
        out[budget] = (logps, scorer.tokens(), len(scorer))
    (padded, padded_tokens, one), (packed, packed_tokens, several) = out[0], out[8]
    assert one == 1 and several > 2
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    assert packed_tokens < 0.6 * padded_tokens == 0.6 * len(LENGTHS) * max(LENGTHS)


SCENARIOS = {
    "on_policy": {},
    "off_policy_kl_is": {"off_policy": True, "kl": True, "is_weights": True},
    "per_token_advantages": {"per_token": True, "off_policy": True},
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_packed_gradients_equal_the_padded_ones(make_tiny_policy, tiny, loss_type, scenario):
    """Every loss normalization: the micro-batches' weighted gradients add up to the padded batch's."""
    _, tok = tiny
    exp = experience(long_tail_rollout(tok), **SCENARIOS[scenario])
    algorithm = {"beta": 0.05} if SCENARIOS[scenario].get("kl") else {}
    padded_actor, packed_actor = (actor_for(make_tiny_policy, b, loss_type, **algorithm) for b in (0, 8))
    assert len(padded_actor.micro_batches(exp.rollout)) == 1 and len(packed_actor.micro_batches(exp.rollout)) > 2
    want, want_grads = gradients(padded_actor, exp)
    got, got_grads = gradients(packed_actor, exp)
    scale = max(g.abs().max().item() for g in want_grads.values())
    assert scale > 1e-3, "test setup: gradients must not vanish"
    err = max((want_grads[n] - got_grads[n]).abs().max().item() for n in want_grads) / scale
    assert err < 1e-5, f"{loss_type}/{scenario}: packed gradients differ (max relative error {err:.1e})"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if SCENARIOS[scenario].get("off_policy"):
        assert 0 < want["clip_ratio/region_mean"] < 1, "test setup: clipping must be exercised"


def test_sequence_level_ratios_and_no_sharing(make_tiny_policy, tiny):
    """GSPO's per-sequence ratio spans a row, never a micro-batch; the same without a shared prompt pass."""
    _, tok = tiny
    exp = experience(long_tail_rollout(tok), off_policy=True)
    results = []
    for budget in (0, 8):
        actor = actor_for(make_tiny_policy, budget, "grpo", importance_sampling_level="sequence")
        actor._shares_prompt = lambda: False       # what gradient checkpointing forces (notebook 04)
        results.append(gradients(actor, exp))
    (want, want_grads), (got, got_grads) = results
    scale = max(g.abs().max().item() for g in want_grads.values())
    assert max((want_grads[n] - got_grads[n]).abs().max().item() for n in want_grads) < 1e-5 * scale
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and 0 < want["clip_ratio/region_mean"] < 1


def test_a_wrong_micro_batch_weight_is_caught(make_tiny_policy, tiny, monkeypatch):
    """Negative control: weighting every micro-batch 1 (plain accumulation of means) changes the gradient."""
    import dataclasses

    from minirl import loss_types

    _, tok = tiny
    exp = experience(long_tail_rollout(tok))
    _, want = gradients(actor_for(make_tiny_policy, 0, "grpo"), exp)
    plain_sum = dataclasses.replace(loss_types.LOSS_TYPES["grpo"], micro_batch_weight=lambda *args: 1.0)
    monkeypatch.setitem(loss_types.LOSS_TYPES, "grpo", plain_sum)
    _, got = gradients(actor_for(make_tiny_policy, 8, "grpo"), exp)
    scale = max(g.abs().max().item() for g in want.values())
    assert max((want[n] - got[n]).abs().max().item() for n in want) > 1e-2 * scale


def test_actor_logprobs_and_a_full_update_agree(make_tiny_policy, tiny):
    """actor.logprobs (pi_old) and update's grad norm and loss: the same with and without micro-batches."""
    _, tok = tiny
    ro = long_tail_rollout(tok)
    exp = experience(ro)
    records, logps = [], []
    for budget in (0, 8):
        actor = actor_for(make_tiny_policy, budget, "dapo")
        logps.append(actor.logprobs(ro))
        records.append(actor.update(exp))
    torch.testing.assert_close(logps[1], logps[0], atol=1e-5, rtol=0)
    assert (logps[0][ro.completion_mask == 0] == 0).all(), "0 where masked, like the rollout's log-probs"
    assert records[1]["grad_norm"] == pytest.approx(records[0]["grad_norm"], rel=1e-5)
    assert records[1]["loss"] == pytest.approx(records[0]["loss"], rel=1e-5, abs=1e-7)
    assert records[0]["skipped"] == records[1]["skipped"] == 0


def test_packed_backward_repeats_bit_for_bit(make_tiny_policy, tiny):
    _, tok = tiny
    exp = experience(long_tail_rollout(tok), off_policy=True)
    runs = [gradients(actor_for(make_tiny_policy, 8), exp) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


# ---- the cost: tokens per pass, passes, skipping ----------------------------------------------------

def test_each_pass_computes_at_most_the_budget(make_tiny_policy, tiny):
    """Prompts: two passes over the B prompts (without, then with gradient); completions: <= budget per pass."""
    _, tok = tiny
    ro = long_tail_rollout(tok)
    budget = 8
    actor = actor_for(make_tiny_policy, budget)
    sizes = []
    actor.model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(tuple(kwargs["input_ids"].shape)),
                                          with_kwargs=True)
    gradients(actor, experience(ro))
    B, P = len(PROMPTS), ro.prompt_ids.shape[1]
    plan = actor.micro_batches(ro)
    assert sizes[0] == sizes[-1] == (B, P), sizes
    completion_passes = sizes[1:-1]
    assert len(completion_passes) == len(plan) > 2
    for (n, width), rows in zip(completion_passes, plan, strict=True):
        longest = max(LENGTHS[i] for i in rows)
        assert n == len(rows) and width == max(longest, 2) - 1      # the last token predicts nothing
        assert n * longest <= budget or n == 1
    padded = len(LENGTHS) * (max(LENGTHS) - 1)
    assert sum(n * w for n, w in completion_passes) < 0.6 * padded


def test_a_non_finite_micro_batch_skips_the_step_and_keeps_the_weights(make_tiny_policy, tiny):
    _, tok = tiny
    ro = long_tail_rollout(tok)
    actor = actor_for(make_tiny_policy, 8)
    plan = actor.micro_batches(ro)
    bad = experience(ro)
    bad.advantages[plan[-1][0]] = math.nan                         # a row of the last micro-batch
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    metrics = actor.update(bad)
    assert metrics["skipped"] == 1 and math.isnan(metrics["loss"]) and math.isnan(metrics["grad_norm"])
    assert all(torch.equal(v, before[k]) for k, v in actor.model.state_dict().items())
    assert all(p.grad is None for p in actor.model.parameters()), "no gradient left behind"
    assert actor.update(experience(ro))["skipped"] == 0


def test_with_dropout_disabled_a_dropout_model_packs_as_it_pads(make_tiny_policy, tiny):
    """Issue 30 item 3: a model with dropout breaks the packed update's shared prompt pass (each micro-batch would
    draw other masks than the padded pass); disable_dropout (TRL's setting, on by default) makes them equal."""
    from minirl.runtime.model_loading import disable_dropout

    _, tok = tiny
    exp = experience(long_tail_rollout(tok))
    results = {}
    for disabled in (False, True):
        padded_actor, packed_actor = (actor_for(make_tiny_policy, b) for b in (0, 8))
        for actor in (padded_actor, packed_actor):
            actor.model.config.attention_dropout = 0.3
            for module in actor.model.modules():
                if hasattr(module, "attention_dropout"):
                    module.attention_dropout = 0.3
            if disabled:
                assert disable_dropout(actor.model) > 0
        torch.manual_seed(0)
        _, want = gradients(padded_actor, exp)
        torch.manual_seed(0)
        _, got = gradients(packed_actor, exp)
        scale = max(g.abs().max().item() for g in want.values())
        results[disabled] = max((want[n] - got[n]).abs().max().item() for n in want) / scale
    assert results[True] < 1e-5, f"dropout off: packed and padded differ by {results[True]:.1e}"
    assert results[False] > 1e-3, f"dropout on: they should differ (by {results[False]:.1e}): the test can fail"
