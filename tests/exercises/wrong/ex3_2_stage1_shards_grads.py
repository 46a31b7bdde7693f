"""Exercise 3.2, wrong: stage 1 shards the gradients too (that is stage 2)."""

from minirl.memory.calculator import COMPONENTS, bytes_per_param

EXERCISE = "3.2"


SHARDED = {0: (), 1: ("grads", "master", "adam_m", "adam_v"), 2: ("grads", "master", "adam_m", "adam_v"),
           3: ("weights", "grads", "master", "adam_m", "adam_v")}


def zero_per_gpu(num_params, num_gpus, stage, precision="mixed"):
    per = bytes_per_param(precision)
    out = {k: num_params * per[k] / (num_gpus if k in SHARDED[stage] else 1) for k in COMPONENTS}
    out["total"] = sum(out[k] for k in COMPONENTS)
    return out
