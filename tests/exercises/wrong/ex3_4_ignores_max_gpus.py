"""Exercise 3.4, wrong: searches past max_gpus."""

from minirl.memory.calculator import zero_per_gpu

EXERCISE = "3.4"


def min_gpus(num_params, gpu_memory_bytes, stage, precision="mixed", activation_bytes=0.0, max_gpus=65536):
    for n in range(1, 1 << 20):
        if zero_per_gpu(num_params, n, stage, precision)["total"] + activation_bytes <= gpu_memory_bytes:
            return n
        if stage == 0 or n > 4096 and stage < 3:
            return None
    return None
