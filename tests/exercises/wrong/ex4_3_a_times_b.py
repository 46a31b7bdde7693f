"""Exercise 4.3, wrong: multiplies the transposes in the wrong order, A^T B^T ([in, out], not [out, in])."""

EXERCISE = "4.3"


def merge_lora(weight, lora_A, lora_B, scaling):
    return (weight.float() + scaling * (lora_A.float().T @ lora_B.float().T)).to(weight.dtype)
