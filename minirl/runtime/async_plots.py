"""Pictures of an asynchronous run (stage 7): learning curves, and the colors of a run's activities.

`plot_learning_curves` draws held-out accuracy against wall seconds (top panel) and against
completions trained on (bottom panel), one line per run, with the legend below both panels so
that it never covers a curve; the figure is 7 inches wide, so it reads at 1280 px.
Who waited when is drawn by notebook 06's timeline plot (`minirl.runtime.cluster_plots.plot_timelines`)
with `ACTIVITY_COLORS`, the trainer's row first.
"""

import math

import matplotlib.pyplot as plt

ACTIVITY_COLORS = {"generate": "tab:orange", "environment": "tab:gray", "train": "tab:blue", "wait": "tab:red"}


def plot_learning_curves(curves: dict[str, list[dict]], path=None, target: float | None = None):
    """Held-out accuracy against wall seconds and against completions trained on, one line per run.

    curves: {run name: [{"wall", "samples", "accuracy"}, ...]} (evaluate_snapshots' lists);
    target: a dotted horizontal line at this accuracy (None: none); path: also save it there.
    """
    rows = math.ceil((len(curves) + (target is not None)) / 3)          # legend rows, three names a row
    legend_inches = 0.22 * rows + 0.15
    height = 6.4 + legend_inches
    fig, (by_time, by_samples) = plt.subplots(2, 1, figsize=(7, height))
    styles = ["-", "--", ":", "-."]
    for i, (name, points) in enumerate(curves.items()):
        style = {"marker": ".", "ls": styles[i // 10 % len(styles)], "label": name}
        by_time.plot([p["wall"] for p in points], [p["accuracy"] for p in points], **style)
        by_samples.plot([p["samples"] for p in points], [p["accuracy"] for p in points], **style)
    for ax, xlabel in ((by_time, "wall seconds"), (by_samples, "completions trained on")):
        if target is not None:
            ax.axhline(target, color="black", lw=0.8, ls=":", label="target" if ax is by_time else None)
        ax.set(xlabel=xlabel, ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
    handles, labels = by_time.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, legend_inches / height, 1, 1))
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
