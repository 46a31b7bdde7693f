"""Stage 6's worker timelines: how much of each stage's driver time a Ray run spent outside the workers.

Hand-written (bookkeeping for notebook 09's decomposition of a Ray run). A stage-6 run times
each stage on the driver, so a stage's seconds include the Ray call: dispatch, arguments and
results through the object store, the driver gathering the workers' parts.

Chapter 06 writes `timeline.json`: every worker's calls as (what, start, end) wall-clock
seconds, and the steps they cover. `split_calls` cuts it into steps, takes per step and
stage the time during which some worker ran one of that stage's calls, and returns the
rest of the driver's time as `time/<stage>/rpc` (which `minirl.profiling.decompose` counts
as communication), with each worker's busy share. A missing, damaged or mismatched
timeline is said in `partial`, and the records come back unchanged.
"""

import json
from pathlib import Path

TIMELINE_FILE = "timeline.json"                 # stage 6 (chapters/06_ray.py): every Ray worker's calls
WORKER_CALLS = {"generate": ("rollout.",), "score": ("reward.",),        # worker call names ("role.method") per stage
               "reference": ("reference.", "actor.logprobs", "critic.values"), "update": ("actor.update",),
               "update_critic": ("critic.update",), "sync": ("sync.",)}


def read_timeline(run_dir, partial: list[str]) -> tuple[dict[str, list], list[int] | None] | None:
    """Stage 6's timeline.json as ({worker: [(what, start, end), ...]}, the steps it covers or None if it does not
    say); None if absent or unreadable (see partial)."""
    run_dir = Path(run_dir)
    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        try:
            ray_run = "placement" in json.loads((run_dir / "run.json").read_text())
        except (OSError, ValueError, TypeError):
            ray_run = False
        if ray_run:
            partial.append(f"a Ray run without {TIMELINE_FILE} (chapter 06 writes it since notebook 09): each "
                           "stage's time includes its Ray calls (dispatch, transfers), not separated; communication "
                           "not measured")
        return None
    try:
        saved = json.loads(path.read_text())
        steps = None if saved.get("steps") is None else [int(step) for step in saved["steps"]]
        return ({str(w): [(str(e[0]), float(e[1]), float(e[2])) for e in events] for w, events in
                 saved["workers"].items()}, steps)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        partial.append(f"{TIMELINE_FILE} does not load ({type(err).__name__}: {err}): Ray calls not separated")
        return None


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of intervals (a call timed inside another counts once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def split_calls(records: list[dict], timeline: dict[str, list], partial: list[str],
                steps: list[int] | None = None) -> tuple[list[dict], dict]:
    """(records with `time/<stage>/rpc` added, worker -> busy share): a Ray run's driver time outside the workers.

    timeline: worker -> (what, start, end) calls, wall-clock seconds; steps: the steps it
    covers (chapter 06 writes them), else the last K records, K = the generate calls of the
    first rollout worker (a file older than the records would then be misread); step k's
    calls are those that start between its generate call's start and the next one's (or
    time/step later, for the last). Per step and stage, the work is the time during which
    any worker ran one of the stage's calls (WORKER_CALLS; a union over workers: data-parallel
    ranks overlap, roles called one after another add up); the driver's time/<stage> minus
    that is `rpc`. Workers on several nodes compare wall clocks: their skew is error here.
    Records are returned unchanged (and partial says why) when the timeline does not match.
    """
    starts = next(([s for what, s, _ in events if what == "rollout.generate"] for events in timeline.values()
                   if any(what == "rollout.generate" for what, _, _ in events)), [])
    ran = ([r for r in records if r["step"] in set(steps)] if steps is not None
           else records[len(records) - len(starts):] if len(starts) <= len(records) else [])
    if not starts or len(starts) != len(ran) or (steps is not None and len(steps) != len(ran)):
        partial.append(f"{TIMELINE_FILE} holds {len(starts)} generate call(s) for steps {steps or '?'}, and "
                       f"metrics.jsonl {len(ran)} matching record(s) of {len(records)}: they do not match; Ray calls "
                       "not separated")
        return records, {}
    if len(ran) < len(records):
        partial.append(f"{TIMELINE_FILE} covers {len(ran)} of {len(records)} steps (a resumed run, or one that "
                       "stopped): Ray calls separated in those only")
    covered, out, busy, wall = {id(r): k for k, r in enumerate(ran)}, [], {w: 0.0 for w in timeline}, 0.0
    for record in records:
        if id(record) not in covered:
            out.append(record)
            continue
        k = covered[id(record)]
        end = starts[k] + record["time/step"]
        end = min(end, starts[k + 1]) if k + 1 < len(starts) else end
        calls = {w: [(what, max(s, starts[k]), min(e, end)) for what, s, e in events if starts[k] <= s < end]
                 for w, events in timeline.items()}
        record = dict(record)
        for stage, names in WORKER_CALLS.items():
            work = _busy([(s, e) for c in calls.values() for what, s, e in c if what.startswith(names)])
            if work > 0 and f"time/{stage}" in record:
                record[f"time/{stage}/rpc"] = max(0.0, record[f"time/{stage}"] - work)
        for w, c in calls.items():
            busy[w] += _busy([(s, e) for what, s, e in c if what.startswith(sum(WORKER_CALLS.values(), ()))])
        wall += record["time/step"]
        out.append(record)
    return out, {w: b / wall for w, b in busy.items()} if wall > 0 else {}
