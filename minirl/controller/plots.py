# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Pictures of a placement: role -> node -> device, and a timeline of what each worker ran."""

__all__ = ["ROLE_COLORS", "plot_worker_timeline", "plot_placement"]

import matplotlib.pyplot as plt

ROLE_COLORS = {"actor": "tab:blue", "rollout": "tab:orange", "reward": "tab:green", "reference": "tab:purple",
               "critic": "tab:red", "sync": "tab:gray"}


def plot_worker_timeline(timelines: dict[str, list[tuple[str, float, float]]], path=None, title: str = "timeline",
                  last_steps: int | None = None):
    """One row per worker ("pool[rank]"), one bar per call, colored by role ("actor.update" -> actor).

    last_steps=k: only what started after the k-th last generate of the first rollout worker.
    """
    if last_steps:
        generates = next(([s for what, s, _ in events if what == "rollout.generate"]
                          for events in timelines.values() if any(w == "rollout.generate" for w, _, _ in events)), [])
        since = sorted(generates)[-last_steps] if len(generates) >= last_steps else float("-inf")
        timelines = {worker: [e for e in events if e[1] >= since] for worker, events in timelines.items()}
    starts = [start for events in timelines.values() for _, start, _ in events]
    t0 = min(starts) if starts else 0.0
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.45 * len(timelines)))
    seen = set()
    for row, events in enumerate(timelines.values()):
        for what, start, end in events:
            role = what.split(".")[0]
            ax.barh(row, max(end - start, 1e-4), left=start - t0, height=0.6, color=ROLE_COLORS.get(role, "black"),
                    label=None if role in seen else role)
            seen.add(role)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.invert_yaxis()
    ax.set(xlabel="seconds (wall clock)", title=title)
    if seen:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_placement(where: dict[str, list[str]], path=None, title: str = "placement"):
    """Nodes side by side, their devices as columns, each device listing the roles it hosts."""
    devices = sorted({d for ds in where.values() for d in ds}, key=lambda d: (d.split("/")[0], d))
    hosted = {d: [role for role, ds in where.items() if d in ds] for d in devices}
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(devices), 2.8))
    nodes = sorted({d.split("/")[0] for d in devices})
    for x, device in enumerate(devices):
        node = nodes.index(device.split("/")[0])
        ax.add_patch(plt.Rectangle((x - 0.45, -0.5), 0.9, 4.6, fill=False, ec="black", lw=0.8))
        ax.text(x, 4.25, device.split("/")[1], ha="center", va="center", fontsize=9)
        ax.add_patch(plt.Rectangle((x - 0.5, -0.6), 1.0, 5.3, fill=True, alpha=0.06, color=f"C{node}"))
        for y, role in enumerate(hosted[device]):
            ax.add_patch(plt.Rectangle((x - 0.4, 3.2 - 0.8 * y), 0.8, 0.65, color=ROLE_COLORS.get(role, "black"),
                                       alpha=0.8))
            ax.text(x, 3.52 - 0.8 * y, role, ha="center", va="center", color="white", fontsize=9)
    for node in nodes:
        xs = [x for x, d in enumerate(devices) if d.startswith(node + "/")]
        ax.text((xs[0] + xs[-1]) / 2, 4.95, node, ha="center", fontsize=10, weight="bold")
    ax.set(xlim=(-0.7, len(devices) - 0.3), ylim=(-0.8, 5.3), title=title)
    ax.axis("off")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
