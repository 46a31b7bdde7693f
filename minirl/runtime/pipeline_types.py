"""The vocabulary of notebook 08's pipeline schedules: ops, their costs, and the timeline a schedule produces.

Hand-written (plain data types; notebook 08 section 5 teaches the schedules, the simulator and the bubble
formulas in `minirl.parallel.pipeline`, which are written in these terms).

- `Op(kind, microbatch, stage)`: one unit of pipeline work. `kind` is "F" (forward), "B" (full backward),
  or the backward split in two as zero-bubble schedules do: "I" (the gradient for the stage's inputs, which
  the previous stage waits for) and "W" (the gradient for its weights, which nobody waits for). A schedule
  is, for every rank, the ordered list of its actions: an Op, or a pair (Op, Op) that DualPipe overlaps.
- `Costs`: the time of one stage's work on one micro-batch by kind (W is part of B, half by default), and
  the latency `comm` of one send; `scaled(f)` is the same for a stage f times as large.
- `Event(rank, op, start, end)`: one timed action; `PipelineTimeline`: all of them, with the makespan, each
  rank's busy time, the idle share (`bubble_share`, exercise 8.2, in `minirl.parallel.pipeline`) and the
  idle time over compute time (`bubble_ratio`, the source's form).
"""
from dataclasses import dataclass

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


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
    """One timed action: `op` ran on `rank` from `start` to `end`."""

    rank: int
    op: Op
    start: float
    end: float


@dataclass
class PipelineTimeline:
    """What a simulated or measured pipeline step produced: every op's start and end, per rank."""

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
        from minirl.parallel.pipeline import bubble_share  # the lesson's function (exercise 8.2)

        return bubble_share([(e.rank, e.start, e.end) for e in self.events], self.num_ranks)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (the source's form, (P-1)/M for GPipe and 1F1B)."""
        busy = sum(self.busy(r) for r in range(self.num_ranks))
        return (self.num_ranks * self.makespan - busy) / busy
