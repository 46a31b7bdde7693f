# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""The embedded arithmetic task: problems, a train/validation/held-out split, prompts, verifiers.

A prompt is `"a+b="`; the target completion is the answer (reversed digits by default) and
EOS. Rewards have TRL's signature, `f(prompts, completions, **columns) -> list[float]`, score
anything malformed 0.0 and never raise. Simplified on purpose: one task family, exact match,
no chat template; none of what a real math-RL setup adds changes how the loop is distributed.
"""

__all__ = ["OPERATORS", "MAX_DIGITS", "TaskConfig", "Problem", "format_prompt", "format_answer",
           "parse_answer", "accuracy_reward", "format_reward", "arithmetic_reward",
           "ArithmeticTask", "make_task"]

import random
from dataclasses import dataclass, field

from minirl.runtime.completions import completion_text
from minirl.runtime.config_checks import check_task_config
from minirl.runtime.validate import check_choice

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_DIGITS = 1000  # longer digit strings are malformed (and int() refuses more than 4,300 digits)


@dataclass(frozen=True)
class TaskConfig:
    """Which problems exist and how they are split. Defaults: a+b with a, b in 0..99."""

    ops: str = "+"             # any of "+-*"
    min_operand: int = 0
    max_operand: int = 99
    num_test: int = 500        # held-out problems: never trained on, never used to tune anything
    num_validation: int = 500  # carved from training: what the warm start's length is tuned on
    seed: int = 0              # the split's seed
    reverse_answer: bool = True
    max_length: int = 32       # the tokenizer's context: prompt + answer + EOS must fit

    def __post_init__(self):
        check_task_config(self, OPERATORS, MAX_DIGITS)

    @property
    def num_problems(self) -> int:
        return len(self.ops) * (self.max_operand - self.min_operand + 1) ** 2

    @property
    def max_answer_length(self) -> int:
        """Characters of the longest answer, sign included."""
        lo, hi = self.min_operand, self.max_operand
        extremes = [OPERATORS[op](a, b) for op in self.ops for a in (lo, hi) for b in (lo, hi)]
        return max(len(str(v)) for v in extremes)

    @property
    def sequence_length(self) -> int:
        """Tokens of the longest prompt, answer and EOS (one token per character)."""
        return 2 * len(str(self.max_operand)) + 2 + self.max_answer_length + 1


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def value(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def pair(self) -> tuple:
        """The unordered operand pair with its operator: a+b and b+a share it (a-b and b-a too)."""
        return (self.op, min(self.a, self.b), max(self.a, self.b))


def format_prompt(problem: Problem) -> str:
    """`Problem(27, "+", 35)` -> `"27+35="`."""
    return f"{problem.a}{problem.op}{problem.b}="


def format_answer(value: int, reverse: bool = True) -> str:
    """The target completion text for an integer answer (without EOS).

    With `reverse=True` the digits are written least significant first and a minus sign,
    if any, stays in front: 62 -> "26", -12 -> "-21", 0 -> "0", 100 -> "001".
    """
    digits = str(abs(value))
    if reverse:
        digits = digits[::-1]
    return ("-" if value < 0 else "") + digits


def parse_answer(completion: str, reverse: bool = True) -> int | None:
    """Invert `format_answer`: the integer a completion states, or None if malformed.

    Leading and trailing whitespace is ignored. A well-formed completion is an optional
    "-" followed by 1 to MAX_DIGITS (1,000) ASCII digits and nothing else ("26", "-21",
    "001"). Anything else ("", "2 6", "26=", "+26", "٣", 1,001 digits, None, a non-string)
    returns None. Never raises, whatever arrives: a policy can emit a completion of 4,301
    digits, which Python's `int()` refuses.
    """
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if not digits or len(digits) > MAX_DIGITS or not all(c in "0123456789" for c in digits):
        return None
    return sign * int(digits[::-1] if reverse else digits)


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True,
                    **columns) -> list[float]:
    """1.0 where a completion states exactly `answer`, else 0.0 (malformed included).

    prompts: list[str] (unused, kept for TRL's signature); completions: list[str] or chat
    messages; answer: list[int], one per completion. Returns one float per completion.
    """
    if len(completions) != len(answer):
        raise ValueError(f"accuracy_reward: {len(completions)} completions but "
                         f"{len(answer)} answers")
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        stated = parse_answer(completion_text(completion), reverse=reverse_answer)
        rewards.append(1.0 if stated is not None and stated == target else 0.0)
    return rewards


def format_reward(prompts, completions, reverse_answer: bool = True, **columns) -> list[float]:
    """1.0 for a well-formed number, right or wrong; a shaping signal, off by default."""
    return [0.0 if parse_answer(completion_text(c), reverse_answer) is None else 1.0
            for c in completions]


def arithmetic_reward(prompts, completions, answer, **columns) -> list[float]:
    """The embedded task's reward, `--reward arithmetic`: `accuracy_reward` on reversed digits."""
    return accuracy_reward(prompts, completions, answer, reverse_answer=True)


@dataclass
class ArithmeticTask:
    """A config and its split: `train`, `test` (held out) and `validation` are lists of Problems."""

    config: TaskConfig
    train: list[Problem]
    test: list[Problem]
    validation: list[Problem] = field(default_factory=list)

    def prompt(self, problem: Problem) -> str:
        return format_prompt(problem)

    def answer_text(self, problem: Problem) -> str:
        return format_answer(problem.value, self.config.reverse_answer)

    def reward(self, prompts, completions, answer, **columns) -> list[float]:
        """`accuracy_reward` with this task's answer format (TRL signature)."""
        return accuracy_reward(prompts, completions, answer,
                               reverse_answer=self.config.reverse_answer)

    def rows(self, split: str = "train") -> list[dict]:
        """Dataset rows `{"prompt", "answer"}` in TRL's standard (non-chat) format."""
        splits = {"train": self.train, "validation": self.validation, "test": self.test}
        check_choice("split", split, splits)
        return [{"prompt": format_prompt(p), "answer": p.value} for p in splits[split]]

    def dataset(self, split: str = "train"):
        """The split as a `datasets.Dataset` (what TRL's trainers take)."""
        from datasets import Dataset  # imported here: the rest of the task needs no datasets

        return Dataset.from_list(self.rows(split))


def make_task(config: TaskConfig | None = None) -> ArithmeticTask:
    """Every problem of the config, split by unordered operand pair into test, validation and train.

    a+b and b+a always land in the same split. The pairs are shuffled by `config.seed`; the
    held-out set takes whole pairs until it holds `num_test` problems (a pair that would
    overshoot is passed over), then validation until `num_validation`; training gets the rest.
    """
    config = config or TaskConfig()
    operands = range(config.min_operand, config.max_operand + 1)
    groups = {}
    for problem in (Problem(a, op, b) for op in config.ops for a in operands for b in operands):
        groups.setdefault(problem.pair, []).append(problem)
    pairs = list(groups)
    rng = random.Random(config.seed)
    rng.shuffle(pairs)
    test, validation, train = [], [], []
    for pair in pairs:
        group = groups[pair]
        if len(test) + len(group) <= config.num_test:
            test += group
        elif len(validation) + len(group) <= config.num_validation:
            validation += group
        else:
            train += group
    for split in (test, validation, train):
        rng.shuffle(split)
    return ArithmeticTask(config, train=train, test=test, validation=validation)
