"""Wall time to a target accuracy: synchronous against asynchronous RL on the long-tail workload, in pairs.

    python benchmarks/async_vs_sync.py                          # 3 repeats of sync and eta = 1 (no correction)
    python benchmarks/async_vs_sync.py --eta 2 --correction tis # another setting, named before the race
    python benchmarks/async_vs_sync.py --quick                  # 1 repeat of a few steps (a notebook cell)
    python benchmarks/async_vs_sync.py --out runs/bench07       # summary.json there (default runs/latest)

The last line printed is `async_speedup: X (eta E, final F, target T, n N)`. The asynchronous
setting is the one named on the command line (`--eta`, default 1, and `--correction`, default
none: the setting notebook 07 names before its runs), declared before any run: the script never picks the
best of several settings after seeing their results. X is the median over the N repeats of sync's
time to the target over the setting's (0 in a repeat where the setting did not reach it); F is the
setting's final held-out accuracy and T the target (medians over the repeats). X > 1: async is
faster. The line before it gives each repeat's speedup, with the min and max.

The rule, the same in every repeat:
  - the target is sync's plateau minus `--tolerance` (3 points): the plateau is the median of the
    synchronous run's last `--plateau` held-out evaluations (3), not its last one, which may be a
    lucky blip;
  - a run reaches the target at the first evaluation from which its held-out accuracy stays at or
    above the target to the end of the run, its final evaluation included: a run that touches the
    target and falls back has not reached it (until it comes back for good);
  - both runs train the same number of steps (`--steps`, 90): async is given no extra steps.
Sync's own time to the target is read with the same rule (a repeat in which sync itself does not
stay above its target is left out of the median, and the script says so). The rule is
`minirl.runtime.async_snapshots.speedup_to_target`, which notebook 07 uses too.

What is compared. Every run is `minirl.runtime.async_run.train_async` on the same config (the
chapter's defaults: the embedded policy, 16 prompts x 8 completions per step, learning rate
1e-4, 4 producer threads sampling 4 prompts per call, the calculator tool's lognormal latency
with median 10 ms and sigma 1.5, timeout 5 s); only `max_staleness` (and the correction)
differ. eta = 0 is synchronous RL: producers make one batch per version, the trainer waits
for its slowest trajectory. Held-out accuracy is measured after each run on weight snapshots
every `--snapshot-every` steps (evaluation is not in the wall time). Each repeat runs sync and the
setting one after the other with the same seed (a new seed per repeat), sync first in even
repeats and the setting first in odd ones, so that the machine's load hits them alike.

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

from minirl.config import RLConfig
from minirl.models.policy import greedy_accuracy, load_default_policy
from minirl.runtime.argtypes import float_in, int_in
from minirl.runtime.async_config import AsyncConfig
from minirl.runtime.async_run import train_async
from minirl.runtime.async_snapshots import evaluate_snapshots, speedup_to_target
from minirl.runtime.io import write_summary
from minirl.runtime.validate import check_choice
from minirl.tasks.arithmetic import make_task


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int_in(1), default=3)
    parser.add_argument("--steps", type=int_in(1), default=90, help="trainer steps of every run, sync and async")
    parser.add_argument("--eta", type=int_in(1), default=1, help="the async setting's staleness bound (default 1)")
    parser.add_argument("--correction", default="none", help="the async setting's correction: none, areal, tis")
    parser.add_argument("--snapshot-every", type=int_in(1), default=5)
    parser.add_argument("--plateau", type=int_in(1), default=3,
                        help="sync's last evaluations whose median is its plateau (default 3)")
    parser.add_argument("--tolerance", type=float_in(0.0), default=0.03)
    parser.add_argument("--env-latency", type=float_in(0.0), default=AsyncConfig().env_latency)
    parser.add_argument("--env-latency-sigma", type=float_in(0.0), default=AsyncConfig().env_latency_sigma)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 12 steps, snapshots every 3")
    parser.add_argument("--out", type=Path, default=Path("runs") / "latest")
    args = parser.parse_args(argv)
    try:
        check_choice("correction", args.correction, ("none", "areal", "tis"))
    except ValueError as err:
        parser.error(f"argument --correction: {err}")
    if args.quick:
        args.repeats, args.steps, args.snapshot_every = 1, 12, 3
    return args


def one_run(eta: int, correction: str, seed: int, args, task) -> dict:
    model, tokenizer, _ = load_default_policy(progress=False)
    config = RLConfig().replace(steps=args.steps, learning_rate=1e-4, seed=seed)
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
    setting = f"eta={args.eta} {args.correction}"
    print(f"declared setting: {setting}; {args.repeats} repeats of sync and {setting}, {args.steps} steps each; "
          f"target: the median of sync's last {args.plateau} evaluations - {args.tolerance:.2f}", flush=True)
    repeats = []
    for repeat in range(args.repeats):
        order = ("sync", setting) if repeat % 2 == 0 else (setting, "sync")
        runs = {name: one_run(0 if name == "sync" else args.eta, "none" if name == "sync" else args.correction,
                              repeat, args, task) for name in order}
        sync, run = runs["sync"], runs[setting]
        rule = speedup_to_target(sync["curve"], run["curve"], args.plateau, args.tolerance)
        target, sync_t, t, speedup = rule["target"], rule["sync_s"], rule["run_s"], rule["speedup"]
        repeats.append({"repeat": repeat, "order": list(order), "target": target, "sync": sync, "async": run,
                        "sync_to_target": sync_t, "async_to_target": t, "speedup": speedup,
                        "share_of_sync": t / sync["seconds"]})
        print(f"repeat {repeat} ({order[0]} first): target {target:.3f}; sync {sync['seconds']:.1f} s, final "
              f"{sync['accuracy_after']:.3f}, at the target for good from {sync_t:.1f} s; {setting} "
              f"{run['seconds']:.1f} s, final {run['accuracy_after']:.3f}, from {t:.1f} s -> speedup {speedup:.2f}",
              flush=True)
    print(f"\n{'run':14s} {'traj/s':>7s} {'idle':>5s} {'stale':>5s} {'drop':>5s} {'final acc':>9s} {'target':>6s} "
          f"{'to target s':>11s} {'stayed':>6s}   (medians over repeats)")
    table = {}
    for name, key, to in (("sync", "sync", "sync_to_target"), (setting, "async", "async_to_target")):
        med = {k: statistics.median(r[key][k] for r in repeats) for k in
               ("trajectories_per_second", "trainer_idle_share", "mean_staleness", "dropped", "accuracy_after",
                "steps", "seconds")}
        med |= {"to_target": statistics.median(r[to] for r in repeats),
                "stayed": sum(math.isfinite(r[to]) for r in repeats)}
        table[name] = med
        print(f"{name:14s} {med['trajectories_per_second']:7.0f} {100 * med['trainer_idle_share']:4.0f}% "
              f"{med['mean_staleness']:5.2f} {med['dropped']:5.0f} {med['accuracy_after']:9.3f} "
              f"{statistics.median(r['target'] for r in repeats):6.3f} {med['to_target']:11.1f} "
              f"{med['stayed']:3d}/{len(repeats)}")
    counted = [r for r in repeats if not math.isnan(r["speedup"])]
    if len(counted) < len(repeats):
        print(f"sync did not stay above its own target in {len(repeats) - len(counted)} of {len(repeats)} repeats; "
              "those repeats are left out of the speedup")
    speedups = [r["speedup"] for r in counted]
    speedup = statistics.median(speedups) if speedups else 0.0
    final = statistics.median(r["async"]["accuracy_after"] for r in repeats)
    target = statistics.median(r["target"] for r in repeats)
    share = statistics.median(r["share_of_sync"] for r in repeats)
    held = args.eta <= 2 and all(math.isfinite(r["async_to_target"]) for r in repeats) and share <= 2 / 3
    print(f"bar (async at eta <= 2 reaches sync's plateau - {args.tolerance:.2f} and stays there in every repeat, "
          f"in <= 2/3 of sync's wall time): {'held' if held else 'NOT held'} ({setting}: share {share:.2f}); "
          "source: AReaL 2.77x, LlamaRL 10.4x")
    spread = (f"min {min(speedups):.2f}, max {max(speedups):.2f}" if speedups else "no repeat counted")
    print(f"{setting}: speedup per repeat {', '.join(f'{s:.2f}' for s in speedups) or '-'} ({spread}); final "
          f"accuracy {final:.3f} against the target {target:.3f}; both trained {args.steps} steps")
    write_summary(args.out, {"setting": setting, "eta": args.eta, "correction": args.correction, "steps": args.steps,
                             "table": table, "repeats": repeats, "bar_held": held, "async_speedup": speedup,
                             "async_speedups": speedups, "final_accuracy": final, "target": target})
    print(f"async_speedup: {speedup:.2f} (eta {args.eta}, final {final:.3f}, target {target:.3f}, n {len(speedups)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
