"""Plots of a time decomposition (notebook 09): stacked shares per step, a timeline of the first steps, runs side
by side.

Hand-written (plot styling). Each function takes a `minirl.profiling.decompose.Decomposition`
and an optional matplotlib axis, and returns the axis.
"""

import matplotlib.pyplot as plt

from minirl.profiling.decompose import CATEGORIES, STEP_ORDER, Decomposition, category_of, parent_of

CATEGORY_COLORS = dict(zip(CATEGORIES, ("tab:blue", "tab:olive", "tab:purple", "tab:orange", "tab:red", "tab:cyan",
                               "tab:pink", "tab:gray"), strict=True))


def plot_shares(decomposition: Decomposition, ax=None, max_bars: int = 60, title: str | None = None):
    """Category shares per step as stacked bars (consecutive steps averaged when there are more than max_bars)."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    shares = decomposition.step_shares
    width = max(1, -(-len(shares) // max_bars))
    groups = [shares[i:i + width] for i in range(0, len(shares), width)]
    x = [decomposition.steps[i] for i in range(0, len(shares), width)]
    bottom = [0.0] * len(groups)
    for category in CATEGORIES:
        heights = [sum(s[category] for s in g) / len(g) for g in groups]
        if any(heights):
            ax.bar(x, heights, width=0.9 * width, bottom=bottom, color=CATEGORY_COLORS[category], label=category,
                   align="edge")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(xlabel="step", ylabel="share of the step", ylim=(0, 1), title=title or "where each step's time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return ax


def plot_stage_timeline(decomposition: Decomposition, steps: int = 3, ax=None, title: str | None = None):
    """The first `steps` decomposed steps as a timeline: one lane per category, stages in rl_step's order.

    Sub-timers are drawn at the end of their parent's span; untimed time ("other") at the end of each step.
    """
    ax = ax or plt.subplots(figsize=(7, 2.8))[1]
    lanes = [c for c in CATEGORIES if any(s.get(c) for s in decomposition.step_shares[:steps])]
    start = 0.0
    d = decomposition                                                         # the first `steps` steps:
    shown = zip(d.per_step[:steps], d.step_seconds, d.steps, strict=False)
    for own, seconds, step in shown:
        top = sorted((s for s in own if s != "other" and parent_of(s) not in own),
                     key=lambda s: STEP_ORDER.index(s) if s in STEP_ORDER else len(STEP_ORDER))
        t = start
        for stage in top + ["other"]:
            parts = [p for p in own if p != stage and parent_of(p) == stage]
            span = own[stage] + sum(own[p] for p in parts)
            pieces = [(stage, t, own[stage])]
            offset = t + own[stage]
            for p in parts:
                pieces.append((p, offset, own[p]))
                offset += own[p]
            for name, left, width in pieces:
                category = "other" if name == "other" else category_of(name)
                if width > 0 and category in lanes:
                    ax.barh(lanes.index(category), width, left=left, color=CATEGORY_COLORS[category], edgecolor="white")
            t += span
        ax.axvline(start, color="black", lw=0.5)
        ax.text(start, len(lanes) - 0.4, f" step {step}", fontsize=8, va="bottom")
        start += seconds
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set(xlabel="seconds", title=title or f"the first {steps} steps, stage by stage")
    ax.invert_yaxis()
    return ax


def plot_compare(decompositions: dict[str, Decomposition], ax=None, title: str | None = None):
    """One horizontal stacked bar of category shares per run, labelled."""
    ax = ax or plt.subplots(figsize=(7, 0.7 + 0.6 * len(decompositions)))[1]
    for row, d in enumerate(decompositions.values()):
        left = 0.0
        for category in CATEGORIES:
            share = d.shares[category]
            if share > 0:
                ax.barh(row, share, left=left, color=CATEGORY_COLORS[category], label=category if row == 0 else None)
                if share > 0.06:
                    ax.text(left + share / 2, row, f"{100 * share:.0f}%", ha="center", va="center", fontsize=8)
                left += share
    ax.set_yticks(range(len(decompositions)), list(decompositions))
    ax.set(xlim=(0, 1), xlabel="share of the run's time", title=title or "where the time goes")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return ax
