# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Pipeline schedules on paper: GPipe, 1F1B and DualPipeV, their idle time and its closed forms.

A schedule is, for every rank, the ordered list of its actions (`Op`s, or an overlapped (F, B)
pair); `simulate` (minirl.runtime.pipeline_sim) runs it. An overlapped pair costs F + B: overlap
hides communication, not compute.
"""

__all__ = ["bubble_share", "gpipe_order", "one_f_one_b_order", "one_f_one_b_schedule",
           "bubble_formulas", "SCHEDULES", "schedule_orders", "simulate_schedule"]

from minirl.runtime.dualpipev import dualpipev_order
from minirl.runtime.moe_checks import PipelineError, check_pipeline
from minirl.runtime.pipeline_sim import simulate
from minirl.runtime.pipeline_types import BACKWARD, BACKWARD_WEIGHT, FORWARD, Costs, Op


def bubble_share(events: list[tuple[int, float, float]], num_ranks: int) -> float:
    """Share of the ranks' time spent idle, from a timeline of (rank, start, end) intervals.

    The job runs from the earliest start to the latest end over all events (the makespan);
    every rank is held for that whole span. Returns 1 - (sum of all busy time) /
    (num_ranks x makespan), a float in [0, 1]. Intervals of one rank never overlap. A rank
    with no events counts as idle throughout. Raises ValueError for an empty timeline.
    """
    if not events:
        raise ValueError("bubble_share: the timeline is empty; simulate or measure a step first")
    span = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = sum(end - start for _, start, end in events)
    return 1.0 - busy / (num_ranks * span)


def gpipe_order(num_stages: int, num_microbatches: int) -> dict[int, list[Op]]:
    """GPipe: every forward, then every backward; rank s holds stage s."""
    check_pipeline(num_stages, num_microbatches)
    M = num_microbatches
    return {s: [Op(FORWARD, m, s) for m in range(M)] + [Op(BACKWARD, m, s) for m in range(M)]
            for s in range(num_stages)}


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """The 1F1B order of one stage: warm-up forwards, then one forward / one backward, cool-down.

    Stage `stage` (0-based, of `num_stages`) first runs W = min(num_stages - stage - 1,
    num_microbatches) forwards (micro-batches 0..W-1); then, for i = 0 .. M-W-1, the
    forward of micro-batch W+i followed by the backward of micro-batch i; then the backwards
    of the remaining micro-batches M-W .. M-1 in order. Returns a list of 2M Ops with
    kinds "F"/"B" and this stage's index. The last stage alternates F0 B0 F1 B1 ...; the
    first keeps num_stages - 1 forwards in flight, which bounds its stored activations.
    """
    check_pipeline(num_stages, num_microbatches)
    if not 0 <= stage < num_stages:
        raise PipelineError(f"stage={stage}: must be in 0..{num_stages - 1}")
    M = num_microbatches
    warmup = min(num_stages - stage - 1, M)
    order = [Op(FORWARD, m, stage) for m in range(warmup)]
    for i in range(M - warmup):
        order += [Op(FORWARD, warmup + i, stage), Op(BACKWARD, i, stage)]
    return order + [Op(BACKWARD, m, stage) for m in range(M - warmup, M)]


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> dict[int, list[Op]]:
    """1F1B on every rank (rank s holds stage s)."""
    return {s: one_f_one_b_order(s, num_stages, num_microbatches) for s in range(num_stages)}


def bubble_formulas(num_ranks: int, num_microbatches: int,
                    costs: Costs | None = None) -> dict[str, float]:
    """The closed forms as bubble time over compute time, and GPipe/1F1B's share of the total.

    `costs` are one rank's work per micro-batch (DualPipeV's chunks are half of it).
    dualpipev_table: DeepSeek-V3's table, (PP/2 - 1)(F&B + B - 3W) for DualPipe on PP ranks;
    DualPipeV is DualPipe on half the ranks, so on P ranks it idles (P - 1)(F&B + B - 3W)
    with chunk costs, taking F&B = F + B (no compute overlap).
    """
    P, M, costs = num_ranks, num_microbatches, Costs() if costs is None else costs
    chunk = costs.scaled(0.5)
    fb = chunk.forward + chunk.backward                                # F&B: no compute overlap
    idle = (P - 1) * (fb + chunk.backward - 3 * chunk.of(BACKWARD_WEIGHT))
    return {"gpipe_1f1b_source": (P - 1) / M, "gpipe_1f1b_share": (P - 1) / (M + P - 1),
            "dualpipe_source": (P - 1) / (2 * M),
            "dualpipev_table": idle / (M * (costs.forward + costs.backward))}


SCHEDULES = ("gpipe", "1f1b", "dualpipev")


def schedule_orders(schedule: str, num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """Rank -> actions for a named schedule on `num_ranks` ranks (DualPipeV: 2 stages per rank)."""
    orders = {"gpipe": gpipe_order, "1f1b": one_f_one_b_schedule, "dualpipev": dualpipev_order}
    if schedule not in orders:
        raise PipelineError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    return orders[schedule](num_ranks, num_microbatches)


def simulate_schedule(schedule: str, num_ranks: int, num_microbatches: int,
                      costs: Costs | None = None):
    """The PipelineTimeline of a named schedule with `costs` (default `Costs()`) per rank and
    micro-batch."""
    orders, costs = schedule_orders(schedule, num_ranks, num_microbatches), costs or Costs()
    return simulate(orders, costs.scaled(0.5) if schedule == "dualpipev" else costs)
