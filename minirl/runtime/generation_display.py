"""Tables and figures of notebook 05: how its measurements are shown, not what they measure.

Hand-written (display plumbing). `show(rows, header)` renders a table as Markdown in a notebook
(so a long "why" column wraps instead of running off the page) and as aligned text elsewhere;
`pct` formats a share. `draw_blocks` draws a block pool coloured by the sequence that owns
each block; `draw_timeline` draws each sequence's stays in the batch above the engine's
sequences and blocks per step; `plot_prefix_sweep` draws the prefix-cache saving, counted and
in closed form, against block size and prompt length.
"""

import matplotlib.pyplot as plt


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def show(rows, header) -> None:
    """A small table (a list of tuples under a header tuple): Markdown in IPython, aligned text otherwise."""
    rows = [tuple(str(c) for c in r) for r in [header, *rows]]
    try:
        from IPython import get_ipython  # noqa: PLC0415 (only to know where we are)
        from IPython.display import Markdown, display  # noqa: PLC0415
        in_notebook = get_ipython() is not None and type(get_ipython()).__name__ != "TerminalInteractiveShell"
    except ImportError:
        in_notebook = False
    if in_notebook:
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        lines.insert(1, "|" + "---|" * len(header))
        display(Markdown("\n".join(lines)))
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for j, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("-+-".join("-" * w for w in widths))


def draw_blocks(ax, pool, tables: dict, title: str, per_row: int = 12) -> None:
    """The pool as a grid of cells, coloured by owner; shared blocks show their reference count."""
    owner = {}
    for name, table in tables.items():
        for b in table:
            owner.setdefault(b, []).append(name)
    colours = dict(zip(tables, plt.cm.tab10.colors, strict=False))   # the first len(tables) of 10
    for b in range(pool.num_blocks):
        r, c = divmod(b, per_row)
        names = owner.get(b, [])
        face = "white" if not names else (colours[names[0]] if len(names) == 1 else "lightgrey")
        ax.add_patch(plt.Rectangle((c, -r), 0.95, 0.9, facecolor=face, edgecolor="black"))
        label = f"{b}" if not names else (f"{b}\n{names[0]}" if len(names) == 1 else f"{b}\nref {pool.ref[b]}")
        ax.text(c + 0.47, -r + 0.45, label, ha="center", va="center", fontsize=7)
    rows = -(-pool.num_blocks // per_row)
    ax.set_xlim(0, per_row)
    ax.set_ylim(-rows + 0.9, 1)
    ax.set_title(title, fontsize=8)
    ax.axis("off")


def draw_timeline(engine, seqs, title: str) -> None:
    """Each sequence's stays in the batch (a cross: preempted), then sequences and blocks per engine step."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.2), sharex=True, height_ratios=(3, 1.3))
    for row, seq in enumerate(seqs):
        for i, (first, last) in enumerate(seq.spans):
            top.barh(row, last - first + 1, left=first, color=plt.cm.tab10(row % 10), edgecolor="black", height=0.7)
            if i < len(seq.spans) - 1:
                top.plot(last + 1, row, "kx")
    top.set_ylabel("sequence")
    top.set_title(title, fontsize=8)
    timeline = engine.scheduler.timeline
    bottom.plot([r["running"] for r in timeline], label="sequences in the step")
    bottom.plot([r["blocks_used"] for r in timeline], label="blocks in use")
    bottom.axhline(engine.num_blocks, color="grey", ls=":", label="blocks in the pool")
    bottom.set_xlabel("engine step")
    bottom.legend(fontsize=7, loc="upper right")
    plt.tight_layout()
    plt.show()


def plot_prefix_sweep(sweep_bs, sweep_len, closed_form_saved, G: int = 8) -> None:
    """Saved share of prefill, counted (dots) and closed form (line): against block size, then prompt length.

    sweep_bs: [(block size, prefix_savings result)]; sweep_len: [(prompt length, result)] at 16-token blocks.
    """
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5))
    a.plot([bs for bs, _ in sweep_bs], [r["saved"] for _, r in sweep_bs], "o", label="counted")
    a.plot([bs for bs, _ in sweep_bs], [r["closed_form"] for _, r in sweep_bs], "-", label="closed form")
    a.set_xscale("log", base=2)
    a.set_xlabel(f"block size (prompts of ~{sweep_bs[0][1]['mean_prompt_len']:.0f} tokens)")
    a.set_ylabel("share of prefill saved")
    lengths = range(4, 300)
    b.plot(lengths, [closed_form_saved(n, G, 16) for n in lengths], "-", lw=0.8, label="closed form, block 16")
    b.plot([r["mean_prompt_len"] for _, r in sweep_len], [r["saved"] for _, r in sweep_len], "o", label="counted")
    b.axhline(1 - 1 / G, color="grey", ls=":", label="1 - 1/G")
    b.axhspan(0.7, 0.8, color="orange", alpha=0.15, label="source: 70-80 %")
    b.set_xlabel("prompt length (tokens)")
    b.set_ylabel("share of prefill saved")
    for ax in (a, b):
        ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
