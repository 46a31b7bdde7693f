"""Wall time to a target accuracy: synchronous against asynchronous RL on the long-tail workload, interleaved.

    python benchmarks/async_vs_sync.py                          # 3 repeats, eta = 1 and 2, no correction
    python benchmarks/async_vs_sync.py --corrections none,areal,tis   # each correction at eta = 1 and 2
    python benchmarks/async_vs_sync.py --quick                  # 1 repeat of a few steps (a notebook cell)
    python benchmarks/async_vs_sync.py --out runs/bench07       # summary.json there (default runs/latest)

The last line printed is `async_speedup: X`: for each setting, its speedup is the median over
repeats of (sync's time to the target / the setting's time to the target) within a repeat; X is
the highest speedup among the settings with eta <= 2 (the issue's bar) that reached the target
in every repeat (a setting that missed it once is not eligible; the line before names the
setting, the table lists every one). X > 1: async is faster; 0 when no setting is eligible.
Repeats in which sync did not reach its own target are left out of every setting's median (the
script says so).

What is compared. Every run is `minirl.asyncrl.runner.train_async` on the same config (the
chapter's defaults: the embedded policy, 16 prompts x 8 completions per step, learning rate
1e-4, 4 producer threads sampling 4 prompts per call, the calculator tool's lognormal latency
with median 10 ms and sigma 1.5, timeout 5 s); only `max_staleness` (and the correction)
differ. eta = 0 is synchronous RL: producers make one batch per version, the trainer waits
for its slowest trajectory. Sync runs `--sync-steps` steps; async runs `--async-steps` steps
(more: a stale step is worth less, and async must be given the chance to reach the target).
Held-out accuracy is measured after each run on weight snapshots every `--snapshot-every`
steps (evaluation is not in the wall time). The target is the sync run's final held-out
accuracy minus `--tolerance` (3 points); a run reaches it when two consecutive evaluations average
at least that much (one lucky evaluation does not count). Each repeat runs sync and every async setting one
after another with the same seed (a new seed per repeat), so the machine's load hits them
alike; figures are medians over repeats.

The issue's bar: with the default latency, async at eta <= 2 reaches the target in at most 2/3
of the sync run's wall time; the script prints whether it held, with the numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from minirl.asyncrl.runner import AsyncConfig, train_async
from minirl.asyncrl.snapshots import evaluate_snapshots, speedup_to_target, time_to_accuracy
from minirl.config import RLConfig
from minirl.models.policy import greedy_accuracy, load_default_policy
from minirl.tasks.arithmetic import make_task
from minirl.utils.argtypes import float_in, int_in, int_list
from minirl.utils.io import write_summary
from minirl.utils.validate import check_choice


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int_in(1), default=3)
    parser.add_argument("--sync-steps", type=int_in(1), default=60)
    parser.add_argument("--async-steps", type=int_in(1), default=120)
    parser.add_argument("--etas", type=int_list(1), default=[1, 2], help="async staleness bounds (default: 1,2)")
    parser.add_argument("--corrections", default="none", help="comma-separated: none, areal, tis (default: none)")
    parser.add_argument("--snapshot-every", type=int_in(1), default=5)
    parser.add_argument("--tolerance", type=float_in(0.0), default=0.03)
    parser.add_argument("--env-latency", type=float_in(0.0), default=AsyncConfig().env_latency)
    parser.add_argument("--env-latency-sigma", type=float_in(0.0), default=AsyncConfig().env_latency_sigma)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 6 sync and 12 async steps")
    parser.add_argument("--out", type=Path, default=Path("runs") / "latest")
    args = parser.parse_args(argv)
    args.corrections = [c.strip() for c in args.corrections.split(",")]
    for c in args.corrections:
        try:
            check_choice("correction", c, ("none", "areal", "tis"))
        except ValueError as err:
            parser.error(f"argument --corrections: {err}")
    if args.quick:
        args.repeats, args.sync_steps, args.async_steps, args.snapshot_every = 1, 6, 12, 3
    return args


def one_run(eta: int, correction: str, steps: int, seed: int, args, task) -> dict:
    model, tokenizer, _ = load_default_policy(progress=False)
    config = RLConfig().replace(steps=steps, learning_rate=1e-4, seed=seed)
    acfg = AsyncConfig(max_staleness=eta, correction=correction, snapshot_every=args.snapshot_every,
                       env_latency=args.env_latency, env_latency_sigma=args.env_latency_sigma)
    result = train_async(config, acfg, model, tokenizer, task.rows("train"))
    curve = evaluate_snapshots(result, model, lambda m: greedy_accuracy(m, tokenizer, task))
    return result.summary() | {"curve": curve, "eta": eta, "correction": correction}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()            # a fresh policy per run: no "Loading weights" bar each time
    task = make_task()
    settings = [(eta, c) for eta in args.etas for c in args.corrections]
    rows = []
    for repeat in range(args.repeats):
        sync = one_run(0, "none", args.sync_steps, repeat, args, task)
        target = sync["accuracy_after"] - args.tolerance
        sync_t = time_to_accuracy(sync["curve"], target, window=2)
        rows.append({"repeat": repeat, "setting": "sync", **sync, "target": target, "to_target": sync_t})
        print(f"repeat {repeat}: sync {sync['seconds']:.1f} s, accuracy {sync['accuracy_before']:.3f} -> "
              f"{sync['accuracy_after']:.3f}, target {target:.3f} reached at {sync_t:.1f} s", flush=True)
        for eta, correction in settings:
            run = one_run(eta, correction, args.async_steps, repeat, args, task)
            t = time_to_accuracy(run["curve"], target, window=2)
            rows.append({"repeat": repeat, "setting": f"eta={eta} {correction}", **run, "target": target,
                         "to_target": t, "speedup": sync_t / t if t > 0 else math.inf,  # 0 when t is inf
                         "share_of_sync": t / sync["seconds"]})
            print(f"           eta {eta} {correction:5s}: {run['seconds']:.1f} s for {args.async_steps} steps, final "
                  f"{run['accuracy_after']:.3f}, target at {t:.1f} s ({t / sync['seconds']:.2f} of sync's wall time)",
                  flush=True)
    print(f"\n{'setting':14s} {'traj/s':>7s} {'idle':>5s} {'stale':>5s} {'drop':>5s} {'final acc':>9s} "
          f"{'to target s':>11s} {'reached':>7s} {'speedup':>7s} {'share':>6s}")
    table = {}
    sync_reached = {r["repeat"] for r in rows if r["setting"] == "sync" and math.isfinite(r["to_target"])}
    for setting in ["sync"] + [f"eta={e} {c}" for e, c in settings]:
        mine = [r for r in rows if r["setting"] == setting]
        med = {k: statistics.median(r[k] for r in mine) for k in
               ("trajectories_per_second", "trainer_idle_share", "mean_staleness", "dropped", "accuracy_after",
                "to_target")}
        med["reached"] = sum(math.isfinite(r["to_target"]) for r in mine)
        if setting != "sync":
            speedups = [r["speedup"] for r in mine if r["repeat"] in sync_reached]
            med |= {"speedup": statistics.median(speedups) if speedups else math.nan,
                    "share_of_sync": statistics.median(r["share_of_sync"] for r in mine)}
        table[setting] = med
        print(f"{setting:14s} {med['trajectories_per_second']:7.0f} {100 * med['trainer_idle_share']:4.0f}% "
              f"{med['mean_staleness']:5.2f} {med['dropped']:5.0f} {med['accuracy_after']:9.3f} "
              f"{med['to_target']:11.1f} {med['reached']:4d}/{len(mine):<2d} "
              f"{med.get('speedup', 1.0):7.2f} {med.get('share_of_sync', 1.0):6.2f}")
    print("speedup: median over repeats of sync's time to target / the setting's (a repeat in which a setting missed "
          "the target counts 0); share: the setting's time to target / sync's whole run")
    if len(sync_reached) < args.repeats:
        print(f"sync missed its own target in {args.repeats - len(sync_reached)} of {args.repeats} repeats; those "
              "repeats are left out of the speedups")
    names = [f"eta={e} {c}" for e, c in settings]
    key, speedup, _ = speedup_to_target([r["to_target"] for r in rows if r["setting"] == "sync"],
                                        {n: [r["to_target"] for r in rows if r["setting"] == n] for n in names},
                                        eligible=[n for n, (e, _) in zip(names, settings, strict=True) if e <= 2])
    eligible = [n for n, (e, _) in zip(names, settings, strict=True) if e <= 2 and table[n]["reached"] == args.repeats
                and sync_reached]                              # the settings speedup_to_target chose among
    best = table[key]["share_of_sync"] if key else math.inf
    held = best <= 2 / 3
    print(f"bar (async at eta <= 2 reaches sync's final accuracy - {args.tolerance:.2f} in every repeat, in <= 2/3 "
          f"of sync's wall time): {'held' if held else 'NOT held'} (share {best:.2f}); source: AReaL 2.77x, "
          "LlamaRL 10.4x")
    if key:
        print(f"the speedup below is {key}'s: the highest median speedup to the target among the settings with "
              f"eta <= 2 that reached it in all {args.repeats} repeats")
    else:
        print("no setting with eta <= 2 reached the target in every repeat: the speedup below is 0")
    write_summary(args.out, {"table": table, "runs": rows, "bar_held": held, "async_speedup": speedup,
                             "speedup_setting": key, "eligible": eligible})
    print(f"async_speedup: {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
