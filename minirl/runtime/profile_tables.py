"""The tables TorchProfiler writes from one profiled step: operators, matrix products, stages, memory.

Hand-written (it teaches nothing): bookkeeping over torch.profiler's events for
`minirl.profiling.profiler.TorchProfiler`.
- `operator_totals` sums the `aten::` operators by name (calls, self time on the CPU and the
  device, FLOPs torch counted, bytes allocated); `operator_table` and `operator_text` sort
  them by self time;
- `matmul_summary`: the seconds in matrix products (`MATMULS`), their FLOPs and rate, and
  their share of the step;
- `stage_breakdown`: with the Python stack recorded, each operator is given to the call of
  `rl_step` it ran under (`STEP_CALLS`: generate, score, reference, advantages, update,
  sync), so a stage's seconds split into operators, matmuls and Python;
- `memory_summary`: the operators that allocated most, the process's peak resident memory,
  the CUDA peak.
`write_step_profile` writes a profiled step's trace, its operator table and its entry of
summary.json.
"""

import bisect
import resource
import time
from pathlib import Path

import torch

from minirl.runtime.io import atomic_write_text

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
STEP_CALLS = {"generate": "generate", "score": "score", "make_experience": "reference",  # rl_step's callees
               "correct_behaviour": "advantages", "compute_advantages": "advantages", "update": "update",
               "push": "sync"}


def operator_totals(events) -> dict[str, dict]:
    """torch operators (aten::...) summed by name over a profile's events: calls, self seconds on the CPU and on
    the device, FLOPs counted, self bytes allocated. (torch's key_averages does this too, for every event, and
    is slow with the Python stack recorded.)"""
    totals = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        t = totals.setdefault(e.name, {"calls": 0, "self_cpu_s": 0.0, "self_device_s": 0.0, "flops": 0.0,
                                       "self_cpu_bytes": 0})
        t["calls"] += 1
        t["self_cpu_s"] += e.self_cpu_time_total / 1e6
        t["self_device_s"] += getattr(e, "self_device_time_total", 0.0) / 1e6
        t["flops"] += e.flops or 0.0
        t["self_cpu_bytes"] += e.self_cpu_memory_usage
    return totals


def operator_table(totals: dict[str, dict], top: int = 15) -> list[dict]:
    """The `top` operators by self time (device time first where there is any), with their share of operator time."""
    total = sum(t["self_cpu_s"] for t in totals.values()) or 1.0
    order = sorted(totals, key=lambda n: (totals[n]["self_device_s"], totals[n]["self_cpu_s"]), reverse=True)
    return [{"name": n, **totals[n], "share_of_operator_cpu_time": totals[n]["self_cpu_s"] / total}
            for n in order[:top]]


def operator_text(totals: dict[str, dict]) -> str:
    """Every operator as a text table, by self time."""
    lines = [f"{'operator':<60} {'calls':>7} {'self CPU ms':>12} {'self device ms':>15} {'MFLOP':>12} {'self MB':>9}"]
    for row in operator_table(totals, top=len(totals)):
        lines.append(f"{row['name'][:60]:<60} {row['calls']:>7} {1e3 * row['self_cpu_s']:>12.3f} "
                     f"{1e3 * row['self_device_s']:>15.3f} {row['flops'] / 1e6:>12.1f} "
                     f"{row['self_cpu_bytes'] / 1e6:>9.2f}")
    return "\n".join(lines) + "\n"


def matmul_summary(totals: dict[str, dict], step_seconds: float) -> dict:
    """Seconds in matrix products (MATMULS, self time on the device that ran them), FLOPs torch counted, the rate."""
    mm = [totals[n] for n in MATMULS if n in totals]
    device = sum(t["self_device_s"] for t in mm)
    seconds = device if device > 0 else sum(t["self_cpu_s"] for t in mm)
    flops = float(sum(t["flops"] for t in mm))
    return {"seconds": seconds, "flops": flops, "flops_per_second": flops / seconds if seconds else 0.0,
            "share_of_step": seconds / step_seconds if step_seconds else 0.0,
            "operator_calls": sum(t["calls"] for t in totals.values())}


def stage_breakdown(events) -> dict[str, dict]:
    """Per stage of rl_step: wall seconds, seconds in torch operators and in matmuls, the rest (Python and
    dispatch), operator calls and the FLOPs torch counted. Needs the Python stack (with_stack=True); {} without.

    A stage is a call made directly by rl_step or by its `learn` or `sync_and_record` (`STEP_CALLS`; a
    critic's update is "update_critic"; decorators and context managers in between are skipped); each
    operator belongs to the stage whose call encloses it on its thread.
    """
    steps = {id(e) for e in events if e.name.endswith((": rl_step", ": learn", ": sync_and_record"))}
    spans = []
    for e in events:
        caller = e.cpu_parent
        while caller is not None and "minirl/" not in caller.name:      # past decorators (no_grad), context managers
            caller = caller.cpu_parent
        if "minirl/" in e.name and caller is not None and id(caller) in steps:
            call = e.name.rsplit(": ", 1)[-1]
            stage = "update_critic" if call == "update" and "critic" in e.name else STEP_CALLS.get(call)
            if stage is not None:
                spans.append((e.thread, e.time_range.start, e.time_range.end, stage))
    spans.sort()
    out = {}
    for _, start, end, stage in spans:
        entry = out.setdefault(stage, {"seconds": 0.0, "operator_seconds": 0.0, "matmul_seconds": 0.0,
                                       "operator_calls": 0, "flops": 0.0})
        entry["seconds"] += (end - start) / 1e6
    keys = [(thread, start) for thread, start, _, _ in spans]
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        i = bisect.bisect_right(keys, (e.thread, e.time_range.start)) - 1
        if i < 0 or spans[i][0] != e.thread or e.time_range.start > spans[i][2]:
            continue
        entry = out[spans[i][3]]
        entry["operator_seconds"] += e.self_cpu_time_total / 1e6
        entry["matmul_seconds"] += e.self_cpu_time_total / 1e6 if e.name in MATMULS else 0.0
        entry["operator_calls"] += 1
        entry["flops"] += e.flops or 0.0
    for entry in out.values():
        entry["python_seconds"] = max(0.0, entry["seconds"] - entry["operator_seconds"])
    return out


def memory_summary(totals: dict[str, dict], top: int = 5) -> dict:
    """The operators that allocated most (self bytes), the process's peak resident bytes, the CUDA peak."""
    order = sorted(totals, key=lambda n: totals[n]["self_cpu_bytes"], reverse=True)
    out = {"top_allocators": [{"name": n, "self_cpu_bytes": totals[n]["self_cpu_bytes"]} for n in order[:top]],
           "process_peak_resident_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def write_step_profile(prof, out_dir: Path, step: int, record: dict, clocks: tuple[float, float],
                       top: int = 15) -> dict:
    """Write step `step`'s Chrome trace and operator table under out_dir; its summary (a dict).

    prof: the stopped torch.profiler.profile; record: the step's record; clocks: the
    (perf_counter, process_time) when profiling started, for the share of the wall time this
    process had a CPU.
    """
    wall, cpu = time.perf_counter() - clocks[0], time.process_time() - clocks[1]
    name = f"step-{step:06d}"
    trace = Path(out_dir) / f"trace_{name}.json.gz"
    prof.export_chrome_trace(str(trace))
    events = prof.events()
    totals = operator_totals(events)
    atomic_write_text(Path(out_dir) / f"ops_{name}.txt", operator_text(totals))
    seconds = record.get("time/step", 0.0)
    return {"trace": str(trace), "time_step": seconds, "cpu_share": min(1.0, cpu / wall),
            "top_operators": operator_table(totals, top), "matmul": matmul_summary(totals, seconds),
            "stages": stage_breakdown(events), "memory": memory_summary(totals)}
