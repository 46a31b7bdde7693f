"""Exercise 0.3, wrong: parses the completion as a string: chat-form completions always score 0."""

from minirl.tasks.arithmetic import parse_answer

EXERCISE = "0.3"


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True, **columns):
    return [1.0 if parse_answer(c, reverse_answer) == a else 0.0 for c, a in zip(completions, answer, strict=True)]
