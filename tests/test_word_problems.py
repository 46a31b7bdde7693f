"""The shipped word problems: generated from templates and a seed, in GSM8K's format, honestly held out."""

import json
import re
from pathlib import Path

import pytest

from minirl.runtime.math_answer import final_answer, math_format_reward, math_reward
from minirl.tasks import word_problems
from minirl.tasks.word_problems import generate, main, write

DATA = Path(__file__).resolve().parents[1] / "data"
SHIPPED = [DATA / "word_problems", DATA / "word_problems_chat"]


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: p.name)
def test_the_committed_files_are_what_the_generator_writes(tmp_path, shipped):
    meta = json.loads((shipped / "meta.json").read_text())
    assert meta["format_version"] == word_problems.FORMAT_VERSION, "bump the data with the generator"
    write(tmp_path, meta["n_train"], meta["n_test"], meta["seed"], meta["chat"])
    for name in ("train.jsonl", "test.jsonl", "meta.json"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), f"{shipped.name}/{name} is stale"
    assert sum(p.stat().st_size for p in shipped.iterdir()) < 300_000, "keep the shipped copy small"


def test_rows_are_in_gsm8k_format_and_their_arithmetic_is_right():
    rows = generate(n_train=400, n_test=100, seed=3)
    for row in rows["train"] + rows["test"]:
        assert set(row) == {"prompt", "answer"} and row["prompt"].startswith("Question: ")
        assert row["prompt"].endswith("#### <number>\nAnswer:")
        *steps, last = row["answer"].split("\n")
        assert re.fullmatch(r"#### [0-9]+", last), last
        for expr, value in re.findall(r"<<([0-9+\-*/]+)=([0-9]+)>>", row["answer"]):
            assert eval(expr) == int(value), (expr, value)                # noqa: S307 -- digits and + - * / only
        assert len(re.findall("<<", row["answer"])) == len(steps) >= 2
        assert math_reward(None, [row["answer"]], answer=[row["answer"]]) == [1.0]
        assert math_format_reward(None, [last]) == [1.0] and final_answer(last) > 0
    assert len({r["answer"].split("#### ")[1] for r in rows["train"]}) > 100, "answers vary"
    templates = {r["prompt"].split(" ")[2] for r in rows["train"]}
    assert len(templates) > 5


def test_the_same_seed_gives_the_same_rows_and_another_seed_others():
    assert generate(50, 10, seed=0) == generate(50, 10, seed=0)
    assert generate(50, 10, seed=0)["test"] != generate(50, 10, seed=1)["test"]
    small, large = generate(50, 10, seed=0), generate(500, 10, seed=0)
    assert small["test"] == large["test"] and large["train"][:50] == small["train"], "more rows extend the set"


def test_no_held_out_problem_is_in_training(monkeypatch):
    """With one name and one object, a question's text is its template and numbers: none may repeat."""
    monkeypatch.setattr(word_problems, "PEOPLE", ["Ava", "Ben"])
    monkeypatch.setattr(word_problems, "ITEMS", ["pencils"])
    monkeypatch.setattr(word_problems, "GOODS", [("pie", "pies"), ("mug", "mugs")])
    rows = generate(n_train=3000, n_test=300, seed=0)
    canonical = [re.sub(r"\b(Ava|Ben|pie|mug)s?\b", "X", r["prompt"]) for r in rows["train"] + rows["test"]]
    assert len(set(canonical)) == len(canonical)


def test_chat_rows_are_a_system_and_a_user_turn():
    plain, chat = generate(5, 2, seed=0), generate(5, 2, seed=0, chat=True)
    for p, c in zip(plain["train"], chat["train"], strict=True):
        assert [m["role"] for m in c["prompt"]] == ["system", "user"] and "#### <number>" in c["prompt"][0]["content"]
        assert p["prompt"] == f"Question: {c['prompt'][1]['content']}\n{word_problems.INSTRUCTION}\nAnswer:"
        assert p["answer"] == c["answer"]


def test_the_command_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "w"), "--n-train", "7", "--n-test", "3", "--chat"]) == 0
    assert len((tmp_path / "w" / "train.jsonl").read_text().splitlines()) == 7
    assert len((tmp_path / "w" / "test.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "w" / "meta.json").read_text())["chat"] is True
    assert "train.jsonl" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "x"), "--n-train", "0"])
    assert exit_.value.code == 2 and "n_train=0: must be an integer >= 1" in capsys.readouterr().err


def test_asking_for_more_problems_than_the_templates_make_is_an_error(monkeypatch):
    monkeypatch.setattr(word_problems, "TEMPLATES", [word_problems.discount])    # 30 prices x 4 discounts
    assert len(generate(n_train=100, n_test=20)["train"]) == 100
    with pytest.raises(ValueError, match="cannot make that many distinct problems .they made 120"):
        generate(n_train=200, n_test=1)
