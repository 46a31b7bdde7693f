"""Exercise 4.3, wrong: computes the product in the weight's dtype (bfloat16), rounding twice."""

EXERCISE = "4.3"


def merge_lora(weight, lora_A, lora_B, scaling):
    return weight + scaling * (lora_B @ lora_A)
