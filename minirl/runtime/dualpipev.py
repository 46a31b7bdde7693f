"""DualPipeV's layout: which forwards and backwards each rank runs, in DeepSeek's eight phases.

Hand-written (a transcription; notebook 08 section 5 teaches pipeline bubbles with the simulator of
`minirl.parallel.pipeline`, and checks this layout action by action against torch's `ScheduleDualPipeV`).

DualPipeV is DualPipe (DeepSeek-V3) folded into a V: on P ranks there are 2P stages, rank r holding stage r
on the way down and stage 2P - 1 - r on the way back up (`dualpipev_stages`). `dualpipev_order(P, M)` gives
every rank's ordered actions for M micro-batches: forwards fill the V from both ends; the steady phase pairs
a forward of one chunk with a backward of the other (an overlapped pair, a tuple); the tail splits
backwards into I (input gradients) and W (weight gradients) so that the W fill the last holes. Inside
`_dualpipev_rank`, `op` hands out the next micro-batch of a stage and kind and remembers each I, so that
its W can fill a later hole.
"""
from minirl.runtime.moe_checks import PipelineError, check_pipeline
from minirl.runtime.pipeline_types import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Op


def dualpipev_stages(num_ranks: int, rank: int) -> tuple[int, int]:
    """DualPipeV's V: rank r holds stage r (going down) and stage 2P-1-r (coming back up)."""
    return rank, 2 * num_ranks - 1 - rank


def dualpipev_order(num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """DualPipeV (DualPipe folded into a V on P ranks and 2P stages), rank by rank: the eight
    phases of DeepSeek's DualPipeV, as torch's `ScheduleDualPipeV` lays them out."""
    P, M = num_ranks, num_microbatches
    check_pipeline(P, M)
    if M < 2 * P:
        raise PipelineError(f"num_microbatches={M}: DualPipeV needs at least 2 x num_ranks = "
                            f"{2 * P} micro-batches (one per stage)")
    return {rank: _dualpipev_rank(P, M, rank) for rank in range(P)}


def _dualpipev_rank(P: int, M: int, rank: int) -> list:
    s0, s1 = dualpipev_stages(P, rank)
    count = {}                                            # (stage, kind) -> next micro-batch
    pending_w: list[Op] = []

    def op(stage, kind):
        key = (stage, BACKWARD_INPUT if kind == BACKWARD else kind)
        m = count.get(key, 0)
        count[key] = m + 1
        if kind == BACKWARD_INPUT:
            pending_w.append(Op(BACKWARD_WEIGHT, m, stage))
        return Op(kind, m, stage)

    def weight():
        return [pending_w.pop(0)] if pending_w else []

    order = [op(s0, FORWARD) for _ in range((P - rank - 1) * 2)]              # 1: F0
    for _ in range(rank + 1):                                                 # 2: F0 F1
        order += [op(s0, FORWARD), op(s1, FORWARD)]
    for _ in range(P - rank - 1):                                             # 3: I1 W F1
        order += [op(s1, BACKWARD_INPUT), *weight(), op(s1, FORWARD)]
    for i in range(M - 2 * P + rank + 1):                                     # 4: (F0 B1) (F1 B0)
        if i == 0 and rank == P - 1:
            order += [op(s0, FORWARD), op(s1, BACKWARD)]
        else:
            order.append((op(s0, FORWARD), op(s1, BACKWARD)))
        order.append((op(s1, FORWARD), op(s0, BACKWARD)))
    for _ in range(P - rank - 1):                                             # 5: B1 (F1 B0)
        order += [op(s1, BACKWARD), (op(s1, FORWARD), op(s0, BACKWARD))]
    split = False                                                             # 6: B1 B0, then I
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        order.append(op(s1, BACKWARD_INPUT if split else BACKWARD))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        order.append(op(s0, BACKWARD_INPUT if split else BACKWARD))
    for _ in range(P - rank - 1):                                             # 7: W B0
        order += [*weight(), op(s0, BACKWARD_INPUT if split else BACKWARD)]
    for _ in range(rank + 1):                                                 # 8: W
        order += weight()
    return order
