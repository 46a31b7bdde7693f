"""The plot of a run's records: the batch reward per step and the held-out accuracy.

Hand-written plot styling (the lessons call it, it teaches nothing): `plot_metrics(records)` draws the
reward of each step's batch (sampled at the run's temperature, so pass `temperature`), its running
mean, and the held-out greedy accuracy at each evaluation, in one 7-inch panel that fits the site's
column. Notebook 01 and chapters 01 and 04 use it.
"""

import matplotlib.pyplot as plt


def plot_metrics(metrics: list[dict], path=None, title: str = "stage 1", temperature: float = 1.0):
    """Reward per step (sampled at `temperature`, the run's) and held-out accuracy; saved to `path` if given.

    Returns the figure.
    """
    steps = [m["step"] for m in metrics if "reward" in m]
    reward = [m["reward"] for m in metrics if "reward" in m]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, reward, lw=0.6, alpha=0.5, label=f"batch reward (temperature {temperature:g})")
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
