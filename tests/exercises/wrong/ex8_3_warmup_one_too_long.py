"""Exercise 8.3, wrong: the warm-up runs num_stages - stage forwards, one more than 1F1B's."""

from minirl.runtime.pipeline_types import BACKWARD, FORWARD, Op

EXERCISE = "8.3"


def one_f_one_b_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage, num_microbatches)
    order = [Op(FORWARD, m, stage) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Op(FORWARD, warmup + i, stage), Op(BACKWARD, i, stage)]
    return order + [Op(BACKWARD, m, stage) for m in range(num_microbatches - warmup, num_microbatches)]
