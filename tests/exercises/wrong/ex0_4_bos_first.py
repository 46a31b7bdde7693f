"""Exercise 0.4, wrong: starts the example with a BOS token."""

from minirl.tasks.arithmetic import format_prompt

EXERCISE = "0.4"


def sft_example(task, problem, tokenizer):
    prompt = [tokenizer.bos_token_id] + tokenizer(format_prompt(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer(task.answer_text(problem), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer
