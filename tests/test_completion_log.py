"""Issue 31 items 2 and 3: defaults that fit the data (TRL's with --dataset, recorded in summary.json), what the
model wrote (completions.jsonl, a printed table, each reward's held-out mean) and the no-signal warning that names
truncation first."""

import asyncio
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirl.runtime.callbacks import no_signal_message
from minirl.runtime.completion_log import SampleTap, clipped_flags, pick, table
from minirl.runtime.trl_config import TRL_DEFAULTS, translate
from minirl.tasks.rewards import call_reward

REPO = Path(__file__).resolve().parent.parent
ROW_KEYS = {"step", "phase", "prompt", "completion", "rewards", "total"}


def load_chapter(name: str):
    spec = importlib.util.spec_from_file_location(f"chapter_{name}", REPO / "chapters" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Word problems in chat form and a tiny Qwen2 with a BPE tokenizer (context 512), and a copy with 4096."""
    from tiny_bpe import save_tiny_bpe_model

    from minirl.tasks.word_problems import write

    root = tmp_path_factory.mktemp("words")
    write(root / "chat", n_train=20, n_test=4, chat=True)
    model = save_tiny_bpe_model(root / "model")
    long = save_tiny_bpe_model(root / "long")
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return {"root": root, "train": root / "chat" / "train.jsonl", "test": root / "chat" / "test.jsonl",
            "model": model, "long": long}


def test_trl_defaults_are_trl_1_16s():
    trl = pytest.importorskip("trl")
    fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {k: fields[k] for k in TRL_DEFAULTS} == TRL_DEFAULTS


def test_a_dataset_takes_trl_defaults_where_nothing_was_set(tmp_path, words, capsys):
    chapter = load_chapter("01_single_process")
    task = ["--out", str(tmp_path / "run"), "--dataset", str(words["train"]), "--reward", "math"]
    args, config, _, settings = chapter.parse_args([*task, "--model", str(words["long"])])
    assert args.defaults == "trl"
    assert (config.sampling.max_completion_length, config.optimizer.learning_rate, config.run.seed) == (512, 1e-6, 42)
    assert settings["max_completion_length"] == 512 and settings["lr_scheduler_type"] == "linear"
    assert "TRL's defaults where nothing was set" in capsys.readouterr().err

    (tmp_path / "run.yaml").write_text("learning_rate: 1.0e-3\nlr_scheduler_type: cosine\n")
    args, config, _, settings = chapter.parse_args([*task, "--model", str(words["long"]), "--seed", "7",
                                                    "--config", str(tmp_path / "run.yaml")])
    assert (config.run.seed, config.optimizer.learning_rate, settings["lr_scheduler_type"]) == (7, 1e-3, "cosine"), \
        "a typed flag and a --config key win"
    assert config.sampling.max_completion_length == 512

    from minirl.runtime.policy_cache import load_tokenizer

    args, config, rows, settings = chapter.parse_args([*task, "--model", str(words["model"])])
    longest = max(len(ids) for ids in load_tokenizer(words["model"])([r["prompt"] for r in rows.train],
                                                                      add_special_tokens=False)["input_ids"])
    assert config.sampling.max_completion_length == 512 - longest < 512, "TRL's 512 cut to what the context leaves"
    assert "what --model's context leaves after the longest prompt" in capsys.readouterr().err

    args, config, _, settings = chapter.parse_args(["--out", str(tmp_path / "embedded")])
    assert args.defaults == "embedded" and settings["lr_scheduler_type"] == "constant"
    assert (config.sampling.max_completion_length, config.optimizer.learning_rate, config.run.seed) == (4, 3e-4, 0)


def test_chapter_01_on_a_user_dataset_logs_what_the_model_wrote(tmp_path, words):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "01_single_process.py"), "--out", str(out),
                           "--model", str(words["model"]), "--dataset", str(words["train"]), "--eval-dataset",
                           str(words["test"]), "--reward", "math", "--reward", "format", "--steps", "2",
                           "--eval-every", "2", "--prompts-per-step", "2", "--num-generations", "2",
                           "--max-completion-length", "6", "--threads", "1", "--no-progress"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["defaults"] == "trl" and summary["settings"]["learning_rate"] == 1e-6
    assert summary["settings"]["max_completion_length"] == 6 and summary["settings"]["seed"] == 42
    names = ["math_reward", "math_format_reward"]
    assert all(f"eval/rewards/{n}/mean" in summary for n in names), sorted(summary)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert all(set(r) == ROW_KEYS and sorted(r["rewards"]) == sorted(names) for r in rows), rows[0]
    assert [(r["step"], r["phase"]) for r in rows] == [(0, "eval")] * 4 + [(1, "train")] * 4 + [(2, "train")] * 4 \
        + [(2, "eval")] * 4, "4 rows (--log-completions' default) of the first steps and of every evaluation"
    assert "step 0, eval: 4 completions (completions.jsonl)" in proc.stdout, "the rows printed as a table too"
    assert all(len(line) <= 100 for line in proc.stdout.splitlines() if "|" in line)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= m["completions/clipped_ratio"] <= 1 for m in metrics if "reward" in m)
    assert "eval/rewards/math_format_reward/mean" in metrics[0]


def test_the_no_signal_warning_names_truncation_first():
    cut = [{"reward": 0.0, "rewards/math_reward": 0.0, "completion_length_max": 4, "completions/clipped_ratio": 1.0,
            "frac_reward_zero_std": 1.0}] * 3
    message = no_signal_message(cut, max_completion_length=4)
    assert "Completions are cut at max_completion_length=4 (100 % hit the cap): raise --max-completion-length" in \
        message, message
    assert message.index("cut at") < message.index("every completion scored 0") < message.index("format"), \
        "truncation named before the format and the warm start"
    whole = [r | {"completions/clipped_ratio": 0.25} for r in cut]
    assert "cut at" not in no_signal_message(whole, 4) and "match the reward's format" in no_signal_message(whole, 4)
    older = [{k: v for k, v in r.items() if k != "completions/clipped_ratio"} for r in cut]
    assert "(the longest hit the cap)" in no_signal_message(older, 4)
    assert "cut at" not in no_signal_message(older, 8)


def test_clipped_means_the_cap_reached_without_eos():
    from minirl.data import Rollout

    ids = torch.tensor([[5, 6, 7, 2], [5, 2, 0, 0], [5, 6, 7, 8]])        # EOS = 2: ended at the cap, early, cut
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    rollout = Rollout(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long), ids, mask,
                      torch.zeros(3, 4), ["a", "b", "c"], ["p"] * 3, 0)
    assert clipped_flags(rollout, 4, eos=2) == [False, False, True]
    assert clipped_flags(rollout, 4, eos=None) == [True, False, True]


def test_the_tap_keeps_what_rewards_return_and_calls_them_as_trl_does():
    async def judge(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    class Lengths:
        def __call__(self, prompts, completions, completion_ids, **kw):
            return [None if len(ids) > 2 else 1.0 for ids in completion_ids]

    tap = SampleTap()
    wrapped = [tap._wrap(0, judge), tap._wrap(1, Lengths())]
    assert [f.__name__ for f in wrapped] == ["judge", "Lengths"]
    tap.capturing = True
    values = [call_reward(f, ["p", "p"], ["ab", "abc"], {}, completion_ids=[[1, 2], [1, 2, 3]]) for f in wrapped]
    assert values == [[2.0, 3.0], [1.0, None]], "async awaited, completion_ids passed, None kept"
    state = type("S", (), {"reward_weights": [1.0, 0.5]})()
    tap._funcs = [judge, Lengths()]
    rows = tap.rows(state)
    assert [r["rewards"] for r in rows] == [{"judge": 2.0, "Lengths": 1.0}, {"judge": 3.0, "Lengths": None}]
    assert [r["total"] for r in rows] == [2.5, 3.0] and rows[1]["completion"] == "abc"


def test_rows_show_distinct_prompts_first_and_the_table_fits_100_columns():
    rows = [{"prompt": f"p{i // 2}", "completion": "c" * 500 + "\n", "rewards": {"a_long_reward_name": 1.0, "b": None},
             "total": 12345.678} for i in range(8)]
    assert [r["prompt"] for r in pick(rows, 4, 2)] == ["p0", "p1", "p2", "p3"]
    text = table(rows, "step 1, train")
    assert all(len(line) <= 100 for line in text.splitlines()) and "12346" in text and "      -" in text


def test_trl_log_completions_in_a_config_file():
    settings = {"log_completions", "steps"}
    assert translate({"log_completions": True}, settings)[0] == {"log_completions": 4}
    assert translate({"log_completions": True, "num_completions_to_print": 2}, settings)[0] == {"log_completions": 2}
    assert translate({"log_completions": False}, settings)[0] == {"log_completions": 0}


def test_chapter_07_logs_trajectories_and_each_snapshots_rewards(tmp_path, words, capsys):
    chapter = load_chapter("07_async")
    out = tmp_path / "run"
    code = chapter.main(["--model", str(words["model"]), "--out", str(out), "--dataset", str(words["train"]),
                         "--eval-dataset", str(words["test"]), "--reward", "math", "--steps", "2",
                         "--snapshot-every", "2", "--producers", "1", "--prompts-per-call", "2",
                         "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "6",
                         "--log-completions", "2"])
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert [(r["step"], r["phase"]) for r in rows if r["phase"] == "train"] == [(1, "train")] * 2 + [(2, "train")] * 2
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 0, 2, 2]
    assert all(set(r["rewards"]) == {"math_reward"} for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["defaults"] == "trl" and "eval/rewards/math_reward/mean" in summary["accuracy_curve"][-1]
