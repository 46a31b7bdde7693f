"""Shared fixtures: tiny policies built locally (no hub), a tiny GPT-2, a saved model directory."""

import pytest
import torch

from minirl.models.policy import PolicyConfig, build_policy, build_tokenizer


def build_tiny_policy(seed: int = 1, num_layers: int = 2, hidden_size: int = 32):
    """A freshly initialized Qwen2 policy of a few thousand parameters and the character tokenizer."""
    tokenizer = build_tokenizer()
    config = PolicyConfig(hidden_size=hidden_size, num_layers=num_layers, num_heads=2, num_kv_heads=1, seed=seed)
    return build_policy(config, tokenizer).eval(), tokenizer


@pytest.fixture(scope="session")
def make_tiny_policy():
    """A factory: make_tiny_policy(seed=1, num_layers=2) -> (model, tokenizer), fresh each call."""
    return build_tiny_policy


@pytest.fixture(scope="module")
def tiny():
    """One tiny Qwen2 policy (2 layers, seed 1) and its tokenizer, shared by a test module."""
    return build_tiny_policy()


@pytest.fixture(scope="module")
def tiny_gpt2():
    """A tiny GPT-2 (learned absolute positions) over the embedded tokenizer's vocabulary, random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(build_tokenizer()), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=1, eos_token_id=2)).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A locally saved tiny Qwen2 with random weights and our tokenizer: the `--model PATH` of the chapters."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model, tokenizer = build_tiny_policy(seed=5, num_layers=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
