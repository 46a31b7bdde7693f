"""The embedded policy: tokenizer, model, warm start determinism, offline loading, the cache."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl.models.policy import (PolicyConfig, WarmStartConfig, build_default_policy, build_policy, build_tokenizer,
                           default_policy_dir, greedy_accuracy, load_default_policy, warm_start_report)
from minirl.tasks.arithmetic import TaskConfig, make_task

SMALL_TASK = TaskConfig(max_operand=19, num_test=40)
SMALL_POLICY = PolicyConfig(hidden_size=32, num_layers=2)
SHORT = WarmStartConfig(steps=12, batch_size=16)


def test_tokenizer_round_trip_and_left_padding():
    tok = build_tokenizer()
    texts = ["27+35=", "4+5=", "0-9*8= "]
    enc = tok(texts, padding=True, add_special_tokens=False)
    assert tok.batch_decode(enc["input_ids"], skip_special_tokens=True) == texts
    assert enc["input_ids"][1][:2] == [tok.pad_token_id] * 2, "prompts are padded on the left"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert all(len(tok(c, add_special_tokens=False)["input_ids"]) == 1 for c in "0123456789+-*= ")


def test_policy_is_a_small_qwen2():
    model = build_policy(PolicyConfig(), build_tokenizer())
    n = sum(p.numel() for p in model.parameters())
    assert model.config.model_type == "qwen2" and 0.5e6 < n < 5e6


def test_saved_policy_loads_offline_with_auto_classes(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, path = load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
    assert path == default_policy_dir(SMALL_TASK, SMALL_POLICY, SHORT) and path.parent == tmp_path
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()
    again = AutoModelForCausalLM.from_pretrained(path)
    tok2 = AutoTokenizer.from_pretrained(path)
    assert tok2("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert not list(tmp_path.glob("*.tmp-*")), "no temporary directory is left behind"


def test_warm_start_repeats_bit_for_bit(tmp_path):
    states, reports = [], []
    for run in ("a", "b"):
        build_default_policy(tmp_path / run, SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
        states.append(AutoModelForCausalLM.from_pretrained(tmp_path / run).state_dict())
        reports.append(warm_start_report(tmp_path / run))
    assert reports[0] == reports[1]
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_cache_key_depends_on_every_config():
    base = default_policy_dir()
    assert base == default_policy_dir()
    assert base != default_policy_dir(warm_config=WarmStartConfig(steps=1))
    assert base != default_policy_dir(policy_config=PolicyConfig(hidden_size=64))
    assert base != default_policy_dir(task_config=TaskConfig(seed=3))


def test_default_warm_start_leaves_room_for_rl():
    """The real default policy: partial skill, recorded accuracy re-measured exactly (builds it if absent)."""
    model, tok, path = load_default_policy(progress=False)
    accuracy = greedy_accuracy(model, tok, make_task())
    assert accuracy == warm_start_report(path)["heldout_accuracy"]
    assert 0.2 < accuracy < 0.7, f"warm start should leave clear room for RL, got {accuracy}"


def test_greedy_accuracy_counts_correct_answers():
    model, tok, _ = load_default_policy(progress=False)
    task = make_task()
    solved = greedy_accuracy(model, tok, task, task.test[:50], batch_size=7)
    assert solved == greedy_accuracy(model, tok, task, task.test[:50], batch_size=50), "batching must not matter"
    assert 0 <= solved <= 1
