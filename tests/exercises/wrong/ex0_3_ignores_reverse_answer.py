"""Exercise 0.3, wrong: always parses reversed digits, whatever reverse_answer says."""

from minirl.runtime.completions import completion_text
from minirl.tasks.arithmetic import parse_answer

EXERCISE = "0.3"


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True, **columns):
    return [1.0 if parse_answer(completion_text(c)) == a else 0.0 for c, a in zip(completions, answer, strict=True)]
