"""Exercise 8.3, wrong: in the steady state, a backward before each forward instead of after it."""

from minirl.runtime.pipeline_types import BACKWARD, FORWARD, Op

EXERCISE = "8.3"


def one_f_one_b_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [Op(FORWARD, m, stage) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Op(BACKWARD, i, stage), Op(FORWARD, warmup + i, stage)]
    return order + [Op(BACKWARD, m, stage) for m in range(num_microbatches - warmup, num_microbatches)]
