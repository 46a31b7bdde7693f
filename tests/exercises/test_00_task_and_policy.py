"""Graded checks for notebook 00's exercises (python -m minirl.grade --only 00)."""

import pytest

from minirl.models.policy import build_tokenizer
from minirl.tasks.arithmetic import Problem, TaskConfig, make_task


@pytest.mark.exercise("0.1")
def test_format_answer_reverses_digits(ex):
    assert ex.format_answer(62) == "26", "62 is written least-significant digit first: '26'"
    assert ex.format_answer(100) == "001", "keep the zeros: 100 reversed is '001'"
    assert ex.format_answer(7) == "7"


@pytest.mark.exercise("0.1")
def test_format_answer_sign_and_zero(ex):
    assert ex.format_answer(-12) == "-21", "the minus sign stays in front of the reversed digits"
    assert ex.format_answer(0) == "0"
    assert ex.format_answer(62, reverse=False) == "62", "reverse=False writes the ordinary number"
    assert ex.format_answer(-120, reverse=False) == "-120", "reverse=False keeps the sign and the zeros"


@pytest.mark.exercise("0.2")
def test_parse_answer_inverts_format(ex):
    for value in (0, 7, 62, 100, -12, 198):
        reference = {0: "0", 7: "7", 62: "26", 100: "001", -12: "-21", 198: "891"}[value]
        assert ex.parse_answer(reference) == value, f"parse_answer({reference!r}) should be {value}"
    assert ex.parse_answer(" 26\n") == 62, "surrounding whitespace is ignored"
    assert ex.parse_answer("\t-21 ") == -12, "whitespace around a negative answer is ignored too"
    assert ex.parse_answer("62", reverse=False) == 62
    assert ex.parse_answer("-120", reverse=False) == -120


@pytest.mark.exercise("0.2")
def test_parse_answer_malformed_is_none(ex):
    for bad in ("", " ", "2 6", "26=", "+26", "-", "--1", "1-", "- 1", "1_0", "0x1", "٣", "abc", "²", "1.0"):
        assert ex.parse_answer(bad) is None, f"parse_answer({bad!r}) must be None (malformed)"
    for bad in (None, 26, ["26"]):
        assert ex.parse_answer(bad) is None, f"parse_answer({bad!r}) must be None for a non-string, not raise"


@pytest.mark.exercise("0.2")
def test_parse_answer_digit_limit(ex):
    assert ex.parse_answer("1" * 1000) == int("1" * 1000), "up to MAX_DIGITS = 1,000 digits is a number"
    for n in (1001, 4301, 10_000):
        try:
            parsed = ex.parse_answer("7" * n)
        except ValueError as err:
            raise AssertionError(f"parse_answer of {n:,} digits raised {err!r}: it must return None "
                                 "(more than MAX_DIGITS digits is malformed; int() refuses > 4,300)") from None
        assert parsed is None, f"{n:,} digits is more than MAX_DIGITS = 1,000: None"


@pytest.mark.exercise("0.3")
def test_accuracy_reward_scores_exact_matches(ex):
    prompts = ["27+35="] * 4
    rewards = ex.accuracy_reward(prompts, ["26", "62", "26 ", "x"], answer=[62, 62, 62, 62])
    assert rewards == [1.0, 0.0, 1.0, 0.0], f"expected [1, 0, 1, 0] (reversed digits, whitespace ok), got {rewards}"
    assert all(isinstance(r, float) for r in rewards), "rewards must be floats"


@pytest.mark.exercise("0.3")
def test_accuracy_reward_trl_signature_and_chat_form(ex):
    chat = [[{"role": "assistant", "content": "26"}], [{"role": "assistant", "content": "7"}]]
    rewards = ex.accuracy_reward(["27+35=", "1+1="], chat, answer=[62, 2], extra_column=["ignored", "too"])
    assert rewards == [1.0, 0.0], "chat-form completions are read from the last message; extra columns are ignored"
    assert ex.accuracy_reward(["a"], [None], answer=[1]) == [0.0], "a malformed completion scores 0.0, never raises"
    no_text = [[], [{"role": "assistant", "content": None}]]
    assert ex.accuracy_reward(["a", "b"], no_text, answer=[1, 1]) == [0.0, 0.0], \
        "an empty chat or a message without text content is malformed: 0.0"


@pytest.mark.exercise("0.3")
def test_accuracy_reward_reverse_answer_and_sign(ex):
    rewards = ex.accuracy_reward(["27+35="] * 2, ["62", "26"], answer=[62, 62], reverse_answer=False)
    assert rewards == [1.0, 0.0], "reverse_answer=False: the completion states the answer in the usual order"
    assert ex.accuracy_reward(["5-17="], ["-21"], answer=[-12]) == [1.0], "a negative answer: '-21' states -12"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.exercise("0.4")
def test_sft_example_masks_the_prompt(ex, tokenizer):
    task = make_task()
    ids, labels = ex.sft_example(task, Problem(27, "+", 35), tokenizer)
    prompt = tokenizer("27+35=", add_special_tokens=False)["input_ids"]
    answer = tokenizer("26", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert ids == prompt + answer + [eos], f"input_ids should be prompt + answer + EOS, got {ids}"
    assert labels == [-100] * len(prompt) + answer + [eos], f"labels mask the prompt with -100, got {labels}"


@pytest.mark.exercise("0.4")
def test_sft_example_follows_the_task_answer_format(ex, tokenizer):
    task = make_task(TaskConfig(reverse_answer=False))
    ids, labels = ex.sft_example(task, Problem(27, "+", 35), tokenizer)
    answer = tokenizer(task.answer_text(Problem(27, "+", 35)), add_special_tokens=False)["input_ids"]
    assert labels[-len(answer) - 1:-1] == answer, "the answer is written as the task writes it (task.answer_text)"


@pytest.mark.exercise("0.4")
def test_sft_example_lengths_match(ex, tokenizer):
    task = make_task()
    for p in task.train[:20]:
        ids, labels = ex.sft_example(task, p, tokenizer)
        assert len(ids) == len(labels), "input_ids and labels must have the same length"
        assert labels[-1] == tokenizer.eos_token_id, "the last label is EOS: the model must learn to stop"
        assert ids[0] != tokenizer.bos_token_id, "no BOS token: the prompt starts with its first digit"
