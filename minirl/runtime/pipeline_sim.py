"""The pipeline simulator: run every rank's ordered actions and record when each starts and ends.

Hand-written (a discrete-event harness; notebook 08 section 5 teaches the schedules it runs, GPipe, 1F1B and
DualPipeV in `minirl.parallel.pipeline`, the idle share it measures, and the closed forms it is checked
against).

`simulate(orders, costs)` takes, for every rank, the ordered list of its actions (an `Op`, or an overlapped
pair (Op, Op) that costs the sum of the two) and repeatedly starts the next action of every rank whose
inputs are ready: a forward F(m, s) needs F(m, s-1); a backward B or I(m, s) needs F(m, s) and the input
gradient of stage s+1 (its B or I); a weight gradient W(m, s) needs I(m, s). An action starts when its rank
is free and its inputs have arrived, an input from another rank arriving `comm` after it was computed. The
result is a `PipelineTimeline`, from which the idle share follows. `check_orders` first rejects an
incomplete schedule; when no rank can move, the orders deadlock and `PipelineError` says so.

Simplified on purpose: costs are per stage and kind (no variation between micro-batches), a send costs a
fixed latency and never contends, memory is unlimited.
"""
from minirl.runtime.moe_checks import PipelineError, check_orders
from minirl.runtime.pipeline_types import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Costs,
    Event,
    Op,
    PipelineTimeline,
)


def simulate(orders: dict[int, list], costs: Costs | dict[int, Costs] | None = None) -> PipelineTimeline:
    """Run every rank's ordered actions; each starts when its rank is free and its inputs arrived.

    orders: rank -> [Op or (Op, Op)] (a pair runs as one overlapped action costing the sum).
    costs: one Costs for every stage (default `Costs()`), or stage -> Costs. F(m, s) needs F(m, s-1); B or I (m, s)
    needs F(m, s) and the input gradient from stage s+1 (its B or I); W(m, s) needs I(m, s).
    A dependency on another rank adds `comm`. Raises PipelineError when the orders deadlock.
    """
    num_stages = check_orders(orders)
    costs = Costs() if costs is None else costs
    cost = (lambda s: costs[s]) if isinstance(costs, dict) else (lambda s: costs)
    done: dict[tuple, tuple[float, int]] = {}             # (kind, m, s) -> (finish time, rank)
    free = {rank: 0.0 for rank in orders}
    position = {rank: 0 for rank in orders}
    events = []

    def ready(op: Op, rank: int) -> float | None:
        """When `op`'s inputs are all on `rank`, or None while one is still missing."""
        m, s = op.microbatch, op.stage
        needs = []
        if op.kind == FORWARD and s > 0:
            needs.append([(FORWARD, m, s - 1)])
        if op.kind in (BACKWARD, BACKWARD_INPUT):
            needs.append([(FORWARD, m, s)])
            if s < num_stages - 1:
                needs.append([(BACKWARD, m, s + 1), (BACKWARD_INPUT, m, s + 1)])
        if op.kind == BACKWARD_WEIGHT:
            needs.append([(BACKWARD_INPUT, m, s)])
        time = 0.0
        for alternatives in needs:
            hit = next((done[key] for key in alternatives if key in done), None)
            if hit is None:
                return None
            finish, where = hit
            time = max(time, finish + (cost(s).comm if where != rank else 0.0))
        return time

    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for rank, actions in orders.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                ops = action if isinstance(action, tuple) else (action,)
                times = [ready(op, rank) for op in ops]
                if any(t is None for t in times):
                    break
                start = max([free[rank], *times])
                end = start + sum(cost(op.stage).of(op.kind) for op in ops)
                t = start
                for op in ops:                            # an overlapped pair: both finish at its end
                    events.append(Event(rank, op, t, t + cost(op.stage).of(op.kind)))
                    t = events[-1].end
                    done[(op.kind, op.microbatch, op.stage)] = (end, rank)
                free[rank], position[rank] = end, position[rank] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in orders.items() if position[r] < len(a)}
            raise PipelineError(f"the schedule deadlocks: every rank waits for another ({stuck}); "
                                "a backward must come after its forward, stage s after stage s-1")
    return PipelineTimeline(events, num_ranks=len(orders))
