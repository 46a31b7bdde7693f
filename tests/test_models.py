"""The embedded policy: tokenizer, model, warm start determinism, offline loading, the cache, load_policy."""

import json
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minirl.models.policy as policy_module
from minirl.models.policy import (
    PolicyConfig,
    WarmStartConfig,
    build_policy,
    build_tokenizer,
    default_policy_dir,
    greedy_accuracy,
    load_default_policy,
    warm_start,
)
from minirl.runtime.model_loading import ModelSourceError, PromptError, check_prompts, load_policy
from minirl.runtime.policy_cache import PolicyCacheError, build_default_policy, warm_start_report
from minirl.tasks.arithmetic import TaskConfig, make_task

SMALL_TASK = TaskConfig(max_operand=19, num_test=40, num_validation=40)
SMALL_POLICY = PolicyConfig(hidden_size=32, num_layers=2)
SHORT = WarmStartConfig(steps=12, batch_size=16)


def test_tokenizer_round_trip_and_left_padding():
    tok = build_tokenizer()
    texts = ["27+35=", "4+5=", "0-9*8= "]
    enc = tok(texts, padding=True, add_special_tokens=False)
    assert tok.batch_decode(enc["input_ids"], skip_special_tokens=True) == texts
    assert enc["input_ids"][1][:2] == [tok.pad_token_id] * 2, "prompts are padded on the left"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert all(len(tok(c, add_special_tokens=False)["input_ids"]) == 1 for c in "0123456789+-*= ")


def test_unknown_characters_are_kept_as_unk_and_vocabularies_agree(tmp_path):
    """"ab+c=" encoded as "+=" (dropped), and the reloaded tokenizer had 19 ids for 18 embeddings (item 13)."""
    tok = build_tokenizer()
    ids = tok("ab+c=", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<unk>", "<unk>", "+", "<unk>", "="]
    model = build_policy(SMALL_POLICY, tok)
    tok.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == len(reloaded) == model.config.vocab_size == 19
    assert reloaded.unk_token == "<unk>" and reloaded.all_special_tokens.count("<|endoftext|>") == 0
    with torch.no_grad():                                  # any text, even a special-token string, fits the model
        model(**reloaded(["<|endoftext|>1+1=", "héllo"], return_tensors="pt", padding=True))


def test_check_prompts_refuses_what_would_fail_later():
    tok = build_tokenizer()
    check_prompts(tok, ["27+35=", "4+5="], context=32, max_new_tokens=4)
    cases = [([], r"prompts=\[\]: give a non-empty list"), ("1+1=", r"prompts='1\+1=': give a non-empty list"),
             (["1+1=", ""], r"prompt 1 \(''\) is empty"),
             (["ab+c="], r"prompt 0 \('ab\+c='\) has characters the tokenizer does not know: \['a', 'b', 'c'\]"),
             (["1" * 102], r"is 102 tokens; with max_new_tokens=4 it needs 106 positions, but the model's "
                           r"context is 32"),
             (["1" * 28 + "+1="], r"is 31 tokens")]
    for prompts, match in cases:
        with pytest.raises(PromptError, match=match):
            check_prompts(tok, prompts, context=32, max_new_tokens=4)
    check_prompts(tok, ["1" * 5002])                           # no context given: length unchecked


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
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert not list(tmp_path.glob("*.tmp-*")), "no temporary directory is left behind"


def test_warm_start_stops_on_validation_and_never_looks_at_held_out(monkeypatch):
    """The warm start's length is tuned on the validation split, not on held-out (issue 9, item 8)."""
    task = make_task(SMALL_TASK)
    tok = build_tokenizer()
    seen, accuracies = [], iter([0.1, 0.3, 0.5, 0.9])

    def fake_accuracy(model, tokenizer, task_, problems=None, batch_size=500):
        seen.append(problems)
        return next(accuracies)

    monkeypatch.setattr(policy_module, "greedy_accuracy", fake_accuracy)
    config = WarmStartConfig(steps=40, eval_every=2, target_accuracy=0.45, batch_size=8)
    out = warm_start(build_policy(SMALL_POLICY, tok), tok, task, config, progress=False)
    assert out["validation"] == [[2, 0.1], [4, 0.3], [6, 0.5]] and len(out["losses"]) == 6
    assert all(problems is task.validation for problems in seen)
    out = warm_start(build_policy(SMALL_POLICY, tok), tok, task, WarmStartConfig(steps=5, target_accuracy=None,
                                                                                batch_size=8), progress=False)
    assert out["validation"] == [] and len(out["losses"]) == 5


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
    report = warm_start_report(path)
    assert accuracy == report["heldout_accuracy"]
    assert 0.3 < accuracy < 0.7, f"warm start should leave clear room for RL, got {accuracy}"
    assert report["validation_accuracy"] >= WarmStartConfig().target_accuracy
    assert report["validation"][-1] == [report["steps"], report["validation_accuracy"]]
    assert abs(report["train_accuracy"] - accuracy) < 0.1 and report["train_sample"] == 500


def test_greedy_accuracy_counts_correct_answers():
    model, tok, _ = load_default_policy(progress=False)
    task = make_task()
    solved = greedy_accuracy(model, tok, task, task.test[:50], batch_size=7)
    assert solved == greedy_accuracy(model, tok, task, task.test[:50], batch_size=50), "batching must not matter"
    assert 0 <= solved <= 1


# ---------------------------------------------------------------- the cache (issue 9, item 6)


def no_training(*args, **kwargs):
    raise AssertionError("the warm start trained before the cache was found unwritable")


def test_a_cache_under_a_file_fails_before_training(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(policy_module, "warm_start", no_training)
    with pytest.raises(PolicyCacheError, match=r"cannot write the warm-started policy under .*a-file/cache "
                                                r".*set MINIRL_CACHE to a writable directory"):
        load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)


def test_a_read_only_cache_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))
    monkeypatch.setattr(policy_module, "warm_start", no_training)

    def read_only(*args, **kwargs):                 # what a read-only directory does (root ignores chmod)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(PolicyCacheError, match="Permission denied"):
        load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)


def test_an_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(policy_module, "warm_start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("filename", ["model.safetensors", "tokenizer.json", "warm_start.json"])
def test_a_damaged_cached_file_is_named_with_the_fix(tmp_path, monkeypatch, filename):
    """A truncated model.safetensors gave a bare SafetensorError with no hint."""
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))
    _, _, path = load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
    damaged = path / filename
    damaged.write_bytes(damaged.read_bytes()[:40])
    with pytest.raises(PolicyCacheError, match=rf"damaged: {damaged} cannot be read .*rm -r {path}"):
        _, _, path = load_default_policy(SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
        warm_start_report(path)


# ---------------------------------------------------------------- load_policy (issue 9, item 11)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A small warm-started policy saved as an ordinary HF checkpoint."""
    path = tmp_path_factory.mktemp("cache") / "small"
    build_default_policy(path, SMALL_TASK, SMALL_POLICY, SHORT, progress=False)
    return path


def test_load_policy_from_a_directory(small_dir):
    model, tok = load_policy(str(small_dir))
    assert tok.padding_side == "left" and not model.training
    reference = AutoModelForCausalLM.from_pretrained(small_dir)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    half, _ = load_policy(small_dir, dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_load_policy_pads_with_eos_when_there_is_no_pad_token(small_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(small_dir)
    tok = AutoTokenizer.from_pretrained(small_dir)
    tok.pad_token = None
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, loaded = load_policy(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<eos>"


def test_load_policy_names_what_is_wrong(small_dir, tmp_path, monkeypatch):
    with pytest.raises(ModelSourceError, match="/nonexistent: no such directory, and not a hub id"):
        load_policy("/nonexistent")
    AutoModelForCausalLM.from_pretrained(small_dir).save_pretrained(tmp_path / "weights-only")
    with pytest.raises(ModelSourceError, match=f"no tokenizer files in {tmp_path / 'weights-only'}"):
        load_policy(str(tmp_path / "weights-only"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="no config.json in"):
        load_policy(str(tmp_path / "empty"))
    with pytest.raises(ModelSourceError, match="a file, not a model directory"):
        load_policy(str(small_dir / "config.json"))
    with pytest.raises(ValueError, match="dtype='float33'"):
        load_policy(str(small_dir), dtype="float33")
    tok = AutoTokenizer.from_pretrained(small_dir)
    narrow = build_policy(SMALL_POLICY, tok)
    narrow.resize_token_embeddings(10)
    narrow.save_pretrained(tmp_path / "narrow")
    tok.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ModelSourceError, match="the tokenizer has 19 ids but the model embeds only 10"):
        load_policy(str(tmp_path / "narrow"))


def test_load_policy_offline_hub_id_not_in_the_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSourceError, match=r"hub id 'minirl-tests/no-such-model' is not in the local "
                                               r"Hugging Face cache \(HF_HUB_OFFLINE is set\)"):
        load_policy("minirl-tests/no-such-model")


def test_load_policy_default_is_the_embedded_policy():
    model, tok = load_policy()
    embedded, _, _ = load_default_policy(progress=False)
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), embedded.state_dict().values(), strict=True))
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_policy_on_cuda_answers_like_the_cpu():
    cpu, tok = load_policy()
    gpu, _ = load_policy(device="cuda")
    assert next(gpu.parameters()).is_cuda
    task = make_task()
    problems = task.test[:200]
    assert abs(greedy_accuracy(gpu, tok, task, problems) - greedy_accuracy(cpu, tok, task, problems)) <= 0.02


def test_a_saved_policy_reads_back_the_tokenizer_it_was_built_with(small_dir):
    """AutoTokenizer (transformers 5) rebuilds a qwen2 checkpoint's tokenizer as a byte-level BPE that drops
    spaces and unknown characters; every minirl loader reads tokenizer.json as saved."""
    from minirl.runtime.policy_cache import load_tokenizer

    text, built = "12 + 34 =Q", build_tokenizer()
    want = built(text, add_special_tokens=False)["input_ids"]
    assert built.convert_ids_to_tokens(want)[-1] == "<unk>" and len(want) == len(text)
    _, from_load_policy = load_policy(str(small_dir))
    for tok in (load_tokenizer(small_dir), from_load_policy):
        assert tok(text, add_special_tokens=False)["input_ids"] == want
        with pytest.raises(PromptError, match=r"does not know: \['Q'\]"):
            check_prompts(tok, ["12+Q="])
