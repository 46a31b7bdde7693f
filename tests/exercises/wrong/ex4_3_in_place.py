"""Exercise 4.3, wrong: merges into the base weight in place (the trainer's frozen base changes under it)."""

EXERCISE = "4.3"


def merge_lora(weight, lora_A, lora_B, scaling):
    return weight.add_(scaling * (lora_B @ lora_A))
