"""Pictures of a Ray run: role -> node -> device, and timelines of what each worker ran (stages 6 and 7).

Hand-written plot styling (it teaches nothing about RL). The data come from the workers
themselves: `Driver.where()` (role -> "node<i>/<device><j>" for each rank) and
`Driver.timeline()` ("<pool>[rank]" -> [(what, start, end)], wall clock), or notebook 07's
timelines of its producers and trainer.

- `plot_timelines(panels, colors)`: one panel per timeline, a row per worker, a bar per
  call, colored by the part of its name before the first "." ("actor.update" -> actor);
  `last_steps_of(timeline, k)` cuts a run's timeline to its last k steps.
- `plot_placement(where)`: nodes side by side, a column per device, the roles it hosts
  stacked in it (`ROLE_COLORS`).
"""

import matplotlib.pyplot as plt

ROLE_COLORS = {"actor": "tab:blue", "rollout": "tab:orange", "reward": "tab:green", "reference": "tab:purple",
               "critic": "tab:red", "sync": "tab:gray"}


def last_steps_of(timelines: dict[str, list[tuple[str, float, float]]], steps: int) -> dict:
    """The calls that started after the `steps`-th last generate of the first rollout worker (all of them when
    it generated fewer times)."""
    generates = next(([s for what, s, _ in events if what == "rollout.generate"]
                      for events in timelines.values() if any(w == "rollout.generate" for w, _, _ in events)), [])
    since = sorted(generates)[-steps] if len(generates) >= steps else float("-inf")
    return {worker: [e for e in events if e[1] >= since] for worker, events in timelines.items()}


def plot_timelines(panels: dict[str, dict[str, list[tuple[str, float, float]]]], colors: dict[str, str], path=None,
                   *, first: str | None = None, max_rows: int | None = None, panel_height: float | None = None,
                   xlabel: str = "seconds"):
    """The one timeline plot (stages 6 and 7): a panel per timeline ({title: {worker: [(what, start, end)]}}),
    a row per worker, a bar per event colored by `colors[what before its first "."]` ("actor.update" -> the
    actor's color, "train" -> train's; black if unnamed).

    first: the worker on the top row (the others follow in their order); max_rows: at most this many rows per
    panel; panel_height: inches per panel (default 0.2 + 0.45 per row). Time starts at each panel's first bar.
    """
    rows_of = {title: ([first] if first is not None else []) + [w for w in workers if w != first]
               for title, workers in panels.items()}
    rows_of = {title: names[:max_rows] if max_rows else names for title, names in rows_of.items()}
    height = 1.2 + sum(panel_height or 0.2 + 0.45 * len(names) for names in rows_of.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height), squeeze=False)
    for ax, (title, workers) in zip(axes[:, 0], panels.items(), strict=True):
        names = rows_of[title]
        t0 = min((s for w in names for _, s, _ in workers.get(w, [])), default=0.0)
        seen = set()
        for y, who in enumerate(names):
            for what, start, end in workers.get(who, []):
                kind = what.split(".")[0]
                ax.barh(y, max(end - start, 1e-4), left=start - t0, height=0.6, color=colors.get(kind, "black"),
                        label=None if kind in seen else kind)
                seen.add(kind)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set(title=title, xlabel=xlabel)
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

