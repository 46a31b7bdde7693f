"""The rollout engine: HF generate with a KV cache on its own versioned copy (minirl.rollout.hf)."""

import copy

import pytest
import torch

from minirl.logprobs import completion_logprobs
from minirl.models import PolicyConfig, build_policy, build_tokenizer
from minirl.rollout.hf import HFRollout, VersionMismatchError, completion_mask_from_ids

PROMPTS = ["27+35=", "4+5=", "99+1="]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    model = build_policy(PolicyConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=2), tokenizer)
    return model.eval(), tokenizer


def test_completion_mask_up_to_first_eos():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 0]])
    assert completion_mask_from_ids(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_generate_shapes_order_and_behaviour_logprobs(tiny):
    model, tok = tiny
    engine = HFRollout(model, tok)
    ro = engine.generate(PROMPTS, num_generations=4, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    N, C = 12, ro.num_completion_tokens
    assert ro.completion_ids.shape == ro.completion_mask.shape == ro.logprobs.shape == (N, C) and C <= 5
    assert ro.prompts == [p for p in PROMPTS for _ in range(4)], "G consecutive samples per prompt"
    assert len(ro.completions) == N and ro.version == 0
    assert (ro.logprobs <= 0).all() and (ro.logprobs[ro.completion_mask == 0] == 0).all()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(ro.logprobs[m], trainer[m], atol=1e-5, rtol=0)
    texts = tok.batch_decode(ro.completion_ids * ro.completion_mask, skip_special_tokens=True)
    assert texts == ro.completions


def test_generator_makes_sampling_repeatable_and_leaves_global_rng(tiny):
    model, tok = tiny
    engine = HFRollout(model, tok)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate(PROMPTS, 4, 5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), before), "sampling with a generator must not move the global RNG"
    b = engine.generate(PROMPTS, 4, 5, generator=torch.Generator().manual_seed(7))
    c = engine.generate(PROMPTS, 4, 5, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_version_check_and_sync(tiny):
    model, tok = tiny
    engine = HFRollout(model, tok)
    with pytest.raises(VersionMismatchError, match="holds policy version 0 but the loop expected version 1"):
        engine.generate(PROMPTS, 2, 3, expected_version=1)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.5)
    engine.load_weights(changed.state_dict(), version=1)
    ro = engine.generate(PROMPTS, 2, 3, expected_version=1, generator=torch.Generator().manual_seed(0))
    assert ro.version == 1
    torch.testing.assert_close(engine.model.model.embed_tokens.weight, changed.model.embed_tokens.weight)
    assert not torch.equal(engine.model.model.embed_tokens.weight, model.model.embed_tokens.weight), \
        "the rollout holds a copy; the trainer's model must be untouched"


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.bfloat16)])
def test_low_precision_rollout(tiny, dtype, torch_dtype):
    model, tok = tiny
    engine = HFRollout(model, tok, dtype=dtype)
    assert next(engine.model.parameters()).dtype == torch_dtype
    w = engine.model.model.layers[0].mlp.up_proj.weight.float()
    ref = model.model.layers[0].mlp.up_proj.weight
    assert 0 < (w - ref).abs().max() < 0.1 * ref.abs().max()
    ro = engine.generate(PROMPTS, 2, 4, generator=torch.Generator().manual_seed(0))
    assert ro.logprobs.dtype == torch.float32


def test_bad_input(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="dtype='int8'"):
        HFRollout(model, tok, dtype="int8")
    nopad = copy.deepcopy(tok)
    nopad.pad_token = None
    with pytest.raises(ValueError, match="tokenizer.pad_token is None"):
        HFRollout(model, nopad)
    engine = HFRollout(model, tok)
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], 2, 3)
