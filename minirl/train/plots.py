# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Plots of a run's records: the reward per step and the held-out accuracy."""

__all__ = ["plot_metrics"]

import matplotlib.pyplot as plt


def plot_metrics(metrics: list[dict], path=None, title: str = "stage 1"):
    """Reward per step and held-out accuracy; saved to `path` if given. Returns the figure."""
    steps = [m["step"] for m in metrics if "reward" in m]
    reward = [m["reward"] for m in metrics if "reward" in m]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, reward, lw=0.6, alpha=0.5, label="batch reward (temperature 1)")
    k = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - k + 1):i + 1]) / len(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
    ax.plot(steps, smooth, lw=1.5, label=f"reward, mean of {k}")
    evals = [(m["step"], m["accuracy"]) for m in metrics if "accuracy" in m]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out greedy accuracy")
    ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
