"""What notebook 06's reproduced rows compare: the Driver's stages as a run recorded them.

Hand-written (a measurement, not a lesson). The source writes the Driver's loop as
"synchronize weights to rollout -> sample responses -> score them -> compute values with the
Critic -> compute advantages and update the Actor -> update the Critic" (`SOURCE_LOOP`).

- `recorded_iterations(timeline)` reads that loop back from a run's timeline
  (`Driver.timeline()`: worker -> [(call, start, end)], wall clock): the calls of every worker
  ordered by their recorded start, each mapped to the source's stage it performs
  (`CALL_STAGES`; every "sync.*" call is the sync), a stage that several workers ran counted
  once, and a new iteration begun at each sync, as the source's does. Step 1's calls come
  before the first sync (its weights were loaded before the run) and the last sync starts an
  iteration that never ran: both are left out. The advantages are computed in the driver just
  before the actor's update, so the update's call stands for "advantages + update actor".
  A run whose stages started in another order gives another list: `driver_order_agrees` is
  the row's verdict (every complete iteration in the source's order).
- `source_stage_shares(records)`: each stage's share of the steps' time, in the source's order
  (the chapter's summary and its per-step line).
"""

from minirl.controller.driver import SOURCE_ORDER

SOURCE_LOOP = ("sync", "sample", "score", "values", "advantages + update actor", "update critic")
CALL_STAGES = {"rollout.generate": "sample", "reward.score": "score", "critic.values": "values",
               "actor.update": "advantages + update actor", "critic.update": "update critic"}


def stage_of(call: str) -> str | None:
    """The source's stage a worker call performs ("sync.send" -> "sync"), or None (not a stage of its own)."""
    return "sync" if call.startswith("sync.") else CALL_STAGES.get(call)


def recorded_iterations(timeline: dict[str, list[tuple[str, float, float]]]) -> list[list[str]]:
    """Every complete iteration's stages in the order the timeline recorded their starts (see the module)."""
    calls = sorted((start, stage_of(what)) for events in timeline.values() for what, start, _ in events)
    iterations = []
    for _, stage in calls:
        if stage == "sync":
            if not iterations or iterations[-1][-1] != "sync":        # the first sync call of a sync stage
                iterations.append(["sync"])
        elif stage is not None and iterations and stage not in iterations[-1]:
            iterations[-1].append(stage)
    return [iteration for iteration in iterations if len(iteration) > 1]


def driver_order_agrees(timeline, source=SOURCE_LOOP) -> bool:
    """Whether the timeline holds complete iterations and every one ran the stages in the source's order."""
    iterations = recorded_iterations(timeline)
    return bool(iterations) and all(iteration == list(source) for iteration in iterations)


def source_stage_shares(records: list[dict]) -> dict[str, float]:
    """stage -> its share (0..1) of the steps' total time, in SOURCE_ORDER; "other" is what no stage timed."""
    steps = [r for r in records if "time/generate" in r]
    total = sum(r["time/step"] for r in steps) or 1.0
    shares = {stage: sum(r.get(f"time/{stage}", 0.0) for r in steps) / total for stage in SOURCE_ORDER
              if any(f"time/{stage}" in r for r in steps)}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares
