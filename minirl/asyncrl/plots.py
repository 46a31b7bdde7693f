# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Pictures of an asynchronous run: accuracy against wall time and samples, and the colors of its activities.

Who waited when is drawn by notebook 06's timeline plot (`minirl.runtime.cluster_plots.plot_timelines`) with
`ACTIVITY_COLORS`, the trainer's row first.
"""

__all__ = ["ACTIVITY_COLORS", "plot_learning_curves"]

import matplotlib.pyplot as plt

ACTIVITY_COLORS = {"generate": "tab:orange", "environment": "tab:gray", "train": "tab:blue", "wait": "tab:red"}


def plot_learning_curves(curves: dict[str, list[dict]], path=None, target: float | None = None):
    """Held-out accuracy against wall seconds and against completions trained on, one line per run."""
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, points in curves.items():
        by_time.plot([p["wall"] for p in points], [p["accuracy"] for p in points], marker=".", label=name)
        by_samples.plot([p["samples"] for p in points], [p["accuracy"] for p in points], marker=".", label=name)
    for ax, xlabel in ((by_time, "wall seconds"), (by_samples, "completions trained on")):
        if target is not None:
            ax.axhline(target, color="black", lw=0.8, ls=":")
        ax.set(xlabel=xlabel, ylabel="held-out accuracy")
    by_samples.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
