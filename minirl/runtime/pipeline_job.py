"""Measuring a real pipeline: a small model split across ranks with `torch.distributed.pipelining`, its idle time timed.

Hand-written (a measurement harness; notebook 08 section 5 teaches the schedules and their simulator in
`minirl.parallel.pipeline`, and uses this module to time the same schedules on real processes).

- `PipelineModel` is the model every rank builds identically (same seed): an embedding, pre-norm residual
  MLP blocks (`Block`, a transformer block without attention: the schedule does not care what a stage
  computes) and a head; `PipelineModel.stage(i, n)` is stage i of n (a `StageModule`), cut by `split_layers`.
- `pipeline_worker` is the body of a `torchrun` job: every rank keeps its stage(s) and runs GPipe, 1F1B
  (`ScheduleGPipe`, `Schedule1F1B`: one stage per rank) and DualPipeV (`ScheduleDualPipeV`: two stages per
  rank, in a V) for each micro-batch count. `record_compute` wraps each stage's compute calls
  (`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`) with a timer, so the measured
  timeline has the simulator's form and the same `bubble_share` applies.
- `split_layers(L, S)` cuts L layers into S equal contiguous stages.
- `torch_dualpipev(P, M)` asks torch's `ScheduleDualPipeV` for its action lists (a private method, called
  without building a pipeline) and translates them to `Op`s, to check minirl's DualPipeV layout against.
- `launch_pipeline` checks the settings, starts the job and reads back every rank's timed calls.
- `measured_timelines`, `measured_costs` and `message_waits` turn those calls into `PipelineTimeline`s,
  median per-stage costs and the latency of one send; `compare_with_simulator` sets the measured idle share
  beside the simulator's for the measured costs (with and without that latency).

Simplified on purpose: gloo on CPU processes (NCCL when there is a GPU per rank), an MLP stack instead of
attention layers, and no optimizer step (the bubble is in forward and backward).
"""

import inspect
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minirl.parallel.pipeline import SCHEDULES, schedule_orders
from minirl.runtime.dualpipev import dualpipev_stages
from minirl.runtime.launch import output_ends, torchrun
from minirl.runtime.moe_checks import PipelineError, check_pipeline
from minirl.runtime.pipeline_sim import simulate
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


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Layer indices of each stage, equal contiguous slices: [range(0, L/S), range(L/S, 2L/S), ...]."""
    check_pipeline(num_stages, 1, num_layers=num_layers)
    per = num_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]




class Block(nn.Module):
    """x + MLP(LayerNorm(x)): a transformer block without attention."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):                                  # [b, T, H] -> [b, T, H]
        return x + self.mlp(self.norm(x))


class StageModule(nn.Module):
    """One pipeline stage: the embedding if first, a slice of the blocks, the head if last."""

    def __init__(self, blocks, embed=None, head=None):
        super().__init__()
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def forward(self, x):                                  # [b, T] ids (first stage) or [b, T, H]
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x   # [b, T, V] on the last stage


class PipelineModel(nn.Module):
    """Embedding, `num_layers` blocks, final norm and head: the model every rank builds identically."""

    def __init__(self, num_layers: int = 8, hidden: int = 256, vocab: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(num_layers))
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, vocab))

    def forward(self, ids):                                # [B, T] -> [B, T, V]
        return self.stage(0, 1)(ids)

    def stage(self, index: int, num_stages: int) -> StageModule:
        """Stage `index` of `num_stages` (sharing this model's parameters)."""
        layers = split_layers(len(self.blocks), num_stages)[index]
        return StageModule([self.blocks[i] for i in layers], self.embed if index == 0 else None,
                           self.head if index == num_stages - 1 else None)


def token_loss(logits, targets):                           # [b, T, V], [b, T] -> scalar
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def record_compute(stage, events: list) -> None:
    """Time the stage's compute calls, appending (kind, micro-batch, stage, start, end) to `events`."""
    full_at = list(inspect.signature(stage.backward_one_chunk).parameters).index("full_backward")

    def timed(name, original):
        def call(*args, **kwargs):
            kind = {"forward_one_chunk": FORWARD, "backward_weight_one_chunk": BACKWARD_WEIGHT}.get(name)
            if kind is None:                               # a full backward, or only the inputs' gradient
                full = kwargs.get("full_backward", args[full_at] if len(args) > full_at else True)
                kind = BACKWARD if full else BACKWARD_INPUT
            start = time.perf_counter()
            out = original(*args, **kwargs)
            events.append((kind, args[0], stage.stage_index, start, time.perf_counter()))   # args[0]: micro-batch
            return out
        return call
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(stage, name, timed(name, getattr(stage, name)))


def build_schedule(schedule: str, model: PipelineModel, rank: int, world: int, num_microbatches: int,
                   device, events: list):
    """(the torch schedule, this rank's PipelineStages) for `schedule` on `world` ranks."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    num_stages = 2 * world if schedule == "dualpipev" else world
    indices = dualpipev_stages(world, rank) if schedule == "dualpipev" else (rank,)
    stages = [PipelineStage(model.stage(i, num_stages), i, num_stages, device) for i in indices]
    for stage in stages:
        record_compute(stage, events)
    if schedule == "dualpipev":
        return ScheduleDualPipeV(stages, num_microbatches, loss_fn=token_loss), stages
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], num_microbatches, loss_fn=token_loss), stages


def run_steps(schedule: str, model: PipelineModel, ids, targets, num_microbatches: int, repeats: int,
              device) -> list[dict]:
    """`repeats` + 1 pipeline steps (the first is a warm-up); per step this rank's events and losses."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    events: list = []
    sched, stages = build_schedule(schedule, model, rank, world, num_microbatches, device, events)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    steps = []
    for _ in range(repeats + 1):
        events.clear()
        losses: list = []
        model.zero_grad(set_to_none=True)
        dist.barrier()
        sched.step(*((ids,) if first else ()), **({"target": targets, "losses": losses} if last else {}))
        steps.append({"events": list(events), "losses": [loss.item() for loss in losses]})
    return steps[1:]


def measured_timelines(run: dict) -> list[PipelineTimeline]:
    """One PipelineTimeline per measured step of a run (events of all ranks, on the shared monotonic clock)."""
    steps = len(run["per_rank"][0]["steps"])
    timelines = []
    for i in range(steps):
        events = [Event(r["rank"], Op(kind, m, stage), start, end) for r in run["per_rank"]
                  for kind, m, stage, start, end in r["steps"][i]["events"]]
        timelines.append(PipelineTimeline(sorted(events, key=lambda e: e.start), num_ranks=run["ranks"]))
    return timelines


def measured_costs(timelines: list[PipelineTimeline]) -> dict[int, Costs]:
    """Median measured time per stage of F, B (or I + W), and the message latency -> Costs per stage."""
    by = {}
    for t in timelines:
        for e in t.events:
            by.setdefault((e.op.stage, e.op.kind), []).append(e.end - e.start)
    med = {key: statistics.median(v) for key, v in by.items()}
    latency = statistics.median([x for t in timelines for x in message_waits(t)] or [0.0])
    costs = {}
    for stage in {s for s, _ in med}:
        f = med[(stage, FORWARD)]
        i, w = med.get((stage, BACKWARD_INPUT)), med.get((stage, BACKWARD_WEIGHT))
        b = med.get((stage, BACKWARD), (i or 0) + (w or 0))
        costs[stage] = Costs(f, b, weight=w if w is not None else b / 2, comm=latency)
    return costs


def message_waits(timeline: PipelineTimeline) -> list[float]:
    """Gaps between an op's input being computed on one rank and the op starting on another, counted
    only where the receiving rank sat idle in between: the cost of one send, as the job saw it."""
    finished = {}
    for e in timeline.events:
        finished[(e.op.kind, e.op.microbatch, e.op.stage)] = e
    previous_end, waits = {}, []
    for e in sorted(timeline.events, key=lambda e: e.start):
        m, s = e.op.microbatch, e.op.stage
        sources = ([(FORWARD, m, s - 1)] if e.op.kind == FORWARD else
                   [(BACKWARD, m, s + 1), (BACKWARD_INPUT, m, s + 1)] if e.op.kind in (BACKWARD, BACKWARD_INPUT)
                   else [])
        source = next((finished[k] for k in sources if k in finished), None)
        if source is not None and source.rank != e.rank and previous_end.get(e.rank, -1e30) <= source.end:
            waits.append(e.start - source.end)
        previous_end[e.rank] = e.end
    return waits


def compare_with_simulator(result: dict) -> list[dict]:
    """Per schedule and micro-batch count: measured idle share (median over steps, and per rank) and
    the simulator's share for the measured costs, plus the pipeline's loss against the plain model's."""
    rows = []
    for run in result["runs"]:
        timelines = measured_timelines(run)
        costs = measured_costs(timelines)
        orders = schedule_orders(run["schedule"], run["ranks"], run["microbatches"])
        simulated = simulate(orders, {s: replace(c, comm=0.0) for s, c in costs.items()})
        with_latency = simulate(orders, costs)
        losses = [x for r in run["per_rank"] for x in r["steps"][0]["losses"]]
        per_rank = [statistics.median(1 - t.busy(r) / t.makespan for t in timelines) for r in range(run["ranks"])]
        rows.append({"schedule": run["schedule"], "P": run["ranks"], "M": run["microbatches"],
                     "measured": statistics.median(t.bubble_share for t in timelines),
                     "measured_per_rank": per_rank, "simulated": simulated.bubble_share,
                     "simulated_with_latency": with_latency.bubble_share,
                     "latency_seconds": next(iter(costs.values())).comm,
                     "backward_over_forward": statistics.median(c.backward / c.forward for c in costs.values()),
                     "step_seconds": statistics.median(t.makespan for t in timelines),
                     "loss": sum(losses) / len(losses), "reference_loss": result["reference_loss"]})
    return rows


def pipeline_worker(argv=None) -> None:
    """Body of the torchrun job: every schedule and micro-batch count; rank 0 writes all ranks' events."""
    import argparse

    import torch.distributed as dist

    parser = argparse.ArgumentParser(description="minirl pipeline measurement worker (run under torchrun)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cuda = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))   # one GPU per rank, else gloo on CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = PipelineModel(args.layers, args.hidden).to(device)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (args.batch, args.seq), generator=g).to(device)
        targets = torch.randint(0, 64, (args.batch, args.seq), generator=g).to(device)
        with torch.no_grad():
            reference = token_loss(model(ids), targets).item()          # the same loss without a pipeline
        runs = []
        for schedule in args.schedules.split(","):
            for m in map(int, args.microbatches.split(",")):
                steps = run_steps(schedule, model, ids, targets, m, args.repeats, device)
                everyone = [None] * world
                dist.all_gather_object(everyone, {"rank": rank, "steps": steps})
                runs.append({"schedule": schedule, "ranks": world, "microbatches": m, "per_rank": everyone})
                if rank == 0:
                    print(f"[pipeline] {schedule}, M = {m}: {args.repeats} steps measured", flush=True)
        if rank == 0:
            args.out.write_text(json.dumps({"reference_loss": reference, "runs": runs,
                                            "config": vars(args) | {"out": str(args.out)}}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch_pipeline(world_size: int = 2, schedules=SCHEDULES, microbatches=(4, 8), layers: int = 8,
                    hidden: int = 256, batch: int = 32, seq: int = 64, repeats: int = 3,
                    timeout: float = 600, progress: bool = False) -> dict:
    """Run `pipeline_worker` under `torchrun --standalone`; returns its JSON (events per rank, step and run).

    Checks the settings first: every micro-batch count must fit the batch and the layers must
    split evenly over the stages (DualPipeV has 2 per rank and needs >= 2 x world_size
    micro-batches). Raises PipelineError for those, RuntimeError with the job's output if it fails,
    subprocess.TimeoutExpired after `timeout` seconds (every rank ended: notebook 04's `torchrun`).
    progress=True prints the job's output as it comes (a line per schedule and micro-batch count).
    """
    for schedule in schedules:
        num_stages = 2 * world_size if schedule == "dualpipev" else world_size
        if schedule not in SCHEDULES:
            raise PipelineError(f"schedule={schedule!r}: use one of {SCHEDULES}")
        for m in microbatches:
            check_pipeline(num_stages, m, num_samples=batch, num_layers=layers)
            if schedule == "dualpipev" and m < num_stages:
                raise PipelineError(f"num_microbatches={m}: DualPipeV on {world_size} ranks needs >= {num_stages}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pipeline.json"
        flags = ["--schedules", ",".join(schedules), "--microbatches", ",".join(map(str, microbatches)),
                 "--layers", layers, "--hidden", hidden, "--batch", batch, "--seq", seq, "--repeats", repeats,
                 "--out", out]
        job = torchrun("minirl.runtime.pipeline_job:pipeline_worker", world_size, flags, timeout=timeout,
                       stream=progress)
        if job.returncode != 0 or not out.exists():
            raise RuntimeError(f"pipeline job (world_size={world_size}) failed with code {job.returncode}:\n"
                               f"{output_ends(job.stdout)}")
        return json.loads(out.read_text())


def torch_dualpipev(P: int, M: int) -> dict[int, list]:
    """torch's ScheduleDualPipeV action lists on P ranks for M micro-batches, translated to our Ops."""
    from torch.distributed.pipelining import schedules as torch_schedules

    kinds = {torch_schedules.FORWARD: FORWARD, torch_schedules.FULL_BACKWARD: BACKWARD,
             torch_schedules.BACKWARD_INPUT: BACKWARD_INPUT, torch_schedules.BACKWARD_WEIGHT: BACKWARD_WEIGHT}
    schedule = object.__new__(torch_schedules.ScheduleDualPipeV)        # no process group needed
    schedule.pp_group_size, schedule._n_microbatches = P, M

    def ours(action):
        if action.computation_type == torch_schedules.OVERLAP_F_B:
            return tuple(ours(a) for a in action.sub_actions)
        return Op(kinds[action.computation_type], action.microbatch_index, action.stage_index)
    return {r: [ours(a) for a in schedule._calculate_single_rank_operations(r)] for r in range(P)}
