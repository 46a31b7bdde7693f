"""The task interface (issue 19): the math verifier, reward specs and weights, dataset files, chat prompts, Task."""

import json
import os
import random
import string
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from minirl.runtime.data_files import load_rows, render_prompts
from minirl.runtime.math_answer import final_answer, math_format_reward, math_reward, parse_number, reference_answer
from minirl.runtime.task_files import load_task
from minirl.runtime.validate import ConfigError
from minirl.tasks.arithmetic import accuracy_reward, arithmetic_reward, format_reward, make_task
from minirl.tasks.rewards import (
    REWARDS,
    as_conversational,
    check_reward_columns,
    combine_rewards,
    frac_reward_zero_std,
    resolve_rewards,
)
from minirl.tasks.task import Task, arithmetic_task
from minirl.tasks.word_problems import generate

GSM8K = "Ava buys 3 * 4 = <<3*4=12>>12 pencils.\nShe has 50 + 12 = <<50+12=62>>62 pencils now.\n#### 62"


# --- the math verifier -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("62", 62), (" 62 ", 62), ("+62", 62), ("-5", -5), ("1,234", 1234), ("$1,234.50", Fraction(2469, 2)),
    ("62.", 62), ("62.0", 62), ("0.1", Fraction(1, 10)), (".5", Fraction(1, 2)), ("$ 5", 5), ("-$5", -5),
    ("$-5", -5), ("\\$7", 7), ("1,234,567", 1234567),
])
def test_parse_number_reads_the_ways_of_writing_one_value(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", " ", "6 2", "1,23", "12,3456", "62 apples", "٣", "²", "+-5", "--5", "1e5",
                                  "62..", "five", "1" * 65, None, 62, b"62", ["62"]])
def test_parse_number_refuses_everything_else(text):
    assert parse_number(text) is None


@pytest.mark.parametrize("completion, value", [
    ("so 31 + 31 = 62.\n#### 62", 62), ("#### 62 apples", 62), ("####62.", 62), ("#### 1,234", 1234),
    ("#### $5 per hour", 5), ("#### 62\n\nQuestion: next", 62), ("#### 5\n#### 7", 7),
    ("The answer is \\boxed{62}.", 62), ("\\boxed{1{,}234}", 1234), ("\\boxed{\\$5}", 5),
    ("\\boxed{5} then #### 7", 7), ("#### 7 then \\boxed{5}", 5), ("\\boxed{\\text{{x}}} \\boxed{9}", 9),
    (" 62", 62), ("62.0", 62), ([{"role": "assistant", "content": "#### 3"}], 3),
])
def test_final_answer(completion, value):
    assert final_answer(completion) == value


@pytest.mark.parametrize("completion", ["#### ", "#### x 62", "#### 1,23", "\\boxed{}", "\\boxed{6",
                                        "I think 61, no, 62", "62 apples", "", None, 7, [{}], "#### " + "9" * 80])
def test_final_answer_is_none_without_one_final_number(completion):
    assert final_answer(completion) is None


def test_natural_answers_score_with_math_but_not_with_the_embedded_reward():
    """The issue's symptom: a real model's "62" and " 62" score 0 on the reversed-digit task."""
    natural = ["62", " 62", "#### 62", "... so \\boxed{62}"]
    assert accuracy_reward(None, natural, answer=[62] * 4) == [0.0] * 4
    assert math_reward(None, natural, answer=[GSM8K] * 4) == [1.0] * 4
    assert math_reward(None, natural, answer=[62.0, 62, "62", "\\boxed{62}"]) == [1.0] * 4
    assert math_reward(None, ["#### 61", "#### 62.5", "62 apples"], answer=[62] * 3) == [0.0] * 3


def test_decorated_numbers_equal_their_value():
    """Any integer, decorated as people write it (commas, $, +, .0, a period, spaces), reads back as itself."""
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(-10**9, 10**9)
        digits = f"{abs(n):,}" if rng.random() < 0.5 else str(abs(n))
        digits += ".0" if rng.random() < 0.3 else ""
        sign = "-" if n < 0 else rng.choice(["", "+"])
        text = f"{sign}{rng.choice(['', '$'])}{digits}{rng.choice(['', '.'])}"
        before, after = rng.choice(["", " ", "  "]), rng.choice(["", " ", "\n"])
        completion = f"work...\n####{before}{text}{after}"
        assert final_answer(completion) == n, completion
        assert math_reward(None, [completion, completion], answer=[f"x\n#### {n}", n + 1]) == [1.0, 0.0]
        assert math_format_reward(None, [completion]) == [1.0], completion


def test_math_rewards_never_raise_on_any_string():
    rng = random.Random(0)
    alphabet = string.printable + "٣²−\u0000{}\\$#"
    pieces = ["####", "\\boxed{", "}", "{,}", ",", ".", "$", "-", "+", " ", "\n"]
    texts = ["".join(rng.choice(alphabet) if rng.random() < 0.6 else rng.choice(pieces)
                     for _ in range(rng.randint(0, 20))) for _ in range(3000)]
    texts += ["#### " + "9" * 5000, "\\boxed{" + "9" * 5000 + "}", "9" * 5000, "{" * 3000 + "\\boxed{"]
    rewards = math_reward(None, texts, answer=[62] * len(texts))
    assert len(rewards) == len(texts) and set(rewards) <= {0.0, 1.0}
    assert set(math_format_reward(None, texts)) <= {0.0, 1.0}
    odd = [None, 3, b"#### 1", {"content": "#### 1"}, [{}], [{"content": None}]]
    assert math_reward(None, odd, answer=[1] * len(odd)) == [0.0] * len(odd)
    assert math_format_reward(None, odd) == [0.0] * len(odd)


def test_math_format_reward_pays_for_a_marked_final_answer_only():
    assert math_format_reward(None, ["#### 62", "#### 61.", "x \\boxed{62}$.", "#### 62\nQ: more", "\\boxed{62} so",
                                     "62", "#### ", "\\boxed{x}"]) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_a_reference_answer_without_a_number_is_an_error():
    assert reference_answer(GSM8K) == 62 and reference_answer(0.1) == Fraction(1, 10)
    assert reference_answer(True) is None and reference_answer(float("nan")) is None
    with pytest.raises(ValueError, match="states no number"):
        math_reward(None, ["#### 1"], answer=["no number here"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        math_reward(None, ["1", "2"], answer=[1])


# --- reward specs, weights, and the step's bookkeeping -------------------------------------------------------------

def test_specs_resolve_to_functions(tmp_path):
    (tmp_path / "mine.py").write_text("def brevity(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    funcs, weights = resolve_rewards(["arithmetic", "math", "format", "minirl.tasks.arithmetic:format_reward",
                                      f"{tmp_path / 'mine.py'}:brevity"], [1, 0.5, 0.25, 2, -1])
    assert funcs[:4] == [arithmetic_reward, math_reward, math_format_reward, format_reward]
    assert funcs[4].__name__ == "brevity" and funcs[4](None, ["a", "b"]) == [1.0, 1.0]
    assert weights == [1.0, 0.5, 0.25, 2.0, -1.0]
    assert resolve_rewards(["math"])[1] == [1.0]
    assert arithmetic_reward(None, ["26", "62"], answer=[62, 62]) == [1.0, 0.0], "reversed digits"


@pytest.mark.parametrize("specs, weights, param, match", [
    (["mathh"], None, "reward", "not a built-in reward .did you mean 'math'"),
    (["nosuch_module_xyz:f"], None, "reward", "module 'nosuch_module_xyz' does not import .ModuleNotFoundError"),
    (["minirl.tasks.arithmetic:nope"], None, "reward", "has no 'nope'; its functions: accuracy_reward, arithmetic"),
    (["minirl.tasks.arithmetic:MAX_DIGITS"], None, "reward", "is a int, not a function"),
    (["math", "format"], [1.0], "reward_weights", "1 weight for 2 rewards .math, format.; give one weight per"),
    (["math"], [float("nan")], "reward_weights", "not a finite number"),
    (["math", "math"], None, "reward", "two reward functions named 'math_reward'"),
    ([], None, "reward", "one or more rewards"),
    (["math:"], None, "reward", "not a built-in reward"),
])
def test_bad_reward_specs_name_the_parameter_and_the_fix(specs, weights, param, match):
    with pytest.raises(ConfigError, match=match) as err:
        resolve_rewards(specs, weights)
    assert err.value.name == param


def test_a_reward_file_that_does_not_import_is_named_with_its_error(tmp_path):
    (tmp_path / "broken.py").write_text("import nonexistent_package_xyz\n")
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(ConfigError, match="does not import .ModuleNotFoundError: No module named 'nonexistent_pa"):
        resolve_rewards([f"{tmp_path / 'broken.py'}:f"])
    with pytest.raises(ConfigError, match="does not import .SystemExit"):
        resolve_rewards([f"{tmp_path / 'exits.py'}:f"])
    with pytest.raises(ConfigError, match="no such file"):
        resolve_rewards([f"{tmp_path / 'absent.py'}:f"])


def test_reward_columns_are_checked_before_anything_runs():
    def needs_solution(prompts, completions, solution, **kwargs):
        return [0.0] * len(completions)

    def strict(prompts, completions, answer):
        return [0.0] * len(completions)

    rows = [{"prompt": "p", "answer": 1, "level": 3}]
    with pytest.raises(ConfigError, match="needs the column 'solution', but the rows have answer, level"):
        check_reward_columns([needs_solution], rows)
    with pytest.raises(ConfigError, match="does not take the column 'level': add \\*\\*kwargs"):
        check_reward_columns([strict], rows)
    check_reward_columns([math_reward, strict], [{"prompt": "p", "answer": 1}])


def test_conversational_rewards_see_messages_under_their_own_name():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [1.0] * len(completions)

    messages = [{"role": "user", "content": "2+2?"}]
    wrapped = as_conversational(spy, {"<user>2+2?<assistant>": messages})
    assert wrapped.__name__ == "spy"
    assert wrapped(prompts=["<user>2+2?<assistant>", "other"], completions=["4", "5"], answer=[4, 4]) == [1.0, 1.0]
    assert seen["prompts"] == [messages, "other"]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["columns"] == {"answer": [4, 4]}


def test_combine_rewards_is_trls_weighted_sum():
    torch.manual_seed(0)
    per_func = torch.rand(12, 3)                                                    # [N, F]
    weights = [1.0, 0.5, -2.0]
    total, metrics = combine_rewards(per_func, weights, ["a", "b", "c"])
    trl_total = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)      # GRPOTrainer's expression
    assert torch.allclose(total, trl_total)
    assert metrics == {f"rewards/{n}": pytest.approx(per_func[:, i].mean().item()) for i, n in enumerate("abc")}
    with pytest.raises(ValueError, match="must be \\[N, F\\]"):
        combine_rewards(per_func, [1.0, 1.0], ["a", "b"])


def test_frac_reward_zero_std_matches_trl():
    from trl.trainer.utils import nanstd

    rng = torch.Generator().manual_seed(0)
    for G in (2, 4, 8):
        rewards = (torch.rand(16 * G, generator=rng) < 0.3).float() * torch.randint(1, 3, (16 * G,), generator=rng)
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)              # as GRPOTrainer computes it
        expected = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
        assert frac_reward_zero_std(rewards, G) == pytest.approx(expected)
    assert frac_reward_zero_std(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
    assert frac_reward_zero_std(torch.tensor([1.0, 0.0]), 1) == 1.0
    with pytest.raises(ValueError, match="num_generations=3"):
        frac_reward_zero_std(torch.zeros(4), 3)


# --- dataset files -------------------------------------------------------------------------------------------------

ROWS = [{"prompt": "Question: 2+2?\nAnswer:", "answer": "2 + 2 = 4\n#### 4"},
        {"prompt": "Question: 3*3?\nAnswer:", "answer": "3 * 3 = 9\n#### 9"}]


def write_formats(tmp_path, rows):
    import datasets
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dict"))
    return ["d.jsonl", "d.json", "d.csv", "d.parquet", "disk", "dict"]


def test_every_format_loads_the_same_rows(tmp_path):
    for name in write_formats(tmp_path, ROWS):
        assert load_rows(tmp_path / name) == ROWS, name
    assert load_rows(tmp_path / "dict", "eval_dataset") == ROWS[:1], "a DatasetDict's test split for evaluation"


@pytest.mark.parametrize("content, name, match", [
    (None, "absent.jsonl", "no such file or directory; give a JSONL, JSON, CSV or Parquet file"),
    ("x", "d.txt", "unsupported file type '.txt'"),
    ("", "d.jsonl", "is empty .0 rows."),
    ("\n\n", "d.jsonl", "is empty .0 rows."),
    ('{"question": "q", "answer": "#### 1"}\n', "d.jsonl",
     "has no 'prompt' column .its columns: question, answer.*is it 'question'"),
    ('{"prompt": 3, "answer": 1}\n', "d.jsonl", "row 0's prompt 3 is neither a non-empty string nor a list"),
    ('{"prompt": ""}\n', "d.jsonl", "row 0's prompt '' is neither"),
    ("{not json\n", "d.jsonl", "could not be read as JSON lines .ArrowInvalid: JSON parse error"),
    ('a,b\n1,"2\n', "d.csv", "could not be read as CSV"),
    ("x", "plain_dir", "not written by save_to_disk"),
])
def test_bad_dataset_files_are_one_line_errors(tmp_path, content, name, match):
    path = tmp_path / name
    if name == "plain_dir":
        path.mkdir()
        (path / "rows.jsonl").write_text(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        load_rows(path, "eval_dataset")
    assert err.value.name == "eval_dataset" and "\n" not in str(err.value)


def test_a_datasetdict_without_the_split_is_named(tmp_path):
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", "eval_dataset") == ROWS
    with pytest.raises(ConfigError, match="splits validation but none of train"):
        load_rows(tmp_path / "dd", "dataset")


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    from tiny_bpe import build_bpe_tokenizer

    chat, plain = build_bpe_tokenizer(chat_template=True), build_bpe_tokenizer(chat_template=False)
    rows = generate(n_train=3, n_test=1, chat=True)["train"]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows(tmp_path / "chat.jsonl")
    rendered, lookup = render_prompts(loaded, chat)
    expected = chat.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert rendered[0]["prompt"] == expected and expected.endswith("<|im_start|>assistant\n")
    assert rendered[0]["answer"] == rows[0]["answer"] and lookup[expected] == rows[0]["prompt"]
    assert render_prompts(ROWS, plain) == (ROWS, {}), "text prompts pass unchanged, no tokenizer needed"
    for tokenizer in (plain, None):
        with pytest.raises(ConfigError, match="chat messages, but the model's tokenizer has no chat template"):
            render_prompts(loaded, tokenizer)


# --- the Task --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warm():
    from minirl.models.policy import load_default_policy

    model, tokenizer, _ = load_default_policy(progress=False)
    return model, tokenizer


def test_the_embedded_task_evaluates_exactly_as_greedy_accuracy(warm):
    from minirl.models.policy import greedy_accuracy

    model, tokenizer = warm
    task, embedded = arithmetic_task(), make_task()
    result = task.evaluate(model, tokenizer)
    assert result["accuracy"] == greedy_accuracy(model, tokenizer, embedded), "bit for bit"
    assert 0.3 < result["accuracy"] < 0.7 and result["reward"] == result["accuracy"]
    assert task.eval_fn(tokenizer)(model) == result["accuracy"]
    small = Task("subset", task.train, task.test[:50], task.reward_funcs, accuracy_reward=task.accuracy_reward,
                 max_new_tokens=task.max_new_tokens)
    assert small.evaluate(model, tokenizer, batch_size=7)["accuracy"] == \
        greedy_accuracy(model, tokenizer, embedded, embedded.test[:50], batch_size=7)
    assert [r["prompt"] for r in task.train] == [r["prompt"] for r in embedded.rows("train")]


def test_load_task_without_a_dataset_is_the_embedded_task():
    default, embedded = load_task(), arithmetic_task()
    assert default.train == embedded.train and default.test == embedded.test
    assert default.reward_funcs == [arithmetic_reward] == embedded.reward_funcs and default.reward_weights == [1.0]
    assert default.accuracy_reward == "arithmetic_reward" and default.max_new_tokens == 4
    assert REWARDS["arithmetic"] is arithmetic_reward


def test_load_task_from_files_with_weighted_rewards(tmp_path):
    splits = generate(n_train=20, n_test=5)
    for split, rows in splits.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(tmp_path / "train.jsonl", tmp_path / "test.jsonl", ["math", "format"], [1.0, 0.5])
    assert task.name.endswith("/train.jsonl") and len(task.train) == 20 and len(task.test) == 5
    assert task.reward_names == ["math_reward", "math_format_reward"] and task.reward_weights == [1.0, 0.5]
    assert task.accuracy_reward == "math_reward" and task.max_new_tokens is None
    answers = [r["answer"].split("\n")[-1] for r in task.train[:3]]                   # "#### N": right and marked
    total, metrics = task.score(task.train[:3], [answers[0], answers[0] + " so", "no idea"])
    assert total.tolist() == [1.5, 1.0 if answers[0] == answers[1] else 0.0, 0.0]
    assert metrics["rewards/math_format_reward"] == pytest.approx(1 / 3)
    only_format = load_task(tmp_path / "train.jsonl", tmp_path / "test.jsonl", ["format"])
    assert only_format.accuracy_reward is None, "no correctness reward: a run reports the mean weighted reward"
    assert load_task(tmp_path / "train.jsonl", rewards=["math"]).eval_fn(None) is None, "no eval rows, no evaluation"


def test_load_task_errors_name_the_setting(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "p", "answer": "no number"}) + "\n")
    with pytest.raises(ConfigError, match="needs at least one reward") as err:
        load_task(tmp_path / "t.jsonl")
    assert err.value.name == "reward"
    with pytest.raises(ConfigError, match="row 0's answer 'no number' states no number") as err:
        load_task(tmp_path / "t.jsonl", rewards=["math"])
    assert err.value.name == "dataset"
    load_task(tmp_path / "t.jsonl", rewards=["format"])                              # format needs no answer
    with pytest.raises(ConfigError, match="1 weight for 2 rewards"):
        load_task(rewards=["math", "format"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="is empty"):
        load_task([], rewards=["math"])


def test_conversational_task_rewards_receive_messages_and_columns(tmp_path):
    from tiny_bpe import build_bpe_tokenizer

    seen = []

    def spy(prompts, completions, answer, **columns):
        seen.append((prompts, completions, answer))
        return [0.5] * len(completions)

    rows = generate(n_train=4, n_test=2, chat=True)
    task = load_task(rows["train"], rows["test"], ["math"], tokenizer=build_bpe_tokenizer())
    lookup = {r["prompt"]: m["prompt"] for r, m in zip(task.train, rows["train"], strict=True)}
    task.reward_funcs.append(as_conversational(spy, lookup))
    task.reward_weights.append(2.0)
    total, metrics = task.score(task.train[:2], ["#### 1", "x"])
    prompts, completions, answer = seen[0]
    assert prompts == [r["prompt"] for r in rows["train"][:2]], "the messages, not the rendered text"
    assert completions == [[{"role": "assistant", "content": "#### 1"}], [{"role": "assistant", "content": "x"}]]
    assert answer == [r["answer"] for r in rows["train"][:2]]
    assert metrics["rewards/spy"] == 0.5 and total.tolist()[1] == 1.0, "2.0 * 0.5"
    assert all(isinstance(r["prompt"], str) and r["prompt"].endswith("assistant\n") for r in task.train + task.test)


# Datasets by id and renamed columns (issue 31 item 5).

def test_a_dataset_id_goes_through_load_dataset_with_its_config_and_split(monkeypatch):
    import datasets

    from minirl.runtime.data_files import is_dataset_id, load_rows

    asked = []

    def fake_load_dataset(name, config=None, **kwargs):
        asked.append((name, config))
        rows = [{"question": "1+1=", "answer": "2"}]
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                     "test": datasets.Dataset.from_list(rows * 2)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert is_dataset_id("openai/gsm8k:main") and is_dataset_id("gsm8k")
    assert not is_dataset_id("data/train.jsonl") and not is_dataset_id("/no/such/dir")
    rows = load_rows("openai/gsm8k:main", "dataset", {"question": "prompt"})
    assert asked == [("openai/gsm8k", "main")] and rows == [{"prompt": "1+1=", "answer": "2"}]
    assert len(load_rows("openai/gsm8k", "eval_dataset", {"question": "prompt"})) == 2, "eval takes the test split"


def test_an_unreachable_dataset_id_is_one_line(tmp_path, monkeypatch):
    """Offline (as here), `--dataset org/name` stops in one line that says the id could not be reached."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    chapter = Path(__file__).resolve().parents[1] / "chapters" / "01_single_process.py"
    proc = subprocess.run([sys.executable, str(chapter), "--out", str(tmp_path / "run"), "--dataset",
                           "minirl-nobody/no-such-set:main", "--reward", "math"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("01_single_process.py: error: argument --dataset: minirl-nobody/no-such-set:main: "
                           "the dataset id 'minirl-nobody/no-such-set' could not be reached (HF_HUB_OFFLINE is set)")


def test_dataset_columns_rename_before_the_rows_are_checked(tmp_path):
    from minirl.runtime.data_files import load_rows
    from minirl.runtime.validate import ConfigError

    path = tmp_path / "qa.jsonl"
    path.write_text('{"question": "What is 2+3?", "solution": "5"}\n')
    with pytest.raises(ConfigError, match="no 'prompt' column"):
        load_rows(path)
    assert load_rows(path, columns={"question": "prompt", "solution": "answer"}) == [
        {"prompt": "What is 2+3?", "answer": "5"}]
    with pytest.raises(ConfigError, match=r"has no column 'query' \(its columns: question, solution\)"):
        load_rows(path, columns={"query": "prompt"})


def test_chapter_01_renames_columns_with_dataset_columns(tmp_path, monkeypatch):
    import importlib.util

    path = tmp_path / "qa.jsonl"
    path.write_text('{"question": "What is 2+3? Answer with \\\\boxed{}.", "solution": "5"}\n')
    spec = importlib.util.spec_from_file_location("chapter01", Path(__file__).resolve().parents[1] / "chapters"
                                                  / "01_single_process.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    args, _, task, settings = chapter.parse_args(["--out", str(tmp_path / "run"), "--dataset", str(path),
                                                  "--dataset-columns", "question=prompt", "solution=answer",
                                                  "--reward", "math"])
    assert task.train[0]["prompt"].startswith("What is 2+3?") and task.train[0]["answer"] == "5"
    assert settings["dataset_columns"] == [["question", "prompt"], ["solution", "answer"]]


# Rewards as TRL calls them (issue 31 item 4): module.function, TRL's extra arguments, None, async, bad output.

def test_a_reward_spec_may_be_module_dot_function(tmp_path, monkeypatch):
    from minirl.tasks.rewards import resolve_reward

    (tmp_path / "my_rewards.py").write_text("def length_penalty(prompts, completions, **kw):\n"
                                            "    return [-len(c) / 10 for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    dotted, coloned = resolve_reward("my_rewards.length_penalty"), resolve_reward("my_rewards:length_penalty")
    assert dotted is coloned and dotted(["p"], ["abcd"]) == [-0.4]
    with pytest.raises(ConfigError, match="has no 'nope'"):
        resolve_reward("my_rewards.nope")


def test_call_reward_passes_trls_extras_awaits_async_and_keeps_none():
    import asyncio

    from minirl.tasks.rewards import call_reward

    seen, logged = {}, []

    def trl_style(prompts, completions, completion_ids, trainer_state, log_metric, answer, **kwargs):
        seen.update(ids=completion_ids, step=trainer_state.global_step)
        log_metric("my/len", sum(map(len, completions)))
        return [1.0 if c == a else None if a is None else 0.0 for c, a in zip(completions, answer, strict=True)]

    def plain(prompts, completions, answer):              # takes no extras: none are forced on it
        return [0.5] * len(completions)

    async def slow(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [2] * len(completions)

    from types import SimpleNamespace
    args = (["p1", "p2", "p3"], ["5", "6", "7"], {"answer": ["5", "7", None]})
    extras = dict(completion_ids=[[1], [2], [3]], trainer_state=SimpleNamespace(global_step=4),
                  log_metric=lambda n, v: logged.append((n, v)))
    assert call_reward(trl_style, *args, **extras) == [1.0, 0.0, None]
    assert seen == {"ids": [[1], [2], [3]], "step": 4} and logged == [("my/len", 3)]
    assert call_reward(plain, *args, **extras) == [0.5, 0.5, 0.5]
    assert call_reward(slow, *args, **extras) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("output, message", [
    (None, "reward function bad returned NoneType, not a list of 2 rewards"),
    ("1.0", "reward function bad returned str, not a list of 2 rewards"),
    ([1.0], "reward function bad returned 1 rewards for 2 completions"),
    ([1.0, float("inf")], "reward function bad returned inf for row 1 (prompt 'q2')"),
    ([1.0, "yes"], "reward function bad returned 'yes' for row 1 (prompt 'q2')"),
])
def test_a_bad_reward_output_names_the_function_and_the_row(output, message):
    from minirl.tasks.rewards import RewardError, call_reward

    def bad(prompts, completions, **kwargs):
        return output

    with pytest.raises(RewardError) as err:
        call_reward(bad, ["q1", "q2"], ["a", "b"], {})
    assert str(err.value).startswith(message)


def test_none_is_left_out_of_the_sum_and_the_mean():
    from minirl.tasks.rewards import combine_rewards

    per_func = torch.tensor([[1.0, float("nan")], [0.0, 0.5]])
    total, metrics = combine_rewards(per_func, [1.0, 2.0], ["a", "b"])
    assert total.tolist() == [1.0, 1.0] and metrics == {"rewards/a": 0.5, "rewards/b": 0.5}


BAD_REWARDS = '''
def strings(prompts, completions, **kwargs):
    return ["good"] * len(completions)

def raises(prompts, completions, **kwargs):
    raise KeyError("no answer")
'''


@pytest.mark.parametrize("name, said", [      # every kind of output: test_a_bad_reward_output_names_...
    ("strings", "reward function strings returned 'good' for row 0 (prompt"),
    ("raises", "reward function raises raised KeyError: 'no answer' on row 0 (prompt"),
])
def test_a_bad_reward_function_stops_chapter_01_with_one_line(name, said, tmp_path):
    """Issue 34 item 6: every kind of bad output stops the run with one line naming the reward and the row."""
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    chapter = Path(__file__).resolve().parents[1] / "chapters" / "01_single_process.py"
    proc = subprocess.run([sys.executable, str(chapter), "--out", str(tmp_path / "run"), "--steps", "2",
                           "--prompts-per-step", "8", "--eval-every", "0", "--reward", f"bad_rewards:{name}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {said}"), last
