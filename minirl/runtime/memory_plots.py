"""Plots of notebook 03: per-GPU training state by ZeRO stage, computed and measured.

Hand-written (plot styling): one panel per ZeRO stage, in a 2 x 2 grid 7 inches wide.
"""
import matplotlib.pyplot as plt

from minirl.memory.calculator import COMPONENTS, GB, ZERO_LEVELS, zero_per_gpu


def plot_zero(num_params, ns, measured=None, precision="mixed", gpu_gb=80, title=""):
    """Stacked per-component bars per stage against N; optional measured totals on top."""
    colors = dict(weights="#4c72b0", grads="#dd8452", master="#55a868", adam_m="#c44e52", adam_v="#8172b3")
    fig, axes = plt.subplots(2, 2, figsize=(7, 5.6), sharey=True)
    axes = axes.ravel()
    x = range(len(ns))
    for stage, ax in zip(ZERO_LEVELS, axes, strict=True):
        bottom = [0.0] * len(ns)
        for comp in COMPONENTS:
            vals = [zero_per_gpu(num_params, n, stage, precision)[comp] / GB for n in ns]
            if any(vals):
                ax.bar(x, vals, bottom=bottom, color=colors[comp], label=comp, width=0.7)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        if gpu_gb:
            ax.axhline(gpu_gb, ls="--", c="k", lw=0.8, label=f"one {gpu_gb} GB GPU")
        for (s, n), val in (measured or {}).items():
            if s == stage and n in ns:
                ax.plot(ns.index(n), val / GB, "k*", ms=12, label="measured" if n == ns[0] else None)
        ax.set(xticks=list(x), xticklabels=ns, xlabel="GPUs N", title=f"ZeRO-{stage}")
    axes[0].set_ylabel("GB per GPU")
    axes[2].set_ylabel("GB per GPU")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()


def plot_measured(psi, ns, points):
    """Calculator (FP32) stacked per component, measured per-rank state as stars; MiB per rank."""
    colors = dict(weights="#4c72b0", grads="#dd8452", adam_m="#c44e52", adam_v="#8172b3")
    fig, axes = plt.subplots(2, 2, figsize=(7, 5.6), sharey=True)
    axes = axes.ravel()
    for stage, ax in zip(ZERO_LEVELS, axes, strict=True):
        bottom = [0.0] * len(ns)
        for comp, color in colors.items():
            vals = [zero_per_gpu(psi, n, stage, "fp32")[comp] / 2**20 for n in ns]
            ax.bar(range(len(ns)), vals, bottom=bottom, color=color, width=0.7, label=comp)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for (s, n), val in points.items():
            if s == stage:
                ax.plot(ns.index(n), val / 2**20, "k*", ms=13, label="measured" if n == ns[0] else None)
        ax.set(xticks=range(len(ns)), xticklabels=ns, xlabel="ranks N", title=f"ZeRO-{stage}")
    axes[0].set_ylabel("MiB per rank")
    axes[2].set_ylabel("MiB per rank")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{psi / 1e6:.1f} M parameters, FP32: calculator (bars), measured (stars)")
    fig.tight_layout()
    plt.show()
