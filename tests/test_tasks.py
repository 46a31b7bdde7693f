"""The embedded task: split, formats, verifiers, and config errors."""

import random
import string

import pytest

from minirl.tasks.arithmetic import (
    MAX_DIGITS,
    Problem,
    TaskConfig,
    accuracy_reward,
    format_answer,
    format_prompt,
    format_reward,
    make_task,
    parse_answer,
)


def test_split_is_disjoint_deterministic_and_complete():
    a, b = make_task(), make_task()
    assert a.train == b.train and a.test == b.test and a.validation == b.validation
    assert len(a.test) == 500 and len(a.validation) == 500 and len(a.train) == 100 * 100 - 1000
    assert len(set(a.train) | set(a.validation) | set(a.test)) == 100 * 100
    assert make_task(TaskConfig(seed=1)).test != a.test


@pytest.mark.parametrize("config", [TaskConfig(),
                                    TaskConfig(ops="+-*", max_operand=30, num_test=301, num_validation=99)])
def test_commuted_twins_fall_on_the_same_side(config):
    """476 of the 500 held-out problems had their twin b+a in training (issue 9, item 8)."""
    task = make_task(config)
    side = {p: name for name in ("train", "validation", "test") for p in getattr(task, name)}
    assert all(side[Problem(p.b, p.op, p.a)] == name for p, name in side.items())
    assert not {p.pair for p in task.test} & {p.pair for p in task.train + task.validation}
    assert (len(task.test), len(task.validation)) == (config.num_test, config.num_validation)


def test_validation_rows_and_a_bad_split_name():
    task = make_task()
    assert [r["prompt"] for r in task.rows("validation")] == [format_prompt(p) for p in task.validation]
    with pytest.raises(ValueError, match="split='dev'"):
        task.rows("dev")


def test_rows_and_dataset_use_trl_columns():
    task = make_task()
    row = task.rows("test")[0]
    assert set(row) == {"prompt", "answer"} and row["prompt"] == format_prompt(task.test[0])
    ds = task.dataset("test")
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 500


@pytest.mark.parametrize("value", [-999, -10, -1, 0, 1, 9, 10, 100, 198, 9801])
@pytest.mark.parametrize("reverse", [True, False])
def test_parse_inverts_format(value, reverse):
    assert parse_answer(format_answer(value, reverse), reverse) == value


def test_verifiers_never_raise_on_any_string():
    rng = random.Random(0)
    alphabet = string.printable + "٣²−\u0000"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(2000)]
    rewards = accuracy_reward(None, texts, answer=[1] * len(texts))
    assert len(rewards) == len(texts) and set(rewards) <= {0.0, 1.0}
    assert set(format_reward(None, texts)) <= {0.0, 1.0}
    assert accuracy_reward(None, [None, 3, b"1", {"x": 1}, [{}]], answer=[1] * 5) == [0.0] * 5


def test_verifiers_never_raise_on_huge_numbers():
    """A completion of 4,301 digits made int() raise inside accuracy_reward (issue 9, item 14)."""
    huge = ["9" * 4301, "-" + "1" * 5000, " " + "2" * 1001 + " "]
    assert accuracy_reward(None, huge, answer=[1] * 3) == [0.0] * 3
    assert format_reward(None, huge) == [0.0] * 3
    assert parse_answer("1" * MAX_DIGITS) == int("1" * MAX_DIGITS)
    assert parse_answer("1" * (MAX_DIGITS + 1)) is None


def test_no_answer_exceeds_the_verifier_limit():
    with pytest.raises(ValueError, match="MAX_DIGITS"):
        TaskConfig(ops="*", max_operand=10**600, max_length=10**4)


def test_reward_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        accuracy_reward(None, ["1", "2"], answer=[1])


def test_other_operators():
    task = make_task(TaskConfig(ops="-*", max_operand=9, num_test=10, num_validation=10))
    assert {p.op for p in task.train} == {"-", "*"}
    p = next(p for p in task.train if p.value < 0)
    assert task.reward(None, [task.answer_text(p)], answer=[p.value]) == [1.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_operand=50, max_operand=10), "empty operand range min_operand=50 > max_operand=10"),
    (dict(max_operand=10**20), r"TaskConfig.max_operand=100000000000000000000: .*max_length=32"),
    (dict(ops="/"), r"TaskConfig.ops='/'"),
    (dict(ops=""), r"TaskConfig.ops=''"),
    (dict(min_operand=-1), "TaskConfig.min_operand=-1"),
    (dict(num_test=0), "TaskConfig.num_test=0"),
    (dict(max_operand=2, num_test=9), "TaskConfig.num_test=9"),
    (dict(max_operand=2, num_test=4, num_validation=5), "TaskConfig.num_validation=5: must be in 0..4"),
    (dict(num_validation=-1), "TaskConfig.num_validation=-1"),
])
def test_bad_configs_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**kwargs)


def test_longer_operands_fit_a_longer_context():
    config = TaskConfig(max_operand=10**6, max_length=32)
    assert config.sequence_length <= 32
    with pytest.raises(ValueError, match="max_length=16"):
        TaskConfig(max_operand=10**6, max_length=16)
