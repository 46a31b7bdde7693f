"""Exercise 0.4, wrong: appends EOS to the input but not to the labels: the model never learns to stop."""

from minirl.tasks.arithmetic import format_prompt

EXERCISE = "0.4"


def sft_example(task, problem, tokenizer):
    prompt = tokenizer(format_prompt(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer(task.answer_text(problem), add_special_tokens=False)["input_ids"]
    return prompt + answer + [tokenizer.eos_token_id], [-100] * len(prompt) + answer + [-100]
