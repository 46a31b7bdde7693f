"""Exercise 0.3, wrong: returns ints (1 and 0), not floats."""

from minirl.runtime.completions import completion_text
from minirl.tasks.arithmetic import parse_answer

EXERCISE = "0.3"


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True, **columns):
    return [int(parse_answer(completion_text(c), reverse_answer) == a)
            for c, a in zip(completions, answer, strict=True)]
