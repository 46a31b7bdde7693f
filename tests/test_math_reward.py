"""The `math` reward on answers as real models write them (issue 30, item 2): one table, each case with its reason.

Every case is also scored by TRL's `accuracy_reward` (math-verify alone, as TRL reads a completion and its
solution); where the two disagree, the case says why in `differs`, and a test checks that every disagreement
is one of those, so a change in either reader that moves a case shows up here.
"""

import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest

from minirl.runtime import latex_math
from minirl.runtime.math_answer import final_answer, math_reward
from minirl.runtime.task_files import load_task
from minirl.runtime.validate import ConfigError
from minirl.tasks.rewards import RewardError, resolve_reward
from minirl.train.step import score

GSM8K = "Ava buys 3 * 4 = <<3*4=12>>12 pencils.\nShe has 50 + 12 = <<50+12=62>>62 pencils now.\n#### 62"
NO_LATEX = "math-verify reads LaTeX only (TRL's setting for completions); `####` is GSM8K's marker, read as a number"
BARE = "a completion that is a number and nothing else is its answer; math-verify wants it boxed or after 'answer is'"
ANSWER_ONLY = ("an answer column holds the answer alone: minirl reads it as boxed math; math-verify's default "
               "reading of it without $...$ keeps only its first number")


@dataclass(frozen=True)
class Case:
    completion: object
    answer: object
    score: float
    why: str
    differs: str = ""        # why TRL's accuracy_reward (math-verify alone) scores otherwise, if it does


CASES = [
    # --- GSM8K's marker, read without sympy --------------------------------------------------------------------------
    Case("#### 62", 62, 1, "GSM8K's marker and a number", NO_LATEX),
    Case("so 31 + 31 = 62.\n#### 62", GSM8K, 1, "a worked solution against GSM8K's answer column", NO_LATEX),
    Case("#### 62 apples", 62, 1, "GSM8K's reading: the number that starts the line, words after it ignored",
         NO_LATEX),
    Case("####62.", 62, 1, "no space, a sentence's period", NO_LATEX),
    Case("#### $5 per hour", 5, 1, "a dollar sign and words", NO_LATEX),
    Case("#### 1,234", 1234, 1, "a thousands separator", NO_LATEX),
    Case("#### 1,234.5", "1234.50", 1, "decimals compare exactly, trailing zeros aside", NO_LATEX),
    Case("#### −5", -5, 1, "a Unicode minus (U+2212) is a minus", NO_LATEX),
    Case("#### 0", 0, 1, "zero is an answer, not a missing one", NO_LATEX),
    Case("#### 5\n#### 7", 7, 1, "the last marker is the final answer", NO_LATEX),
    Case("#### 62\n\n#### Verification\n31 + 31 = 62", 62, 1,
         "a markdown heading after the answer is not a marker: it must not zero a correct answer", NO_LATEX),
    Case("#### 62\n\n#### Check: 31 + 31 = 62 ✓", "62", 1, "a heading with numbers in it is still a heading",
         NO_LATEX),
    Case("#### 3/4", "\\frac{3}{4}", 1, "math after `####` goes to math-verify: 3/4, not GSM8K's first number 3",
         NO_LATEX),
    Case("#### \\frac{3}{4}", 0.75, 1, "LaTeX after `####` goes to math-verify", NO_LATEX),
    Case("#### 0.75", "$\\frac{3}{4}$", 1, "a decimal against a LaTeX fraction in the answer column", NO_LATEX),
    Case("#### 25%", 0.25, 1, "a percent is its hundredth (math-verify's rule)", NO_LATEX),
    Case([{"role": "assistant", "content": "#### 62"}], 62, 1, "a conversational completion (TRL's messages)",
         NO_LATEX),
    # --- \boxed{}: a plain number without sympy, anything else with math-verify ---------------------------------------
    Case("The answer is \\boxed{62}.", GSM8K, 1, "a boxed number against GSM8K's answer column"),
    Case("\\boxed{1{,}234}", "1234", 1, "LaTeX's thousands comma"),
    Case("\\boxed{1,234}", 1234, 1, "a plain thousands comma in a box"),
    Case("\\boxed{1\\,234}", 1234, 1, "a thin space between thousands",
         "math-verify reads 1\\,234 as the product 1*234"),
    Case("\\boxed{−5}", -5, 1, "a Unicode minus in a box"),
    Case("\\boxed{18 \\text{ dollars}}", 18, 1, "a unit as text inside the box"),
    Case("\\boxed{62 \\text{ cm}^2}", 62, 1, "a unit with a power"),
    Case("\\boxed{\\$18.00}", "18", 1, "dollars and cents"),
    Case("\\boxed{25\\%}", 25, 1, "a percent against its number"),
    Case("\\boxed{25\\%}", 0.25, 1, "a percent against its fraction"),
    Case("\\boxed{62^\\circ}", 62, 1, "degrees"),
    Case("\\boxed{62°}", 62, 1, "a Unicode degree sign",
         "math-verify keeps 62° as a string; minirl writes it 62^\\circ"),
    Case("\\boxed{x = 62}", 62, 1, "an assignment: its value"),
    Case("\\boxed{\\text{62}}", 62, 1, "a number set as text"),
    Case("\\boxed{\\textbf{62}}", 62, 1, "a number in bold"),
    Case("\\boxed{{62}}", 62, 1, "doubled braces"),
    Case("\\boxed{\\frac{1}{2}}", 0.5, 1, "a fraction against a decimal"),
    Case("\\boxed{0.5}", "\\frac{1}{2}", 1, "a decimal against a LaTeX fraction"),
    Case("\\boxed{\\dfrac{3}{4}}", "3/4", 1, "\\dfrac is \\frac"),
    Case("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1, "LaTeX in the answer column"),
    Case("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1, "equal symbolically", ANSWER_ONLY),
    Case("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", 1, "a surd in the answer column", ANSWER_ONLY),
    Case("\\boxed{(3, -2)}", "(3, -2)", 1, "an ordered pair", ANSWER_ONLY),
    Case("\\boxed{\\text{(C)}}", "\\text{(C)}", 1, "a multiple-choice letter",
         "math-verify's default reading finds nothing in a bare \\text{(C)} (TRL skips the row); minirl reads "
         "an answer column as boxed math"),
    Case("\\boxed{62.}", 62, 1, "a sentence's period inside the box", "math-verify keeps '62.' as a string"),
    Case("\\boxed{1\\,000}", 1000, 1, "a thin space, again", "math-verify reads 1\\,000 as the product 1*0"),
    Case("\\boxed{61} wait, no: \\boxed{62}", 62, 1, "the last box is the final answer",
         "math-verify gathers every box into one set {61, 62}"),
    Case("\\boxed{5} ... #### 7", 7, 1, "the later marker is the final answer", "math-verify reads only the box"),
    Case("#### 7 then \\boxed{5}", 5, 1, "the later marker is the final answer, either way"),
    Case([{"role": "assistant", "content": "so \\boxed{\\frac{1}{2}}"}], "0.5", 1, "conversational, with LaTeX"),
    # --- without a marker ---------------------------------------------------------------------------------------------
    Case("62", 62, 1, "a bare number", BARE),
    Case(" 62\n", "62", 1, "a bare number with whitespace", BARE),
    Case("−5", "-5", 1, "a bare Unicode minus", BARE),
    Case("$62$", 62, 1, "a bare number in math mode", BARE),
    Case("The final answer is $\\frac{1}{2}$. I hope it is correct.", "0.5", 1,
         "math after an anchor (Minerva's format), read by math-verify"),
    # --- must score 0 -------------------------------------------------------------------------------------------------
    Case("#### 61", 62, 0, "a wrong number"),
    Case("\\boxed{61}", 62, 0, "a wrong boxed number"),
    Case("#### 62.5", 62, 0, "close is not equal"),
    Case("-62", 62, 0, "the sign matters"),
    Case("\\boxed{x = 61}", 62, 0, "a wrong assignment"),
    Case("\\boxed{62 \\text{ and } 63}", 62, 0, "two answers are not one"),
    Case("\\boxed{\\frac{1}{3}}", 0.33, 0, "a rounded decimal is not the fraction"),
    Case("\\boxed{(-2, 3)}", "(3, -2)", 0, "an ordered pair, reversed"),
    Case("I think 61, no, 62", 62, 0, "no marker and not a number: the answer is only in the reasoning"),
    Case("62 apples", 62, 0, "no marker and not a bare number"),
    Case("We have $x = 62$ apples, so the answer is 61.", 62, 0,
         "the right number only in the reasoning, no marked answer"),
    Case("31 + 31 = 62, so the answer is 61.\n#### 61", 62, 0, "the right number in the reasoning, a wrong final one"),
    Case("#### 62\nbut then \\boxed{61}", 62, 0, "a later box overrides the `####` line"),
    Case("#### Verification: 62", 62, 0, "a heading is not a marker, and the text is not a bare number"),
    Case("#### ", 62, 0, "an empty marker"),
    Case("#### 1,23", 123, 0, "commas only between groups of three"),
    Case("\\boxed{6", 6, 0, "a box that never closes"),
    Case("\\boxed{}", 0, 0, "an empty box"),
    Case("", 62, 0, "an empty completion"),
    Case(None, 62, 0, "not a string"),
    Case([{"role": "assistant", "content": "#### 61"}], 62, 0, "a conversational wrong answer"),
]


def trl_accuracy(case: Case) -> float:
    """TRL's accuracy_reward on the case: math-verify alone; a solution it cannot parse scores 0 here (TRL: None)."""
    from trl.rewards import accuracy_reward

    text = case.completion[-1]["content"] if isinstance(case.completion, list) else case.completion
    got = accuracy_reward([[{"role": "assistant", "content": text if isinstance(text, str) else ""}]],
                          [str(case.answer)])[0]
    return 0.0 if got is None else got


def test_the_table_is_big_and_covers_both_scores():
    assert len(CASES) >= 60 and sum(c.score == 0 for c in CASES) >= 15
    assert all(c.why for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.why[:40]}" for i, c in enumerate(CASES)])
def test_math_reward(case):
    reward = resolve_reward("math")
    assert reward(["prompt"], [case.completion], answer=[case.answer]) == [float(case.score)], case.why


def test_every_disagreement_with_math_verify_is_on_purpose():
    """Where TRL's accuracy_reward (math-verify alone) scores a case otherwise, the case says why, and vice versa."""
    undocumented = [(c.completion, c.answer, c.score) for c in CASES if trl_accuracy(c) != c.score and not c.differs]
    stale = [(c.completion, c.answer) for c in CASES if trl_accuracy(c) == c.score and c.differs]
    assert not undocumented, f"minirl and math-verify disagree without a reason: {undocumented}"
    assert not stale, f"these cases say they differ from math-verify, but agree: {stale}"


def test_the_whole_batch_scores_as_the_cases_one_by_one():
    rewards = math_reward([f"p{i}" for i in range(len(CASES))], [c.completion for c in CASES],
                          answer=[c.answer for c in CASES])
    assert rewards == [float(c.score) for c in CASES]


def test_plain_numbers_are_read_without_sympy(monkeypatch):
    """The fast path: `#### N`, `\\boxed{N}` and bare numbers never reach math-verify."""
    def refuse(*args, **kwargs):
        raise AssertionError("math-verify was called on a plain number")
    monkeypatch.setattr("minirl.runtime.math_answer.parse_math", refuse)
    monkeypatch.setattr("minirl.runtime.math_answer.verify_math", refuse)
    plain = ["#### 62", "so 31 + 31 = 62.\n#### 62 apples", "\\boxed{62}", "\\boxed{1{,}234}", " 62", "#### −5",
             "#### 62\n\n#### Verification", "I think 61, no, 62", "#### 61"]
    assert math_reward(None, plain, answer=[62, GSM8K, 62, 1234, "62", -5, 62, 62, 62]) == [1] * 7 + [0, 0]
    assert isinstance(final_answer("\\boxed{62}"), Fraction)


def test_latex_answers_are_graded_in_any_thread():
    """math-verify's timeouts use signal.alarm, which only the main thread may call: from a producer thread
    (chapter 07) a reward with them on would read every LaTeX answer as none and score it 0."""
    latex_math._parse_short.cache_clear()            # a reading cached by the main thread would hide the problem
    completions = ["\\boxed{\\frac{7}{8}}", "\\boxed{87.5\\%}", "\\boxed{y = \\frac{14}{16}}", "\\boxed{\\frac{7}{9}}"]
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward(None, completions, answer=["0.875"] * 4)))
    worker.start()
    worker.join()
    assert results == [[1.0, 1.0, 1.0, 0.0]]
    assert math_reward(None, completions, answer=["0.875"] * 4) == [1.0, 1.0, 1.0, 0.0], "and in the main thread"


# --- an answer column the reward cannot read ----------------------------------------------------------------------

ROWS = [{"prompt": "Sam has 3 apples and buys 4 more. How many now?", "answer": "#### 7"},
        {"prompt": "Ava reads 10 pages a day. How many in a week?", "answer": "see the figure"},
        {"prompt": "What is half of 3/2?", "answer": "\\frac{3}{4}"}]


def test_an_unreadable_answer_names_its_row():
    with pytest.raises(ValueError, match="the row with prompt 'Ava reads 10 pages a day. How many in a ' has the "
                                         "answer 'see the figure', which states no number or math"):
        math_reward([r["prompt"] for r in ROWS], ["#### 7", "#### 70", "#### 0.75"],
                    answer=[r["answer"] for r in ROWS])
    assert math_reward(None, ["\\boxed{0.75}"], answer=["\\frac{3}{4}"]) == [1.0], "LaTeX in the column is read"


def _rollout(rows, completions):
    """What the step's `score` reads of a rollout: prompts, completions, G."""
    return SimpleNamespace(prompts=[r["prompt"] for r in rows], completions=completions, num_generations=1)


def test_the_step_stops_on_it_with_one_line_or_scores_it_zero():
    """The step's reward machinery (train/step.py's score): raise -> one line naming the row; zero -> 0, counted."""
    rollout = _rollout(ROWS, ["#### 7", "#### 70", "\\boxed{0.75}"])
    with pytest.raises(RewardError) as err:
        score([math_reward], rollout, ROWS, "raise")
    assert "\n" not in str(err.value) and "'Ava reads 10 pages a day" in str(err.value)
    assert "reward_errors='zero'" in str(err.value)
    rewards, metrics = score([math_reward], rollout, ROWS, "zero")
    assert rewards.tolist() == [1.0, 0.0, 1.0] and metrics["reward_errors"] == 1
    example = metrics["reward_error_examples"][0]
    assert example.startswith("math_reward[1]: ValueError: math_reward: the row with prompt 'Ava reads"), example


def test_load_task_refuses_it_or_keeps_going(tmp_path):
    import json

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ConfigError, match="row 1's answer 'see the figure' states no number or math.*"
                                          "--reward-errors zero") as err:
        load_task(path, path, ["math"])
    assert err.value.name == "dataset" and "\n" not in str(err.value)
    with pytest.warns(UserWarning, match="row 1's answer 'see the figure'"):
        task = load_task(path, path, ["math"], reward_errors="zero")
    assert len(task.train) == 3, "training keeps the row: the step scores it 0 as a reward error"
    assert [r["answer"] for r in task.test] == ["#### 7", "\\frac{3}{4}"], "evaluation leaves it out"
    assert task.score(task.test, ["#### 7", "\\boxed{0.75}"])[0].tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="reward_errors"):
        load_task(path, rewards=["math"], reward_errors="ignore")


def test_a_chapter_refuses_it_before_loading_or_keeps_going(tmp_path, capsys):
    """Chapter 01's flags reach load_task: without --reward-errors zero a parser error naming the row and the flag."""
    import importlib.util
    import json

    from tiny_bpe import save_tiny_bpe_model

    spec = importlib.util.spec_from_file_location("chapter01", Path(__file__).parents[1] / "chapters" /
                                                  "01_single_process.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    flags = ["--model", str(save_tiny_bpe_model(tmp_path / "model", chat_template=False)), "--dataset", str(path),
             "--reward", "math", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as stop:
        chapter.parse_args(flags)
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument --dataset: {path}: row 1's answer 'see the figure' states no number or math" in error
    assert error.endswith("or pass --reward-errors zero to score its completions 0"), error
    with pytest.warns(UserWarning, match="row 1's answer"):
        _, config, task, _ = chapter.parse_args(flags + ["--reward-errors", "zero"])
    assert config.algorithm.reward_errors == "zero" and len(task.train) == 3
