"""The memory calculator (minirl.memory.calculator): closed forms, the source's tables, configs, bad input."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from minirl.memory.calculator import (
    GB,
    LLAMA2_70B,
    ZERO_LEVELS,
    ModelShape,
    activation_memory,
    bytes_per_param,
    checkpointed_activation_bytes,
    lora_memory,
    lora_params,
    min_gpus,
    state_bytes,
    training_memory,
    zero_communication,
    zero_per_gpu,
    zero_saving,
)

P70 = 70e9


def test_sixteen_bytes_and_the_70b_table():
    per = bytes_per_param("mixed")
    assert (per["weights"], per["grads"], per["master"], per["adam_m"], per["adam_v"]) == (2, 2, 4, 4, 4)
    gb = {k: v / GB for k, v in state_bytes(P70).items()}
    assert gb == {"weights": 140, "grads": 140, "master": 280, "adam_m": 280, "adam_v": 280, "total": 1120}
    assert bytes_per_param("fp32")["total"] == 16 and bytes_per_param("fp32")["master"] == 0
    assert bytes_per_param("bf16")["total"] == 8


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_zero_closed_forms(n):
    psi = 1e9
    assert zero_per_gpu(psi, n, 0)["total"] == pytest.approx(16 * psi)
    assert zero_per_gpu(psi, n, 1)["total"] == pytest.approx((4 + 12 / n) * psi)
    assert zero_per_gpu(psi, n, 2)["total"] == pytest.approx((2 + 14 / n) * psi)
    assert zero_per_gpu(psi, n, 3)["total"] == pytest.approx(16 * psi / n)
    assert zero_per_gpu(psi, n, 3, "fp32")["weights"] == pytest.approx(4 * psi / n)


def test_zero_savings_tend_to_the_source_limits():
    assert zero_saving(10**6, 1) == pytest.approx(4, rel=1e-4)
    assert zero_saving(10**6, 2) == pytest.approx(8, rel=1e-4)
    assert zero_saving(8, 3) == pytest.approx(8)
    assert zero_saving(8, 1) < 3 and zero_saving(8, 2) < 4.5  # far from the limits at N = 8
    savings = [zero_saving(n, 2) for n in (2, 4, 8, 16)]
    assert savings == sorted(savings)


def test_communication_volumes():
    ddp = zero_communication(1e9, 8, 0)
    assert ddp["bytes"] == pytest.approx(2 * 7 / 8 * 1e9 * 2)
    assert zero_communication(1e9, 8, 1)["vs_ddp"] == pytest.approx(1.0)
    assert zero_communication(1e9, 8, 2)["vs_ddp"] == pytest.approx(1.0)
    assert zero_communication(1e9, 8, 3)["vs_ddp"] == pytest.approx(1.5)


def test_llama2_70b_shape_counts_its_parameters():
    assert LLAMA2_70B.param_count() == 68_976_648_192  # the published Llama-2-70B count


def test_model_shape_from_config_matches_a_real_model(tmp_path):
    config = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    real = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    shape = ModelShape.from_pretrained(str(tmp_path))
    assert shape.param_count() == real
    assert (shape.hidden_size, shape.num_layers, shape.kv_dim, shape.qkv_bias) == (64, 3, 32, True)
    closed_form = ModelShape(**{**vars(shape), "num_params": None}).param_count()
    assert closed_form == real, "the closed-form count must match the module's for a Qwen2 layout"


def test_from_config_counts_tied_embeddings_once():
    """init_empty_weights left the tie out: the embedded policy showed 989,824 instead of 987,520 (issue 9, item 15)."""
    tied = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    real = sum(p.numel() for p in Qwen2ForCausalLM(tied).parameters())   # parameters() yields a tied tensor once
    shape = ModelShape.from_config(tied)
    assert shape.param_count() == real and shape.tie_embeddings
    assert ModelShape(**{**vars(shape), "num_params": None}).param_count() == real
    qwen25_05b = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    assert ModelShape.from_config(qwen25_05b).param_count() == 494_032_768  # Qwen2.5-0.5B's published 0.49 B


@pytest.mark.parametrize("field, value", [("hidden_size", -5), ("num_hidden_layers", 0), ("num_attention_heads", 0)])
def test_from_config_names_a_bad_size(field, value):
    """hidden_size: -5 gave torch's 'negative dimension' from inside the model build (issue 9, item 18)."""
    config = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=rf"{field}={value}: must be a positive integer"):
        ModelShape.from_config(config)


def test_padding_mask_repeats_kv_and_keeps_the_mask():
    """A padded batch makes HF's SDPA repeat K/V to every head and save the mask (issue 9, item 17)."""
    seq = 4096
    plain = activation_memory(LLAMA2_70B, 1, seq)["layer"]
    padded = activation_memory(LLAMA2_70B, 1, seq, padding_mask=True)["layer"]
    h, kv = LLAMA2_70B.hidden_size, LLAMA2_70B.kv_dim
    assert padded - plain == seq * (2 * 2 * (h - kv) + 2 * seq)           # bf16: K, V widened; the mask row
    assert 0.08 < padded / plain - 1 < 0.10                                 # +7 % from K/V, +2 % from the mask
    eager = activation_memory(LLAMA2_70B, 1, seq, attention="eager")["layer"]
    assert activation_memory(LLAMA2_70B, 1, seq, attention="eager", padding_mask=True)["layer"] == eager, \
        "eager attention repeats K/V anyway and its backward does not keep the mask"


def test_activation_formula_per_token():
    s = ModelShape(hidden_size=64, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2,
                   vocab_size=18, tie_embeddings=True)
    act = activation_memory(s, batch=1, seq=1, dtype="fp32")
    # 2 norms (12h + 4) + q, k, v, out (2h + 2kv) * 4 + lse 4a + MLP 16 I, as measured on HF Qwen2
    assert act["layer"] == 2 * (12 * 64 + 4) + 4 * (2 * 64 + 2 * 32) + 16 + 16 * 256
    assert act["boundary"] == 4 * 64
    assert act["total"] == 2 * act["layer"] + act["head"]
    eager = activation_memory(s, 1, 100, "fp32", "eager")
    sdpa = activation_memory(s, 1, 100, "fp32", "sdpa")
    assert eager["layer"] > sdpa["layer"], "eager attention keeps the s x s scores"


def test_checkpointing_shrinks_activations():
    none = activation_memory(LLAMA2_70B, 1, 4096, recompute="none")["total"]
    full = activation_memory(LLAMA2_70B, 1, 4096, recompute="full")["total"]
    sqrt = activation_memory(LLAMA2_70B, 1, 4096, recompute="sqrt")["total"]
    assert full < sqrt < none
    assert 100 * GB < none < 140 * GB
    assert checkpointed_activation_bytes(10, 1, 0, 16, "sqrt") == 4 * 1 + 4 * 10
    assert checkpointed_activation_bytes(10, 1, 0, 10, "sqrt") == 4 * 1 + 3 * 10


def test_the_70b_on_80gb_verdicts():
    act = activation_memory(LLAMA2_70B, 1, 400, recompute="full")["total"]
    assert zero_per_gpu(P70, 8, 3)["total"] + act > 80 * GB, "ZeRO-3 + checkpointing on 8 GPUs does not fit"
    assert min_gpus(P70, 80 * GB, 3, activation_bytes=act) == 15
    assert min_gpus(P70, 80 * GB, 2) is None and min_gpus(P70, 80 * GB, 0) is None
    lora = lora_memory(P70, lora_params(LLAMA2_70B, 16), 8, 3)
    assert 17.5 * GB < lora["total"] < 19 * GB
    assert lora_params(LLAMA2_70B, 16) == 80 * 16 * (2 * 8192 * 2 + 2 * (8192 + 1024) + 3 * (8192 + 28672))


def test_training_memory_adds_state_and_activations():
    out = training_memory(P70, 8, 3, global_batch=8, seq=1024, recompute="full")
    assert out["state"] == pytest.approx(140 * GB)
    assert out["total"] == pytest.approx(out["state"] + out["activations"])


@pytest.mark.parametrize("call, match", [
    (lambda: bytes_per_param("fp8"), r"precision='fp8'.*'mixed', 'fp32', 'bf16'"),
    (lambda: zero_per_gpu(1e9, 8, 4), r"stage=4.*0, 1, 2, 3"),
    (lambda: zero_per_gpu(-1, 8, 1), r"num_params=-1.*positive"),
    (lambda: zero_per_gpu(1e9, 0, 1), r"num_gpus=0"),
    (lambda: zero_per_gpu(1e9, 2.5, 1), r"num_gpus=2.5"),
    (lambda: state_bytes(0), r"num_params=0"),
    (lambda: training_memory(1e9, 8, 3, global_batch=12), r"global_batch=12.*num_gpus=8"),
    (lambda: activation_memory(LLAMA2_70B, 0, 10), r"batch=0"),
    (lambda: activation_memory(LLAMA2_70B, 1, 10, dtype="int8"), r"dtype='int8'.*'fp32'"),
    (lambda: activation_memory(LLAMA2_70B, 1, 10, recompute="half"), r"recompute='half'.*'none', 'full', 'sqrt'"),
    (lambda: lora_params(LLAMA2_70B, 8, ("qkv",)), r"target_modules=\['qkv'\]"),
    (lambda: ModelShape(64, 2, 128, 5, 1, 10), r"hidden_size=64.*num_heads=5"),
    (lambda: min_gpus(1e9, -5, 3), r"gpu_memory_bytes=-5"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_min_gpus_is_minimal():
    for stage in ZERO_LEVELS:
        n = min_gpus(7e9, 80 * GB, stage, activation_bytes=5 * GB)
        if n is not None:
            assert zero_per_gpu(7e9, n, stage)["total"] + 5 * GB <= 80 * GB
            assert n == 1 or zero_per_gpu(7e9, n - 1, stage)["total"] + 5 * GB > 80 * GB
    assert math.isclose(min_gpus(1e9, 16e9, 3), 1)
