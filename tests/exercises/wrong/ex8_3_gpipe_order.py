"""Exercise 8.3, wrong: all forwards, then all backwards (GPipe's order, not 1F1B's)."""

from minirl.runtime.pipeline_types import BACKWARD, FORWARD, Op

EXERCISE = "8.3"


def one_f_one_b_order(stage, num_stages, num_microbatches):
    return ([Op(FORWARD, m, stage) for m in range(num_microbatches)]
            + [Op(BACKWARD, m, stage) for m in range(num_microbatches)])
