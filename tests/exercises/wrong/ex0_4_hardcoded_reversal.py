"""Exercise 0.4, wrong: writes the answer with format_answer(problem.value) instead of the task's own format."""

from minirl.tasks.arithmetic import format_answer, format_prompt

EXERCISE = "0.4"


def sft_example(task, problem, tokenizer):
    prompt = tokenizer(format_prompt(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer(format_answer(problem.value), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer
