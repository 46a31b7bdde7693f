"""The rollout engines: HF generate and the shared-prefix sampler, on their own versioned copies (minirl.rollout)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from minirl.algo.logprobs import completion_logprobs
from minirl.config import SamplingConfig
from minirl.rollout.base import RolloutEngine, VersionMismatchError, completion_mask_from_ids
from minirl.rollout.hf import HFEngine
from minirl.rollout.shared_prefix import SharedPrefixEngine, sample_shared_prefix
from minirl.runtime.prefix_sharing import CACHE_ARG

PROMPTS = ["27+35=", "4+5=", "99+1="]
ENGINES = {"hf": HFEngine, "shared_prefix": SharedPrefixEngine}


def sampling(G, C, temperature=1.0):
    return SamplingConfig(num_generations=G, max_completion_length=C, temperature=temperature)


@pytest.fixture(scope="module")
def tiny(make_tiny_policy):
    return make_tiny_policy(seed=2)


def test_completion_mask_up_to_first_eos():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 0]])
    assert completion_mask_from_ids(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("engine_name", ENGINES)
def test_generate_shapes_order_and_behaviour_logprobs(tiny, engine_name):
    model, tok = tiny
    engine = ENGINES[engine_name](model, tok)
    ro = engine.generate(PROMPTS, sampling(4, 5), generator=torch.Generator().manual_seed(0))
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


@pytest.mark.parametrize("engine_name", ENGINES)
def test_generator_makes_sampling_repeatable_and_leaves_global_rng(tiny, engine_name):
    model, tok = tiny
    engine = ENGINES[engine_name](model, tok)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate(PROMPTS, sampling(4, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), before), "sampling with a generator must not move the global RNG"
    b = engine.generate(PROMPTS, sampling(4, 5), generator=torch.Generator().manual_seed(7))
    c = engine.generate(PROMPTS, sampling(4, 5), generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_version_check_and_sync(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok)
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(VersionMismatchError, match="holds policy version 0 but the loop expected version 1"):
        engine.generate(PROMPTS, sampling(2, 3), expected_version=1)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.5)
    engine.load_weights(changed.state_dict().items(), version=1)
    ro = engine.generate(PROMPTS, sampling(2, 3), expected_version=1, generator=torch.Generator().manual_seed(0))
    assert ro.version == 1
    torch.testing.assert_close(engine.model.model.embed_tokens.weight, changed.model.embed_tokens.weight)
    assert not torch.equal(engine.model.model.embed_tokens.weight, model.model.embed_tokens.weight), \
        "the rollout holds a copy; the trainer's model must be untouched"


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.bfloat16)])
def test_low_precision_rollout(tiny, dtype, torch_dtype, engine_name):
    model, tok = tiny
    engine = ENGINES[engine_name](model, tok, dtype=dtype)
    assert next(engine.model.parameters()).dtype == torch_dtype
    w = engine.model.model.layers[0].mlp.up_proj.weight.float()
    ref = model.model.layers[0].mlp.up_proj.weight
    assert 0 < (w - ref).abs().max() < 0.1 * ref.abs().max()
    ro = engine.generate(PROMPTS, sampling(2, 4), generator=torch.Generator().manual_seed(0))
    assert ro.logprobs.dtype == torch.float32
    # the behaviour log-probs are the engine's own: a forward pass of its low-precision copy
    with torch.no_grad():
        own, _ = completion_logprobs(engine.model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
        fp32, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
    m = ro.completion_mask.bool()
    # mean, not max: bf16's cached decode and a full forward differ on single tokens by as much as bf16 differs
    # from fp32 (0.0008 vs 0.0007 at the max on one CPU), while on average the copy's own forward is ~4x closer
    own_err, fp32_err = (ro.logprobs[m] - own[m]).abs().mean(), (ro.logprobs[m] - fp32[m]).abs().mean()
    assert fp32_err > 1e-4, "test setup: low precision must differ from fp32"
    assert own_err <= 0.5 * fp32_err, "behaviour log-probs must come from the rollout copy, not the fp32 trainer"


def test_bad_input(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="rollout_dtype='int8'"):
        HFEngine(model, tok, dtype="int8")
    nopad = copy.deepcopy(tok)
    nopad.pad_token = None
    with pytest.raises(ValueError, match="tokenizer.pad_token is None"):
        SharedPrefixEngine(model, nopad)
    engine = HFEngine(model, tok)
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], sampling(2, 3))
    with pytest.raises(ValueError, match="max_completion_length=0"):
        engine.generate(PROMPTS, sampling(2, 0))


def test_engines_agree_on_the_prompt_rows_and_the_consumed_seed(tiny):
    """Both engines lay out the same [N, P] prompts and draw exactly one number from the generator."""
    model, tok = tiny
    outs, states = {}, {}
    for name in ENGINES:
        generator = torch.Generator().manual_seed(3)
        outs[name] = ENGINES[name](model, tok).generate(PROMPTS, sampling(3, 4), generator=generator)
        states[name] = generator.get_state()
    assert torch.equal(outs["hf"].prompt_ids, outs["shared_prefix"].prompt_ids)
    assert torch.equal(outs["hf"].prompt_mask, outs["shared_prefix"].prompt_mask)
    assert outs["hf"].prompts == outs["shared_prefix"].prompts
    assert torch.equal(states["hf"], states["shared_prefix"]), "the loop's generator must advance alike"


def test_shared_prefix_samples_the_model_distribution(tiny):
    """4000 samples of one prompt's first token follow softmax(logits / temperature) (total variation < 0.04)."""
    model, tok = tiny
    engine = SharedPrefixEngine(model, tok)
    temperature = 1.5
    ro = engine.generate(["27+35="], sampling(4000, 1, temperature), generator=torch.Generator().manual_seed(0))
    enc = tok(["27+35="], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        probs = torch.softmax(model(**enc).logits[0, -1].float() / temperature, -1)       # [V]
    counts = torch.bincount(ro.completion_ids[:, 0], minlength=probs.numel()).float()
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
    assert (probs > 0.05).sum() >= 3, "test setup: the distribution must have several likely tokens"
    assert tv < 0.04, f"sampled first tokens are {tv:.3f} (total variation) from the model's distribution"
    torch.testing.assert_close(ro.logprobs[:, 0], probs.log()[ro.completion_ids[:, 0]] * ro.completion_mask[:, 0],
                               atol=1e-5, rtol=0)


class CoinModel(torch.nn.Module):
    """A fake causal LM: next token is EOS or token 7 with probability 1/2 each, whatever the input."""

    EOS, OTHER, VOCAB = 2, 7, 10

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep=0, **kwargs):
        self.calls.append((tuple(input_ids.shape), tuple(attention_mask.shape), position_ids.clone()))
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.VOCAB), -1e4)
        logits[..., [self.EOS, self.OTHER]] = 0.0
        cache = kwargs.get(CACHE_ARG) or SimpleNamespace(
            batch_repeat_interleave=lambda n: self.calls.append(("repeat", n)))
        return SimpleNamespace(logits=logits, **{CACHE_ARG: cache})


def test_shared_prefix_loop_pads_after_eos_and_stops_early():
    model = CoinModel()
    prompt_ids = torch.tensor([[0, 5, 6], [5, 6, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    ids, logps = sample_shared_prefix(model, prompt_ids, prompt_mask, 16, 12, 1.0, CoinModel.EOS, 0,
                                      torch.Generator().manual_seed(0))
    N, C = ids.shape
    assert N == 32 and C < 12, "every row ends with probability 1/2 per token: all 32 end well before 12 tokens"
    assert model.calls[0][0] == (2, 3) and model.calls[1] == ("repeat", 16), "prefill each prompt once, then repeat"
    assert len(model.calls) == 2 + (C - 1), "one decoding step per new token after the first"
    mask = completion_mask_from_ids(ids, CoinModel.EOS)
    assert (ids[mask == 0] == 0).all(), "after its EOS a row gets pad tokens"
    assert ((ids == CoinModel.EOS) | (ids == CoinModel.OTHER))[mask == 1].all()
    assert (ids == CoinModel.EOS).any(1).all(), "the loop stops only when every row has ended"
    torch.testing.assert_close(logps[mask == 1], torch.full_like(logps[mask == 1], -0.6931472))
    _, attention, positions = model.calls[2]
    assert attention == (32, 4), "the mask grows by one column per new token"
    assert positions[:16].flatten().tolist() == [2] * 16 and positions[16:].flatten().tolist() == [3] * 16, \
        "positions continue from each prompt's real length (left padding skipped)"
