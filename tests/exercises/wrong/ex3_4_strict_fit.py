"""Exercise 3.4, wrong: needs strictly less than the memory: an exact fit takes one GPU more."""

from minirl.memory.calculator import zero_per_gpu

EXERCISE = "3.4"


def min_gpus(num_params, gpu_memory_bytes, stage, precision="mixed", activation_bytes=0.0, max_gpus=65536):
    for n in range(1, max_gpus + 1):
        if zero_per_gpu(num_params, n, stage, precision)["total"] + activation_bytes < gpu_memory_bytes:
            return n
        if stage == 0:
            return None
    return None
