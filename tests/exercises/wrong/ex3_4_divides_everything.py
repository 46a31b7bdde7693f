"""Exercise 3.4, wrong: divides the whole state by N whatever the stage: stages 0-2 look like stage 3."""

import math

from minirl.memory.calculator import bytes_per_param

EXERCISE = "3.4"


def min_gpus(num_params, gpu_memory_bytes, stage, precision="mixed", activation_bytes=0.0, max_gpus=65536):
    state = num_params * bytes_per_param(precision)["total"]
    n = math.ceil(state / (gpu_memory_bytes - activation_bytes))
    return n if 1 <= n <= max_gpus else None
