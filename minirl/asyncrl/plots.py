# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Pictures of an asynchronous run: who waited when, and accuracy against wall time and samples."""

__all__ = ["COLORS", "plot_timelines", "plot_learning_curves"]

import matplotlib.pyplot as plt

COLORS = {"generate": "tab:orange", "environment": "tab:gray", "train": "tab:blue", "wait": "tab:red"}


def plot_timelines(panels: dict[str, dict[str, list[tuple[str, float, float]]]], path=None, max_rows: int = 6):
    """One panel per run ({title: Timeline.window(...)}), a row per worker, bars colored by activity."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 1.6 * len(panels)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels.items(), strict=True):
        names = ["trainer"] + [w for w in rows if w != "trainer"][:max_rows - 1]
        t0 = min((s for w in names for _, s, _ in rows.get(w, [])), default=0.0)
        seen = set()
        for y, who in enumerate(names):
            for what, start, end in rows.get(who, []):
                ax.barh(y, max(end - start, 1e-4), left=start - t0, height=0.6, color=COLORS.get(what, "black"),
                        label=None if what in seen else what)
                seen.add(what)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set(title=title, xlabel="seconds")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


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
