"""Chapter 08: MoE and pipelines -- expert load and balancing, expert parallelism, GSPO, bubbles, packing.

    python chapters/08_moe_pipelines.py --out runs/08                  # everything (a few minutes on 2 cores)
    python chapters/08_moe_pipelines.py --out runs/08 --skip-torchrun  # simulated bubbles, no torchrun jobs
    python chapters/08_moe_pipelines.py --out runs/08 --rl-steps 0     # no RL training runs
    python chapters/08_moe_pipelines.py --model deepseek-ai/DeepSeek-V3 --rl-steps 0 --skip-torchrun
                                                                       # count a MoE config (no weights)

Prints the tables of notebook 08 and writes OUT/summary.json with
`bubble` (schedule -> {"ratio": the idle share of a step at P = 2 ranks and M micro-batches,
measured under torchrun or, with --skip-torchrun, simulated; "kind" says which; beside it the
simulator's share and bubble-over-compute and the source's formula (P-1)/M or (P-1)/2M}),
`packing_utilization` (method -> 0-1, long-tailed lengths), `expert_load_max_over_mean`
(before / after balancing, per method), and the details (`moe_parameters`, `gspo`,
`expert_parallel`, `packing`, `bubble_table`), plus plots (timelines, load, packing).
The RL runs use the stage-1 run (`minirl.train.run.train` with an `RLConfig`) on the tiny MoE policy.

Every flag is checked before torch and transformers are imported, and --model's config before
anything runs: a bad value exits with status 2 and one line naming the flag and the fix.
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

from minirl.runtime.argtypes import int_in
from minirl.runtime.cli import check_device, common_parser, seed_everything, write_summary

BALANCING = {"none": {}, "aux loss": {"aux_loss_coef": 0.2}, "bias": {"bias_update_rate": 0.002}}
GSPO_RUNS = {"token": dict(importance_sampling_level="token", epsilon=0.2, loss_type="grpo",
                           importance_sampling_mode="token_truncate"),
             "sequence": dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, loss_type="grpo",
                              importance_sampling_mode="sequence_truncate")}   # GSPO: grpo's sequence mean


def moe_parameters(args) -> dict:
    """Section 1: the source's illustration and real configs, counted on the meta device."""
    from transformers import AutoConfig, DeepseekV3Config, Qwen3MoeConfig

    from minirl.models.moe import count_moe_parameters

    total, active = 20e9 + 256 * 5e9, 20e9 + 8 * 5e9
    configs = {"Qwen3-30B-A3B shape": Qwen3MoeConfig(num_hidden_layers=48, head_dim=128),
               "DeepSeek-V3 defaults": DeepseekV3Config()}
    if args.model:
        configs[args.model] = AutoConfig.from_pretrained(args.model)
    counts = {name: count_moe_parameters(config) for name, config in configs.items()}
    print(f"source's illustration: {total / 1e12:.2f} T total, {active / 1e9:.0f} B active ({active / total:.1%})")
    for name, c in counts.items():
        print(f"  {name:>22}: {c['total'] / 1e9:7.1f} B total, {c['active'] / 1e9:6.2f} B active "
              f"({c['active'] / c['total']:.1%}), {c['num_experts']} experts, top-{c['top_k']}")
    return {"illustration": {"total": total, "active": active}, "configs": counts}


def expert_load(args, moe, tokenizer, task) -> tuple[dict, dict, dict]:
    """Section 2: three RL runs (no balancing, auxiliary loss, bias); load per step and layer."""
    from minirl.config import RLConfig
    from minirl.models.moe_balance import load_imbalance
    from minirl.runtime.balancing_hooks import install_balancing, load_history
    from minirl.train.run import train

    runs = {}
    for name, settings in BALANCING.items():
        model = copy.deepcopy(moe)
        install_balancing(model, **settings)
        config = RLConfig.from_flat(steps=args.rl_steps, prompts_per_step=16, eval_every=args.rl_steps, seed=args.seed)
        metrics = train(config, model, tokenizer, progress=not args.quiet)
        history = load_history(model)                                              # [steps, L, E]
        runs[name] = {"history": history, "accuracy": [m["accuracy"] for m in metrics if "accuracy" in m],
                      "per_step": [load_imbalance(h)["max_over_mean"] for h in history]}
    tail = max(1, args.rl_steps // 6)
    before = load_imbalance(runs["none"]["history"][0])["max_over_mean"]
    after = {name: load_imbalance(run["history"][-tail:].sum(0))["max_over_mean"] for name, run in runs.items()}
    hot_cold = {"before": load_imbalance(runs["none"]["history"][0])["hottest_over_coldest"],
                "after": {name: load_imbalance(run["history"][-tail:].sum(0))["hottest_over_coldest"]
                          for name, run in runs.items()}}                   # what chapter 09's expert rule reads
    print(f"expert load, hottest / mean: step 1 {before:.2f}; last {tail} steps: "
          + ", ".join(f"{n} {v:.2f}" for n, v in after.items()))
    for name, run in runs.items():
        print(f"  {name:>8}: held-out accuracy {run['accuracy'][0]:.3f} -> {run['accuracy'][-1]:.3f}")
    detail = {name: {"per_step_max_over_mean": run["per_step"], "accuracy": run["accuracy"],
                     "last_steps_per_layer": [load_imbalance(layer)["max_over_mean"]
                                              for layer in run["history"][-tail:].sum(0)]}
              for name, run in runs.items()}
    return {"before": before, "after": after, "settings": BALANCING}, hot_cold, detail


def gspo(args, moe, tokenizer, task) -> dict:
    """Section 4: token vs sequence ratio variance under routing noise, and short training runs."""
    from minirl.config import RLConfig
    from minirl.runtime.routing_bench import routing_ratio_spread
    from minirl.train.run import train

    prompts = [row["prompt"] for row in task.rows("train")[:64]]
    spread = {d: routing_ratio_spread(moe, tokenizer, prompts, rollout_dtype=d) for d in ("bfloat16", "float8_e4m3fn")}
    for d, r in spread.items():
        print(f"{d:>14} rollout: routes flipped {r['flipped_share']:.1%}, "
              f"token-ratio var {r['plain']['token_var']:.2e}, "
              f"sequence-ratio var {r['plain']['sequence_var']:.2e} ({r['plain']['variance_ratio']:.1f}x)")
    training = {}
    if args.rl_steps:
        for name, settings in GSPO_RUNS.items():
            for seed in range(args.gspo_seeds):
                config = RLConfig.from_flat(steps=args.rl_steps, prompts_per_step=16, eval_every=args.rl_steps,
                                            num_iterations=2, rollout_dtype="float8_e4m3fn",
                                            importance_sampling_correction=True, seed=seed, **settings)
                metrics = train(config, copy.deepcopy(moe), tokenizer, progress=not args.quiet)
                steps = [m for m in metrics if "reward" in m]
                training.setdefault(name, []).append(
                    {"seed": seed, "accuracy": [m["accuracy"] for m in metrics if "accuracy" in m],
                     "mean_reward": statistics.mean(m["reward"] for m in steps),
                     "clip_fraction": statistics.mean(m["clip_ratio/region_mean"] for m in steps),
                     "reward": [m["reward"] for m in steps]})
            print(f"  {name:>8}-level ratios: final accuracy "
                  + ", ".join(f"{r['accuracy'][-1]:.3f}" for r in training[name])
                  + f"; clip fraction {statistics.mean(r['clip_fraction'] for r in training[name]):.3f}")
    return {"spread": spread, "variance_ratio": spread["float8_e4m3fn"]["plain"]["variance_ratio"],
            "training": training}


def bubbles(args, out: Path) -> tuple[dict, list, dict]:
    """Section 5: the simulator's sweep, timelines, and (unless --skip-torchrun) the measured pipeline."""
    import matplotlib.pyplot as plt

    from minirl.parallel.pipeline import SCHEDULES, bubble_formulas, simulate_schedule
    from minirl.runtime.moe_plots import plot_pipeline
    from minirl.runtime.pipeline_types import Costs

    table = []
    for P, M in [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)]:
        for ratio in (1.0, 2.0, 3.0):
            costs = Costs(forward=1.0, backward=ratio)
            sim = {s: simulate_schedule(s, P, M, costs) for s in SCHEDULES}
            table.append({"P": P, "M": M, "backward_over_forward": ratio,
                          **{f"{s}_ratio": sim[s].bubble_ratio for s in SCHEDULES},
                          **{f"{s}_share": sim[s].bubble_share for s in SCHEDULES}, **bubble_formulas(P, M, costs)})
    fig, axes = plt.subplots(3, 1, figsize=(11, 6.5), sharex=True)
    for ax, schedule in zip(axes, SCHEDULES, strict=True):
        plot_pipeline(simulate_schedule(schedule, 4, 8, Costs(1.0, 2.0)), ax=ax, title=f"{schedule}, P = 4, M = 8")
    fig.tight_layout()
    fig.savefig(out / "pipeline_timelines.png", dpi=120)
    plt.close(fig)
    P, M = 2, args.microbatches[0]
    bubble = {}
    for s in SCHEDULES:
        sim = simulate_schedule(s, P, M, Costs(1.0, 2.0))
        formula = (P - 1) / (2 * M) if s == "dualpipev" else (P - 1) / M
        bubble[s] = {"P": P, "M": M, "ratio": sim.bubble_share, "kind": "simulated (B = 2F)",
                     "simulated": sim.bubble_share, "simulated_bubble_over_compute": sim.bubble_ratio,
                     "source_formula": formula}
    measured = {}
    if not args.skip_torchrun:
        from minirl.runtime.expert_job import launch_expert_parallel
        from minirl.runtime.pipeline_job import compare_with_simulator, launch_pipeline

        rows = compare_with_simulator(launch_pipeline(2, microbatches=args.microbatches, hidden=args.hidden,
                                                      repeats=args.repeats))
        for r in rows:
            print(f"  measured {r['schedule']:>9} P={r['P']} M={r['M']}: idle {r['measured']:.3f} "
                  f"(simulated {r['simulated']:.3f}, with latency {r['simulated_with_latency']:.3f}); "
                  f"loss {r['loss']:.5f} vs plain {r['reference_loss']:.5f}")
            if r["M"] == M:
                bubble[r["schedule"]].update(ratio=r["measured"], kind="measured (torchrun, gloo)",
                                             simulated=r["simulated"], per_rank=r["measured_per_rank"])
        measured["pipeline"] = rows
        ep = launch_expert_parallel(2, repeats=args.repeats)
        for r in ep["rows"]:
            print(f"  expert parallel, {r['scenario']:>15}, rank {r['rank']}: rows {r['rows_received']}, "
                  f"{r['bytes_sent'] / 1024:.0f} KiB sent, max |diff| {r['max_abs_output']:.1e}")
        measured["expert_parallel"] = ep["rows"]
    for s, b in bubble.items():
        print(f"bubble {s:>9} (P={b['P']}, M={b['M']}): idle share {b['ratio']:.3f} {b['kind']}; simulated bubble "
              f"over compute {b['simulated_bubble_over_compute']:.3f}, source's formula {b['source_formula']:.3f}")
    return bubble, table, measured


def packing(args, tokenizer, task, out: Path) -> tuple[dict, dict]:
    """Section 6: utilization per method on two length distributions, and the packed step-time gain."""
    import torch

    from minirl.config import SamplingConfig
    from minirl.memory.measure import build_measure_model
    from minirl.models.policy import load_default_policy
    from minirl.parallel.packing import utilization
    from minirl.rollout.hf import HFEngine
    from minirl.runtime.packing_bench import PACKERS, long_tail_lengths, padded_utilization, time_packed_vs_padded

    policy, _, _ = load_default_policy(progress=False)
    sampled = HFEngine(policy, tokenizer).generate([r["prompt"] for r in task.rows("train")[:64]],
                                                   SamplingConfig(num_generations=8, max_completion_length=4),
                                                   generator=torch.Generator().manual_seed(args.seed))
    distributions = {"embedded_rollouts": ((sampled.prompt_mask.sum(1) + sampled.completion_mask.sum(1)).tolist(), 64),
                     "long_tail": (long_tail_lengths(1024, seed=args.seed), 4608)}
    detail = {}
    for name, (lengths, budget) in distributions.items():
        detail[name] = {"budget": budget, "padded_8": padded_utilization(lengths, 8),
                        **{k: utilization(lengths, f(lengths, budget), budget) for k, f in PACKERS.items()}}
        print(f"packing {name:>17} (budget {budget}): " + ", ".join(f"{k} {v:.1%}" for k, v in detail[name].items()
                                                                    if k != "budget"))
    g = torch.Generator().manual_seed(args.seed)
    short = [max(2, n // 16) for n in long_tail_lengths(64, seed=args.seed + 1)]
    sequences = [torch.randint(3, 18, (n,), generator=g).tolist() for n in short]
    detail["speed"] = time_packed_vs_padded(build_measure_model("tiny"), sequences, 512, 8, 0, repeats=args.repeats)
    print(f"packed vs padded step time: {detail['speed']['speedup']:.2f}x "
          f"(median of {args.repeats} interleaved rounds)")
    summary = {k: v for k, v in detail["long_tail"].items() if k != "budget"}
    return summary, detail


def plot_load(detail: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, run in detail.items():
        ax.plot(range(1, len(run["per_step_max_over_mean"]) + 1), run["per_step_max_over_mean"], label=name)
    ax.axhline(1.0, color="gray", ls=":")
    ax.set(xlabel="RL step", ylabel="hottest expert / mean", title="expert load during RL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "expert_load.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """0 when summary.json and the plots are written; 1 with a one-line error when a torchrun job fails."""
    parser = common_parser(__doc__.splitlines()[0])
    parser.set_defaults(out=Path("runs") / "08")
    parser.add_argument("--rl-steps", type=int_in(0), default=60, help="steps of each RL run (0: skip the runs)")
    parser.add_argument("--warm-start-steps", type=int_in(0), default=400,
                        help="supervised warm start of the tiny MoE")
    parser.add_argument("--gspo-seeds", type=int_in(1), default=1, help="seeds of the token vs sequence comparison")
    parser.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts (torchrun job)")
    parser.add_argument("--hidden", type=int_in(1), default=256, help="width of the pipeline job's model")
    parser.add_argument("--repeats", type=int_in(1), default=3,
                        help="measured repeats (pipeline, expert parallel, packing)")
    parser.add_argument("--skip-torchrun", action="store_true", help="simulate the bubbles; no torchrun jobs")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.microbatches = tuple(int(m) for m in args.microbatches.split(","))
    except ValueError:
        parser.error(f"argument --microbatches: {args.microbatches!r}: use comma-separated integers, e.g. 4,8")
    from minirl.parallel.pipeline import schedule_orders
    from minirl.runtime.moe_checks import PipelineError, check_pipeline

    try:                                                  # fail before any work: the job has 32 samples, 8 layers
        for m in args.microbatches:
            check_pipeline(2, m, num_samples=32, num_layers=8)
            schedule_orders("dualpipev", 2, m)
    except PipelineError as err:
        parser.error(f"argument --microbatches: {err}")
    if args.model and args.model.startswith(("/", "./", "../", "~")) and not Path(args.model).expanduser().exists():
        parser.error(f"argument --model: {args.model}: no such directory; give a model directory (with its "
                     "config.json) or a hub id such as deepseek-ai/DeepSeek-V3")
    check_device(parser, args.device)                     # imports torch: after every flag parsed
    if args.device != "cpu":
        parser.error(f"argument --device: {args.device!r}: chapter 08 runs on the CPU (gloo jobs, a tiny MoE; the "
                     "figures do not need a GPU): drop --device")
    if args.model is not None:                            # counted from its config: a bad name fails now, not later
        from minirl.runtime.model_loading import ModelSourceError, check_model_source

        try:
            check_model_source(args.model, need_tokenizer=False)
            from transformers import AutoConfig

            AutoConfig.from_pretrained(args.model)       # a hub id must be cached (or downloadable): its config
        except ModelSourceError as err:
            parser.error(f"argument --model: {err}")
        except (OSError, ValueError) as err:
            parser.error(f"argument --model: {args.model}: its config does not load ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0]})")
    import torch  # after the argument checks: they fail fast

    seed_everything(args.seed)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    from minirl.models.policy import load_default_policy
    from minirl.runtime.moe_cache import load_moe_policy
    from minirl.tasks.arithmetic import make_task

    started = time.perf_counter()
    summary = {"moe_parameters": moe_parameters(args)}
    _, tokenizer, _ = load_default_policy(progress=False)
    task = make_task()
    moe = load_moe_policy(tokenizer, task, warm_start_steps=args.warm_start_steps, seed=args.seed,
                          progress=not args.quiet)
    if args.rl_steps:
        summary["expert_load_max_over_mean"], summary["expert_load_hottest_over_coldest"], detail = expert_load(
            args, moe, tokenizer, task)
        summary["expert_load"] = detail
        plot_load(detail, args.out)
    else:
        summary["expert_load_max_over_mean"] = {"before": None, "after": {}, "skipped": "--rl-steps 0"}
        summary["expert_load_hottest_over_coldest"] = {"before": None, "after": {}, "skipped": "--rl-steps 0"}
    summary["gspo"] = gspo(args, moe, tokenizer, task)
    try:
        summary["bubble"], summary["bubble_table"], measured = bubbles(args, args.out)
    except (RuntimeError, subprocess.TimeoutExpired) as err:      # a measurement job: its output is in the message
        print(f"{err}\nerror: a torchrun job failed: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    summary.update(measured)
    summary["packing_utilization"], summary["packing"] = packing(args, tokenizer, task, args.out)
    summary["seconds"] = time.perf_counter() - started
    path = write_summary(args.out, summary)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
