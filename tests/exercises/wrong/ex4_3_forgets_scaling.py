"""Exercise 4.3, wrong: adds B @ A without the scaling alpha / r."""

EXERCISE = "4.3"


def merge_lora(weight, lora_A, lora_B, scaling):
    return (weight.float() + lora_B.float() @ lora_A.float()).to(weight.dtype)
