"""Per-token log-probs, entropies and masked reductions (minirl.algo.logprobs)."""

import math

import pytest
import torch

from minirl.algo.logprobs import (
    completion_logprobs,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    position_ids_from_mask,
    selective_log_softmax,
)


def test_masked_mean_ignores_masked_and_empty_rows_are_zero():
    values = torch.tensor([[1.0, 2.0, 100.0], [5.0, 6.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(1.5)
    assert masked_mean(values, mask, dim=-1).tolist() == [1.5, 0.0]
    assert masked_sum(values, mask).item() == 3.0
    assert masked_sum(values, mask, dim=-1).tolist() == [3.0, 0.0]


def test_masked_mean_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"same shape"):
        masked_mean(torch.ones(2, 3), torch.ones(2, 4))


def test_position_ids_start_at_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax_matches_full_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=dtype) * 4
    index = torch.randint(11, (3, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), expected)


def test_entropy_uniform_and_peaked():
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8), abs=1e-6)
    assert entropy_from_logits(torch.tensor([[[50.0, 0.0, 0.0]]])).item() < 1e-6


def _padded(ids, n_pad):
    pad = torch.zeros(1, n_pad, dtype=torch.long)
    return torch.cat([pad, ids], 1), torch.cat([pad, torch.ones_like(ids)], 1)


def test_left_padding_does_not_change_completion_logprobs(tiny):
    """A left-padded prompt must score as an unpadded one (Qwen2: RoPE is shift-invariant anyway)."""
    model, tok = tiny
    ids = tok(["7+8=51"], return_tensors="pt", add_special_tokens=False).input_ids     # prompt 4 + completion 2
    padded_ids, padded_mask = _padded(ids, 3)
    with torch.no_grad():
        alone, _ = completion_logprobs(model, ids, torch.ones_like(ids), 2)
        padded, _ = completion_logprobs(model, padded_ids, padded_mask, 2)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_position_ids_matter_for_absolute_position_embeddings():
    """GPT-2 learns absolute positions: without position ids from the mask a padded prompt scores wrong."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=18, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    padded_ids, padded_mask = _padded(ids, 3)
    with torch.no_grad():
        alone, _ = completion_logprobs(model, ids, torch.ones_like(ids), 2)
        padded, _ = completion_logprobs(model, padded_ids, padded_mask, 2)
        logits = model(input_ids=padded_ids, attention_mask=padded_mask).logits[:, -3:-1]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)
    wrong = torch.log_softmax(logits, -1).gather(-1, ids[:, -2:, None]).squeeze(-1)
    assert (wrong - alone).abs().max() > 1e-2, "without position ids the log-probs should differ (test is live)"


def test_temperature_and_entropy(tiny):
    model, tok = tiny
    ids = tok(["12+3=51", "11+1=21"], return_tensors="pt", add_special_tokens=False).input_ids
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logps, ent = completion_logprobs(model, ids, mask, 3, temperature=2.0, with_entropy=True)
        logits = model(input_ids=ids).logits[:, -4:-1].float() / 2.0
    torch.testing.assert_close(logps, torch.log_softmax(logits, -1).gather(-1, ids[:, -3:, None]).squeeze(-1),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits))
    assert logps.dtype == torch.float32 and logps.shape == (2, 3)
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model, ids, mask, 3, temperature=0.0)


def _groups(tok, G):
    """Three prompts of different lengths (left-padded), G right-padded completions each: [3G, P+C]."""
    prompts = ["27+35=", "4+5=", "99+1="]
    e = tok.eos_token
    completions = [f"26{e}", f"7{e}", "0", "1", f"001{e}", f"52{e}"]
    prompt = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = [completions[(i * G + g) % len(completions)] for i in range(len(prompts)) for g in range(G)]
    comp = tok(rows, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="right")
    ids = torch.cat([prompt.input_ids.repeat_interleave(G, 0), comp.input_ids], 1)
    mask = torch.cat([prompt.attention_mask.repeat_interleave(G, 0), comp.attention_mask], 1)
    return ids, mask, comp.input_ids.shape[1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_gives_the_same_logprobs_and_gradients(tiny, temperature):
    """num_generations=G runs each group's prompt once: same log-probs and gradients as one pass over all rows."""
    model, tok = tiny
    G = 4
    ids, mask, C = _groups(tok, G)
    assert C > 1 and (mask[:, :-C] == 0).any(), "test setup: padded prompts and several completion tokens"
    comp_mask = mask[:, -C:]
    weights = torch.randn(ids.shape[0], C, generator=torch.Generator().manual_seed(0)) * comp_mask
    results = []
    for num_generations in (1, G):
        model.zero_grad(set_to_none=True)
        logps, ent = completion_logprobs(model, ids, mask, C, temperature, with_entropy=True,
                                         num_generations=num_generations)
        (logps * weights).sum().backward()
        results.append((logps.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (one, ent1, grads1), (shared, ent_s, grads_s) = results
    m = comp_mask.bool()
    torch.testing.assert_close(shared[m], one[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_s[m], ent1[m], atol=1e-5, rtol=0)
    scale = max(g.abs().max().item() for g in grads1)
    assert scale > 1e-4, "test setup: gradients must not vanish"
    err = max((a - b).abs().max().item() for a, b in zip(grads1, grads_s, strict=True)) / scale
    assert err < 1e-4, f"shared-prefix gradients differ from one pass's (max relative error {err:.1e})"
    model.zero_grad(set_to_none=True)


def test_shared_prefix_single_token_completion(tiny):
    model, tok = tiny
    ids, mask, C = _groups(tok, 2)
    ids, mask = ids[:, :1 - C], mask[:, :1 - C]    # keep one completion column
    with torch.no_grad():
        one, _ = completion_logprobs(model, ids, mask, 1)
        shared, _ = completion_logprobs(model, ids, mask, 1, num_generations=2)
    torch.testing.assert_close(shared, one, atol=1e-5, rtol=0)


def test_shared_prefix_refuses_groups_that_do_not_share_a_prompt(tiny):
    model, tok = tiny
    ids, mask, C = _groups(tok, 2)                 # 6 rows: 3 prompts x 2
    with pytest.raises(ValueError, match="num_generations=3 but the rows of a group have different prompts"):
        completion_logprobs(model, ids, mask, C, num_generations=3)
    with pytest.raises(ValueError, match="6 rows are not groups of num_generations=4"):
        completion_logprobs(model, ids, mask, C, num_generations=4)
    with pytest.raises(ValueError, match="num_generations=0"):
        completion_logprobs(model, ids, mask, C, num_generations=0)
    swapped = mask.clone()
    swapped[3, :-C] = 1                            # same ids, another prompt mask in group 1 ("4+5=", padded)
    with pytest.raises(ValueError, match="attention_mask differs"):
        completion_logprobs(model, ids, swapped, C, num_generations=2)


def test_shared_prefix_with_absolute_position_embeddings():
    """GPT-2 (learned absolute positions): the completion pass must continue each row's own positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=18, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [0, 0, 5, 6, 7, 3, 0], [5, 5, 5, 6, 7, 4, 2], [5, 5, 5, 6, 7, 9, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        one, _ = completion_logprobs(model, ids, mask, 2)
        shared, _ = completion_logprobs(model, ids, mask, 2, num_generations=2)
    m = mask[:, -2:].bool()
    torch.testing.assert_close(shared[m], one[m], atol=1e-5, rtol=0)
