# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""Pipeline-parallel schedules on paper: GPipe, 1F1B and DualPipeV, laid out and timed by a simulator.

A schedule is, for every rank, the ordered list of what it computes: `Op("F", m, s)` the
forward of micro-batch m through stage s, `Op("B", m, s)` its full backward, or the backward
split in two as zero-bubble schedules do, `Op("I", m, s)` (gradient for the inputs, which
the previous stage waits for) and `Op("W", m, s)` (gradient for the weights, which nobody
waits for). A pair `(Op("F", ...), Op("B", ...))` is DualPipe's overlapped forward and backward
of two micro-batches on one rank. `simulate` runs each rank's list in order, starting an
action as soon as the rank is free and its inputs have arrived, and returns the timeline.

Simplified on purpose: costs are per stage and per kind (no variation between micro-batches),
a send costs a fixed latency `comm` and never contends, memory is unlimited, and an
overlapped F&B pair costs F + B: overlapping hides communication behind compute (DualPipe's
purpose), it does not make one device compute two things at once.
"""

__all__ = ["FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "KINDS", "PipelineError",
           "Op", "Costs", "Event", "PipelineTimeline", "bubble_share", "check_pipeline",
           "split_layers", "gpipe_order", "one_f_one_b_order", "one_f_one_b_schedule",
           "dualpipev_stages", "dualpipev_order", "simulate", "bubble_formulas", "SCHEDULES",
           "schedule_orders", "simulate_schedule", "OP_COLORS", "plot_pipeline"]

from dataclasses import dataclass

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


class PipelineError(ValueError):
    """A pipeline that cannot be built or scheduled; the message names the setting and the fix."""


@dataclass(frozen=True)
class Op:
    """One unit of pipeline work: `kind` of micro-batch `microbatch` through stage `stage`."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Costs:
    """Time of one stage's work on one micro-batch, by kind; `weight` is W's part of B (default B/2)."""

    forward: float = 1.0
    backward: float = 2.0
    weight: float | None = None
    comm: float = 0.0

    def of(self, kind: str) -> float:
        weight = self.backward / 2 if self.weight is None else self.weight
        return {FORWARD: self.forward, BACKWARD: self.backward, BACKWARD_INPUT: self.backward - weight,
                BACKWARD_WEIGHT: weight}[kind]

    def scaled(self, factor: float) -> "Costs":
        """The same costs for a stage `factor` times as large (DualPipeV's half-size chunks: 0.5)."""
        weight = None if self.weight is None else self.weight * factor
        return Costs(self.forward * factor, self.backward * factor, weight, self.comm)


@dataclass(frozen=True)
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class PipelineTimeline:
    """What `simulate` returns: every op's start and end, per rank."""

    events: list[Event]
    num_ranks: int

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    @property
    def bubble_share(self) -> float:
        """Idle share of all ranks' time, 0-1: idle / (ranks x makespan)."""
        return bubble_share([(e.rank, e.start, e.end) for e in self.events], self.num_ranks)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (the source's form, (P-1)/M for GPipe and 1F1B)."""
        busy = sum(self.busy(r) for r in range(self.num_ranks))
        return (self.num_ranks * self.makespan - busy) / busy


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


def check_pipeline(num_stages: int, num_microbatches: int, num_samples: int | None = None,
                   num_layers: int | None = None) -> None:
    """Raise PipelineError for a pipeline that cannot be split as asked."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineError(f"{name}={value!r}: must be an int >= 1")
    if num_samples is not None and num_microbatches > num_samples:
        raise PipelineError(f"num_microbatches={num_microbatches} exceeds the batch's {num_samples} samples: "
                            f"every micro-batch needs at least one sample; use num_microbatches <= {num_samples}")
    if num_layers is not None and num_layers % num_stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise PipelineError(f"num_stages={num_stages} does not divide num_layers={num_layers}: stages would be "
                            f"unequal and the slowest sets the pace; use one of {divisors}")


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Layer indices of each stage, equal contiguous slices: [range(0, L/S), range(L/S, 2L/S), ...]."""
    check_pipeline(num_stages, 1, num_layers=num_layers)
    per = num_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


def gpipe_order(num_stages: int, num_microbatches: int) -> dict[int, list[Op]]:
    """GPipe: every forward, then every backward; rank s holds stage s."""
    check_pipeline(num_stages, num_microbatches)
    M = num_microbatches
    return {s: [Op(FORWARD, m, s) for m in range(M)] + [Op(BACKWARD, m, s) for m in range(M)]
            for s in range(num_stages)}


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """The 1F1B order of one stage: warm-up forwards, then one forward / one backward, then cool-down.

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


def dualpipev_stages(num_ranks: int, rank: int) -> tuple[int, int]:
    """DualPipeV's V: rank r holds stage r (going down) and stage 2P-1-r (coming back up)."""
    return rank, 2 * num_ranks - 1 - rank


def dualpipev_order(num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """DualPipeV (DualPipe folded into a V on P ranks and 2P stages), rank by rank.

    The eight phases of DeepSeek's open-source DualPipeV, as `torch.distributed.pipelining.
    ScheduleDualPipeV` lays them out: forwards fill the V from both ends, the steady phase
    pairs a forward of one chunk with a backward of the other (an overlapped pair), and the
    tail splits backwards into I and W so that weight gradients fill the last bubbles.
    """
    P, M = num_ranks, num_microbatches
    check_pipeline(P, M)
    if M < 2 * P:
        raise PipelineError(f"num_microbatches={M}: DualPipeV needs at least 2 x num_ranks = {2 * P} "
                            "micro-batches (one per stage)")
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
    split = False                                                             # 6: B1 B0, then zero bubble
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


def simulate(orders: dict[int, list], costs: Costs | dict[int, Costs] = Costs()) -> PipelineTimeline:
    """Run every rank's ordered actions; each starts when its rank is free and its inputs have arrived.

    orders: rank -> [Op or (Op, Op)] (a pair runs as one overlapped action costing the sum).
    costs: one Costs for every stage, or stage -> Costs. Dependencies: F(m, s) needs F(m, s-1);
    B or I (m, s) needs F(m, s) and the input gradient from stage s+1 (its B or I); W(m, s)
    needs I(m, s). A dependency on another rank adds `comm`. Raises PipelineError when an op
    is missing or repeated, or when the orders deadlock (each rank waits for another).
    """
    stage_rank = {}
    for rank, actions in orders.items():
        for op in _ops(actions):
            if stage_rank.setdefault(op.stage, rank) != rank:
                raise PipelineError(f"stage {op.stage} appears on ranks {stage_rank[op.stage]} and {rank}: "
                                    "a stage lives on one rank")
    num_stages = max(stage_rank) + 1
    cost = (lambda s: costs[s]) if isinstance(costs, dict) else (lambda s: costs)
    _check_complete(orders, num_stages)
    done: dict[tuple, tuple[float, int]] = {}             # (kind, m, s) -> (finish time, rank)
    free = {rank: 0.0 for rank in orders}
    position = {rank: 0 for rank in orders}
    events = []

    def ready(op: Op, rank: int) -> float | None:
        needs = []
        if op.kind == FORWARD and op.stage > 0:
            needs.append([(FORWARD, op.microbatch, op.stage - 1)])
        if op.kind in (BACKWARD, BACKWARD_INPUT):
            needs.append([(FORWARD, op.microbatch, op.stage)])
            if op.stage < num_stages - 1:
                needs.append([(BACKWARD, op.microbatch, op.stage + 1), (BACKWARD_INPUT, op.microbatch, op.stage + 1)])
        if op.kind == BACKWARD_WEIGHT:
            needs.append([(BACKWARD_INPUT, op.microbatch, op.stage)])
        time = 0.0
        for alternatives in needs:
            hit = next((done[key] for key in alternatives if key in done), None)
            if hit is None:
                return None
            finish, where = hit
            time = max(time, finish + (cost(op.stage).comm if where != rank else 0.0))
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
                free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in orders.items() if position[r] < len(a)}
            raise PipelineError(f"the schedule deadlocks: every rank waits for another ({stuck}); "
                                "a backward must come after its forward, stage s after stage s-1")
    return PipelineTimeline(events, num_ranks=len(orders))


def _ops(actions):
    for action in actions:
        yield from (action if isinstance(action, tuple) else (action,))


def _check_complete(orders: dict[int, list], num_stages: int) -> None:
    seen: dict[tuple, int] = {}
    for actions in orders.values():
        for op in _ops(actions):
            if op.kind not in KINDS:
                raise PipelineError(f"op kind {op.kind!r}: use one of {KINDS}")
            key = (op.kind, op.microbatch, op.stage)
            seen[key] = seen.get(key, 0) + 1
    repeated = [k for k, n in seen.items() if n > 1]
    if repeated:
        raise PipelineError(f"ops scheduled twice: {repeated[:3]}")
    microbatches = {m for _, m, _ in seen}
    for m in microbatches:
        for s in range(num_stages):
            full = (BACKWARD, m, s) in seen
            split = (BACKWARD_INPUT, m, s) in seen and (BACKWARD_WEIGHT, m, s) in seen
            if (FORWARD, m, s) not in seen or full == split:
                raise PipelineError(f"micro-batch {m} at stage {s} needs one forward and either one B or one "
                                    "I plus one W")


def bubble_formulas(num_ranks: int, num_microbatches: int, costs: Costs = Costs()) -> dict[str, float]:
    """The closed forms, as bubble time over compute time, and GPipe/1F1B's exact share of the total.

    `costs` are one rank's work per micro-batch (DualPipeV's chunks are half of it).
    dualpipe_table: DeepSeek-V3's table, (PP/2 - 1)(F&B + B - 3W) for DualPipe on PP ranks;
    DualPipeV is DualPipe on half the ranks, so on P ranks it idles (P - 1)(F&B + B - 3W) with
    chunk costs, taking F&B = F + B (no compute overlap).
    """
    P, M = num_ranks, num_microbatches
    f, b = costs.forward, costs.backward
    chunk = costs.scaled(0.5)
    w = chunk.of(BACKWARD_WEIGHT)
    dualpipev_idle = (P - 1) * ((chunk.forward + chunk.backward) + chunk.backward - 3 * w)
    return {"gpipe_1f1b_source": (P - 1) / M, "gpipe_1f1b_share": (P - 1) / (M + P - 1),
            "dualpipe_source": (P - 1) / (2 * M), "dualpipev_table": dualpipev_idle / (M * (f + b))}


SCHEDULES = ("gpipe", "1f1b", "dualpipev")


def schedule_orders(schedule: str, num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """Rank -> actions for a named schedule on `num_ranks` ranks (DualPipeV: 2 stages per rank)."""
    if schedule == "gpipe":
        return gpipe_order(num_ranks, num_microbatches)
    if schedule == "1f1b":
        return one_f_one_b_schedule(num_ranks, num_microbatches)
    if schedule == "dualpipev":
        return dualpipev_order(num_ranks, num_microbatches)
    raise PipelineError(f"schedule={schedule!r}: use one of {SCHEDULES}")


def simulate_schedule(schedule: str, num_ranks: int, num_microbatches: int,
                      costs: Costs = Costs()) -> PipelineTimeline:
    """Simulate a named schedule with `costs` per rank and micro-batch (DualPipeV's chunks cost half)."""
    orders = schedule_orders(schedule, num_ranks, num_microbatches)
    return simulate(orders, costs.scaled(0.5) if schedule == "dualpipev" else costs)


OP_COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", BACKWARD_INPUT: "#C44E52", BACKWARD_WEIGHT: "#8C8C8C"}


def plot_pipeline(timeline: PipelineTimeline, ax=None, title: str = ""):
    """Draw one row per rank, one box per op (labelled with its micro-batch); returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * timeline.num_ranks))
    t0 = min(e.start for e in timeline.events)
    for e in timeline.events:
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, color=OP_COLORS[e.op.kind], edgecolor="white", height=0.8)
        if e.end - e.start > 0.02 * timeline.makespan:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.op.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.invert_yaxis()
    ax.set(xlabel="time", title=f"{title}  idle share {timeline.bubble_share:.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OP_COLORS.values()]
    ax.legend(handles, ["forward", "backward", "backward (inputs)", "backward (weights)"], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
