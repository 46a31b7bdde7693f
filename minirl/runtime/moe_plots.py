"""The figures of notebook 08: expert load, GSPO against token-level ratios, pipeline timelines, packing.

Hand-written (plot styling; the notebook computes every number it draws, these functions only draw them).
Every figure is at most 7 inches wide with one panel per row, so that it stays legible in the site's
column, and its text is at least 9 pt; legends sit beside or below the data, not over it.

- `plot_expert_load(load_runs, tail)`: the hottest expert's load over the mean per RL step, one line per
  balancing method, then per layer the share of assignments each expert received at step 1 and at the end.
- `plot_gspo_runs(runs)`: batch reward (10-step mean) and clipped share per step, one line per run.
- `plot_pipeline(timeline, ax, title)`: one row per rank, one box per op, coloured by kind;
  `plot_pipelines(timelines)` stacks several, one panel per row.
- `plot_packing(lengths, plans, budget)`: a length histogram, then each plan's bins by how full they are.
"""
import statistics

import matplotlib.pyplot as plt
import torch

OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#8C8C8C"}
OP_NAMES = ["forward", "backward", "backward (inputs)", "backward (weights)"]


def plot_expert_load(load_runs: dict, tail: int) -> None:
    """load_runs: name -> {"per_step": [steps] max/mean, "history": [steps, L, E] counts}."""
    first = next(iter(load_runs.values()))["history"]
    layers, E = first.shape[1], first.shape[2]
    fig, axes = plt.subplots(1 + layers, 1, figsize=(7, 3.0 * (1 + layers)))
    for name, run in load_runs.items():
        per_step = run["per_step"]
        smooth = [per_step[max(0, i - 4):i + 1].mean().item() for i in range(len(per_step))]
        axes[0].plot(range(1, len(smooth) + 1), smooth, label=name)
    axes[0].axhline(1.0, color="gray", ls=":", lw=1)
    axes[0].set(title="hottest expert / mean load (5-step mean)", xlabel="RL step", ylim=(0.9, None))
    axes[0].legend(fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    width = 0.8 / (len(load_runs) + 1)
    for layer, ax in enumerate(axes[1:]):
        start = first[0, layer]
        ax.bar(torch.arange(E) - 0.4 + width / 2, start / start.sum(), width, label="step 1", color="lightgray")
        for i, (name, run) in enumerate(load_runs.items(), start=1):
            last = run["history"][-tail:, layer].sum(0)
            ax.bar(torch.arange(E) - 0.4 + width * (i + 0.5), last / last.sum(), width, label=f"{name}, end")
        ax.axhline(1 / E, color="gray", ls=":", lw=1)
        ax.set(title=f"layer {layer}: share of assignments per expert", xlabel="expert", xticks=range(E))
    axes[1].legend(fontsize=9, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    plt.show()


def plot_gspo_runs(runs: dict) -> None:
    """runs: name -> the metrics list of a `train` run (rows with "reward" are steps)."""
    fig, axes = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for name, metrics in runs.items():
        steps = [m for m in metrics if "reward" in m]
        rewards = [m["reward"] for m in steps]
        smooth = [statistics.mean(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
        axes[0].plot([m["step"] for m in steps], smooth, label=name)
        axes[1].plot([m["step"] for m in steps], [m["clip_ratio/region_mean"] for m in steps], label=name)
    axes[0].set(title="batch reward (10-step mean)")
    axes[1].set(title="clipped share (tokens, or sequences for GSPO)", xlabel="step")
    axes[0].legend(fontsize=9)
    fig.tight_layout()
    plt.show()


def plot_pipeline(timeline, ax=None, title: str = ""):
    """Draw one row per rank, one box per op (labelled with its micro-batch); returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.8 + 0.45 * timeline.num_ranks))
    t0 = min(e.start for e in timeline.events)
    for e in timeline.events:
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, color=OP_COLORS[e.op.kind], edgecolor="white",
                height=0.8)
        if e.end - e.start > 0.04 * timeline.makespan:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.op.microbatch), ha="center", va="center",
                    fontsize=9, color="white")
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.invert_yaxis()
    ax.set(xlabel="time", title=f"{title}  idle share {timeline.bubble_share:.1%}")
    return ax


def plot_pipelines(timelines: dict) -> None:
    """timelines: title -> PipelineTimeline; one panel per row, one legend under the last."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(7, 1.2 + 1.5 * len(timelines)), squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
        plot_pipeline(timeline, ax=ax, title=title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OP_COLORS.values()]
    axes[-1, 0].legend(handles, OP_NAMES, fontsize=9, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    plt.show()


def plot_packing(lengths: list[int], plans: dict, budget: int) -> None:
    """lengths: tokens per sequence; plans: name -> list of bins (sequence indices); budget: tokens per bin."""
    fig, axes = plt.subplots(1 + len(plans), 1, figsize=(7, 2.4 * (1 + len(plans))))
    axes[0].hist(lengths, bins=50, color="gray")
    axes[0].set(title="long-tailed lengths (tokens)", xlabel="prompt + completion", ylabel="sequences")
    for ax, (name, plan) in zip(axes[1:], plans.items(), strict=True):
        fill = sorted((sum(lengths[i] for i in b) / budget for b in plan), reverse=True)
        full = sum(lengths) / (len(plan) * budget)
        ax.bar(range(len(fill)), fill, width=1.0, color="#4C72B0")
        ax.set(title=f"{name}: {len(plan)} bins, {full:.1%} full", xlabel="bin", ylabel="fill", ylim=(0, 1))
    fig.tight_layout()
    plt.show()
