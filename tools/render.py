"""Render the notebooks: execute each in full mode, keep the executed copy under docs/, build the site.

    notebooks/NN_slug.py --(nbclient, full mode)--> docs/notebooks/NN_slug.ipynb  outputs and figures embedded
                                                    docs/stamps.json             {"notebooks/NN_slug.py": sha256}
                                                    docs/timings.json            seconds of its last full and smoke run
                                                    docs/index.md                the learning path, minutes, stamps
    docs/ --(MkDocs + mkdocs-jupyter, nothing re-executed)--> site/               static HTML (git-ignored)

A copy is stamped with the sha256 of the source bytes it was rendered from (in docs/stamps.json,
and in the copy's own metadata); `--check` lists every copy whose stamp no longer matches its
source. A notebook that fails keeps its previous copy and stamp, and is reported with its cell
and error. The kernel runs in notebooks/ with this checkout first on PYTHONPATH, MINIRL_SMOKE
unset, figures inline, and tqdm's text bars in place of its Jupyter widgets (a widget needs the
live kernel's JavaScript; GitHub and the static site show the text bar's last state instead).
The outputs name no directory of the machine that rendered them: the repository becomes a
relative path, the cache `~/.cache/minirl`, the home `~`, the temporary directory `$TMPDIR`
(`portable`). On the site, printed prose wraps at spaces and a printed table keeps its columns, the
last one wrapping under itself (`fit_output`, run by a MkDocs hook that mkdocs.yml names).

    python tools/render.py                 render every notebook (minutes each), then build the site
    python tools/render.py --only 00,03    render those notebooks, then build the site
    python tools/render.py --smoke         MINIRL_SMOKE=1, copies to build/render-smoke/ (a quick try:
                                           never stamped; only its time goes to docs/timings.json)
    python tools/render.py --check         list the copies to refresh; exits 0 (--strict: 1 if any)
    python tools/render.py --site          rebuild docs/index.md and site/ from the committed copies (CI)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from html import escape, unescape
from pathlib import Path

import jupytext
import nbclient
import nbformat
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
KERNEL = {  # as tools/build.py writes the .ipynb files, so the copies diff cleanly against them
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
STAMPS = "docs/stamps.json"
TIMINGS = "docs/timings.json"
COPIES = "docs/notebooks"
INDEX = "docs/index.md"
SMOKE_DIR = "build/render-smoke"
# Run in the kernel before the first cell: tqdm.auto's widget bar becomes the text bar (see the docstring).
KERNEL_SETUP = "import tqdm.auto, tqdm.std; tqdm.auto.tqdm = tqdm.std.tqdm"
INLINE = "module://matplotlib_inline.backend_inline"


class RenderError(Exception):
    """Bad input (a flag, a stamp file): the message names it, the bad value and the fix."""


class NotebookFailed(Exception):
    """A notebook that did not run to the end: `index` is its failing cell (None: before any cell)."""

    def __init__(self, nb: nbformat.NotebookNode, index: int | None, error: Exception):
        super().__init__(str(error))
        self.nb, self.index, self.error = nb, index, error


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sources(root: Path) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.py"))


def rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def select(paths: list[Path], only: str | None) -> list[Path]:
    """The notebooks `--only 00,03` names (all when None); a number with no notebook is an error."""
    if only is None:
        return paths
    by_number = {p.name[:2]: p for p in paths}
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    bad = [n for n in wanted if n not in by_number]
    if bad or not wanted:
        raise RenderError(f"--only {only!r}: no notebook numbered {', '.join(bad) or '(none given)'}; "
                          f"choose from {','.join(by_number)}")
    return [by_number[n] for n in dict.fromkeys(wanted)]


# ---------------------------------------------------------------- stamps


def read_stamps(root: Path) -> dict[str, str]:
    path = root / STAMPS
    if not path.exists():
        return {}
    try:
        stamps = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RenderError(f"{STAMPS}: not JSON ({e}); fix it or delete it and render again") from None
    if not isinstance(stamps, dict) or not all(isinstance(v, str) for v in stamps.values()):
        raise RenderError(f"{STAMPS}: expected {{\"notebooks/NN_slug.py\": \"<sha256>\"}}; fix it or delete it")
    return stamps


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old bytes or the new ones, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_stamps(root: Path, stamps: dict[str, str]) -> None:
    write_atomic(root / STAMPS, (json.dumps(dict(sorted(stamps.items())), indent=2) + "\n").encode())


def read_timings(root: Path) -> dict[str, dict[str, int]]:
    """{"notebooks/NN_slug.py": {"full": seconds, "smoke": seconds}}: each mode's last clean run, as rendered."""
    path = root / TIMINGS
    try:
        timings = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise RenderError(f"{TIMINGS}: not JSON ({e}); fix it or delete it (the next renders write it again)") from None
    if not isinstance(timings, dict) or not all(isinstance(v, dict) for v in timings.values()):
        raise RenderError(f"{TIMINGS}: expected {{\"notebooks/NN_slug.py\": {{\"full\": s, \"smoke\": s}}}}; "
                          "fix it or delete it")
    return timings


def write_timing(root: Path, source: str, mode: str, seconds: float) -> None:
    timings = read_timings(root)
    timings.setdefault(source, {})[mode] = round(seconds)
    timings = {k: dict(sorted(v.items())) for k, v in sorted(timings.items())}
    write_atomic(root / TIMINGS, (json.dumps(timings, indent=2) + "\n").encode())


# ---------------------------------------------------------------- no directory of this machine in the outputs


def machine_paths(root: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """(directory of this machine, what a reader sees instead), the longest first so the most specific wins.

    The repository becomes relative ("." alone), the policy cache `~/.cache/minirl` (where a learner's
    is by default), the home `~`, the temporary directory `$TMPDIR` and site-packages `site-packages`.
    Each is taken as written and resolved (a symlinked checkout prints either).
    """
    cache = env.get("MINIRL_CACHE") or str(Path.home() / ".cache" / "minirl")
    named = [(cache, "~/.cache/minirl"), (str(root), "."), (sysconfig.get_paths()["purelib"], "site-packages"),
             (str(Path.home()), "~"), (tempfile.gettempdir(), "$TMPDIR")]
    pairs = {}
    for directory, shown in named:
        for variant in (directory, os.path.realpath(directory)):
            variant = variant.rstrip("/\\")
            if variant and variant not in pairs and os.path.isabs(variant):
                pairs[variant] = shown
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def portable(text: str, pairs: list[tuple[str, str]]) -> str:
    """`text` with each directory of `pairs` replaced: /repo/runs/01 -> runs/01, /repo -> .

    A directory matches only whole (/repo does not match /repo2 or /repository); the temporary directory
    only with a path below it (a bare /tmp in a sentence is no path of this machine).
    """
    for directory, shown in pairs:
        below_only = shown == "$TMPDIR"

        def swap(m: re.Match, shown=shown, below_only=below_only) -> str:
            if m[1]:
                return "" if shown == "." else shown + m[1]
            return m[0] if below_only else shown

        text = re.sub(re.escape(directory) + r"(?![\w-])(?!\.\w)([/\\])?", swap, text)
    return text


TEXT_KEYS = ("text/plain", "text/html", "text/markdown", "text/latex")


def portable_outputs(nb: nbformat.NotebookNode, pairs: list[tuple[str, str]]) -> int:
    """Rewrite every text output of `nb` in place with `portable`; returns how many outputs changed."""

    def fix(value):
        return portable(value, pairs) if isinstance(value, str) else [portable(v, pairs) for v in value]

    changed = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            before = json.dumps(out, sort_keys=True)
            if out.get("output_type") == "stream":
                out["text"] = fix(out["text"])
            for key in TEXT_KEYS:
                if key in out.get("data", {}):
                    out["data"][key] = fix(out["data"][key])
            if out.get("output_type") == "error":
                out["evalue"], out["traceback"] = fix(out["evalue"]), fix(out["traceback"])
            changed += json.dumps(out, sort_keys=True) != before
    return changed


# ---------------------------------------------------------------- executing


def kernel_env(root: Path, smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = INLINE
    env.pop("MINIRL_SMOKE", None)
    if smoke:
        env["MINIRL_SMOKE"] = "1"
    return env


def source_line(text: str, cells: int, index: int) -> int | None:
    """The line of notebooks/NN_slug.py where cell `index` starts (after its `# %%`), if every cell has a marker."""
    markers = [i for i, line in enumerate(text.splitlines(), 1) if re.match(r"# ?%%", line)]
    return markers[index] + 1 if len(markers) == cells else None


def clean(nb: nbformat.NotebookNode, stamp: dict[str, str]) -> nbformat.NotebookNode:
    """The executed notebook (changed in place) with reproducible metadata: fixed ids, no jupytext header, its stamp."""
    widgets = nb.metadata.get("widgets")
    nb.metadata = nbformat.from_dict({**KERNEL, "minirl": stamp})
    if widgets:  # a notebook that shows a real widget keeps its state, or no viewer can draw it
        nb.metadata.widgets = widgets
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:03d}"
        cell.metadata.pop("lines_to_next_cell", None)
        cell.metadata.pop("execution", None)
    return nb


def execute(root: Path, path: Path, smoke: bool, timeout: int) -> nbformat.NotebookNode:
    """Run one notebook top to bottom, a line per code cell; raises NotebookFailed naming the cell."""
    nb = jupytext.read(path)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    started, current = time.perf_counter(), {"index": None, "since": 0.0}

    def on_start(cell, cell_index, **_):
        current.update(index=cell_index, since=time.perf_counter())

    def on_done(cell, cell_index, **_):
        now = time.perf_counter()
        print(f"  [{path.stem[:2]}] cell {code.index(cell_index) + 1}/{len(code)} {now - current['since']:7.1f} s"
              f"   (total {clock(now - started)})", flush=True)

    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", allow_errors=False, record_timing=False,
        coalesce_streams=True, extra_arguments=[f"--IPKernelApp.exec_lines={KERNEL_SETUP}"],
        on_cell_start=on_start, on_cell_executed=on_done, resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=kernel_env(root, smoke))
    except (CellExecutionError, CellTimeoutError, DeadKernelError, RuntimeError) as e:
        raise NotebookFailed(nb, current["index"], e) from e
    return nb


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def failure(path: Path, failed: NotebookFailed) -> str:
    """One line naming the notebook, its failing cell (number among the code cells, source line) and the error."""
    where = ""
    if failed.index is not None:
        code = [i for i, c in enumerate(failed.nb.cells) if c.cell_type == "code"]
        line = source_line(path.read_text(encoding="utf-8"), len(failed.nb.cells), failed.index)
        where = f" cell {code.index(failed.index) + 1}/{len(code)}" + (f" (line {line})" if line else "")
    error = failed.error
    if isinstance(error, CellExecutionError):
        what = f"{error.ename}: {error.evalue}"
    else:
        text = str(error).strip()
        what = f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}"
    return f"FAILED notebooks/{path.name}{where}: {what}"


def render(root: Path, paths: list[Path], smoke: bool, timeout: int) -> list[str]:
    """Execute `paths`; write each copy that ran cleanly (and its stamp unless `smoke`). Returns failures."""
    failures = []
    out = root / (SMOKE_DIR if smoke else COPIES)
    for path in paths:
        source, digest = rel(root, path), sha256(path)
        mode = "smoke" if smoke else "full"
        print(f"{source}: executing in {mode} mode (sha256 {digest[:12]})", flush=True)
        started = time.perf_counter()
        try:
            nb = execute(root, path, smoke, timeout)
        except NotebookFailed as e:
            message = failure(path, e)
            print(message + f"\n  the previous copy and stamp are kept ({rel(root, out)}/{path.stem}.ipynb)",
                  flush=True)
            failures.append(message)
            continue
        target = out / f"{path.stem}.ipynb"
        if sha256(path) != digest:  # edited while it ran: stamping it would lie
            message = f"FAILED {source}: the source changed while it was executing; render it again"
            print(message, flush=True)
            failures.append(message)
            continue
        executed = clean(nb, {"source": source, "sha256": digest, "mode": mode})
        portable_outputs(executed, machine_paths(root, kernel_env(root, smoke)))
        write_atomic(target, (nbformat.writes(executed, version=4) + "\n").encode())
        seconds = time.perf_counter() - started
        if not smoke:
            stamps = read_stamps(root)
            stamps[source] = digest
            write_stamps(root, stamps)
        write_timing(root, source, mode, seconds)
        print(f"{source}: executed in {clock(seconds)} -> {rel(root, target)}", flush=True)
    return failures


# ---------------------------------------------------------------- checking


def copy_stamp(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("minirl")
    except (OSError, json.JSONDecodeError):
        return None


def check(root: Path) -> tuple[list[str], list[str]]:
    """(lines, numbers to refresh): one line per copy that is missing, stale, inconsistent or orphaned."""
    stamps = read_stamps(root)
    lines, refresh = [], []
    present = {rel(root, p) for p in sources(root)}
    for path in sources(root):
        source, nn = rel(root, path), path.name[:2]
        target = f"{COPIES}/{path.stem}.ipynb"
        stamp, embedded = stamps.get(source), copy_stamp(root / target)
        if not (root / target).exists():
            problem = "missing (never rendered)"
        elif stamp is None:
            problem = f"not in {STAMPS}"
        elif stamp != sha256(path):
            problem = f"stale: {source} changed since it was rendered (stamp {stamp[:12]}, source {sha256(path)[:12]})"
        elif not embedded or embedded.get("sha256") != stamp or embedded.get("mode") != "full":
            problem = f"its own stamp disagrees with {STAMPS} (or it is not a full render)"
        else:
            continue
        lines.append(f"{target}: {problem}; refresh: python tools/render.py --only {nn}")
        refresh.append(nn)
    for source in sorted(set(stamps) - present):
        lines.append(f"{STAMPS}: stamps {source}, which no longer exists; delete its entry and "
                     f"{COPIES}/{Path(source).stem}.ipynb")
    for extra in sorted((root / COPIES).glob("*.ipynb")):
        if f"notebooks/{extra.stem}.py" not in present:
            lines.append(f"{rel(root, extra)}: no notebooks/{extra.stem}.py any more; delete it")
    index = root / INDEX
    if not index.exists() or index.read_text(encoding="utf-8") != index_page(root, stamps):
        lines.append(f"{INDEX}: out of date; refresh: python tools/render.py --site")
    return lines, refresh


# ---------------------------------------------------------------- the site


def learning_path(root: Path) -> list[str]:
    """The README's learning-path table, its lines as written (empty if the README has none)."""
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    m = re.search(r"^## The learning path\n(.*?)(?=^#)", text + "\n#", re.M | re.S)
    return [line for line in (m[1] if m else "").splitlines() if line.startswith("|")]


def python_requirement(root: Path) -> str:
    """pyproject.toml's requires-python in words (">=3.10": "3.10 or newer"), or "" without one."""
    path = root / "pyproject.toml"
    m = re.search(r'^requires-python\s*=\s*"([^"]+)"', path.read_text(encoding="utf-8") if path.exists() else "", re.M)
    if not m:
        return ""
    at_least = re.fullmatch(r">=\s*([\d.]+)", m[1].strip())
    return f"{at_least[1]} or newer" if at_least else m[1]


def minutes(seconds: int | None) -> str:
    if seconds is None:
        return "?"
    return "< 1" if seconds < 60 else f"{round(seconds / 60)}"


def index_page(root: Path, stamps: dict[str, str]) -> str:
    """docs/index.md: what to bring, the learning path with each notebook's minutes (smoke / full), the stamps below.

    The table is the README's learning path (its notebooks linked to their rendered copies), with a
    column of minutes read from docs/timings.json ("?" for a mode never timed); the stamps are a footnote.
    """
    rendered = {p.stem for p in (root / COPIES).glob("*.ipynb")}
    timings = read_timings(root)

    def time_of(stem: str) -> str:
        seen = timings.get(f"notebooks/{stem}.py", {})
        return f"{minutes(seen.get('smoke'))} / {minutes(seen.get('full'))}"

    def link(m: re.Match) -> str:  # [00 task](notebooks/00_x.py): to the copy, or plain text
        label, stem = m[1], m[2]
        return f"[{label}](notebooks/{stem}.ipynb)" if stem in rendered else label

    rows = learning_path(root)
    table = []
    if len(rows) >= 2:
        table += [rows[0] + " minutes: smoke / full |", rows[1] + "---|"]
        for row in rows[2:]:
            m = re.search(r"\(notebooks/(\d\d_[\w-]+)\.py\)", row)
            row = re.sub(r"\[([^\]]+)\]\(notebooks/(\d\d_[\w-]+)\.py\)", link, row)
            table.append(row + f" {time_of(m[1]) if m else ''} |")
    else:  # no table in the README: list the notebooks
        table += ["| notebook | minutes: smoke / full |", "|---|---|"]
        for path in sources(root):
            name = f"[{path.stem}](notebooks/{path.stem}.ipynb)" if path.stem in rendered else path.stem
            table.append(f"| {name} | {time_of(path.stem)} |")
    stamped = [f"{p.name[:2]} `{stamps[rel(root, p)][:12]}`" if p.stem in rendered and rel(root, p) in stamps
               else f"{p.name[:2]} not rendered yet" for p in sources(root)]
    python = python_requirement(root)
    return "\n".join([
        "# minirl notebooks",
        "",
        "Distributed RL for language models, rebuilt small enough to run on a laptop's CPU: each notebook",
        "below builds a piece of the `minirl` package and measures it, and its page shows one run of it,",
        "executed top to bottom in full mode.[^render] Work through them in order.",
        "",
        "## Before you start",
        "",
        f"- **Python {python}** in a virtual environment, then `pip install -r requirements.txt` from the"
        if python else "- **Python** in a virtual environment, then `pip install -r requirements.txt` from the",
        "  repository's root. No GPU: everything runs on the CPU, offline. The first notebook builds and",
        "  caches the tiny policy the others use (`~/.cache/minirl`).",
        "- **What to know:** Python, and PyTorch at the level of a training loop (tensors and their shapes,",
        "  autograd, an optimizer step), and that a language model gives next-token logits. The RL is built",
        "  up in the notebooks (rewards, advantages, the clipped objective); torchrun and Ray are introduced",
        "  where they are first used.",
        "- **Time:** the minutes below are what the last renders took on a 2-core machine that other jobs",
        "  shared: upper bounds, and noisy (a smoke run that met a heavier load can take longer than the full",
        "  one). *Smoke* is `MINIRL_SMOKE=1`, the quick mode CI runs (small batches, few steps); *full* is what",
        "  the pages show.",
        "- **Your figures will differ by CPU.** Times, throughputs, speedups and MFU are those of the machine",
        "  that rendered the pages; learning curves and accuracies move by a few points with the CPU's",
        "  arithmetic and the number of threads. Each verdict says what should hold on yours.",
        "",
        "## The learning path",
        "",
        *table,
        "",
        "[^render]: By `python tools/render.py`, from the sources whose sha256 begins: " + ", ".join(stamped) + ".",
        "    All of them: `docs/stamps.json`; `python tools/render.py --check` lists the pages whose source has",
        "    changed since. The minutes are in `docs/timings.json`.",
        "",
    ])


OUTPUT_PRE = re.compile(r'(<div class="jp-RenderedText[^"]*"[^>]*>\s*<pre)>(.*?)</pre>', re.S)
GAP = re.compile(r"\S {2,}(?=\S)")                   # columns two or more spaces apart
BARS = re.compile(r"\s\|\s|^\s*\||\|\s*$")          # cells between bars
RULE = re.compile(r"^\s*[-=+|: ]*[-=]{3,}[-=+|: ]*$")  # ----+------ under a header
TOKEN = re.compile(r"\S*[-/]\S*")                    # a flag, a path, a hyphenated word: never broken


def table_lines(lines: list[str]) -> list[bool]:
    """Which printed lines belong to a table: cells between bars, a rule, two column gaps, or one gap
    beside a line that has one too (a lone double space in a sentence is no table)."""
    gaps = [len(GAP.findall(line)) for line in lines]
    near = [max(gaps[i - 1] if i else 0, gaps[i + 1] if i + 1 < len(gaps) else 0) for i in range(len(gaps))]
    return [bool(BARS.search(line) or RULE.match(line)) or g >= 2 or (g == 1 and n >= 1)
            for line, g, n in zip(lines, gaps, near, strict=True)]


def last_column(line: str) -> int:
    """Where a table row's last cell starts: after its last " | " (a rule: its last + or |), else its last gap."""
    if RULE.match(line):
        return max(line.rfind("+"), line.rfind("|")) + 1
    bar = line.rfind(" | ")
    if bar >= 0:
        return bar + 3
    gaps = list(GAP.finditer(line))
    return gaps[-1].end() if gaps else 0


def fit_output(text: str) -> str:
    """One printed output (its text, not escaped) as HTML that the site's CSS fits to the column.

    A line of prose wraps at its spaces (`minirl-prose`). A table keeps its columns: the last cell
    of each row wraps under itself (`minirl-cell`, indented by --at columns) and a rule is cut at the
    column's edge (`minirl-rule`), so a table whose other columns fit needs no sideways scroll.
    Nothing breaks inside a word: a token with a hyphen or a slash (a flag, a path) stays whole.
    """

    def words(part: str) -> str:
        return TOKEN.sub(r'<span class="minirl-token">\g<0></span>', escape(part, quote=False))

    lines = text.split("\n")
    out = []
    for line, in_table in zip(lines, table_lines(lines), strict=True):
        if not line.strip():
            out.append(line)
        elif not in_table:
            out.append(f'<span class="minirl-prose">{words(line)}</span>')
        else:
            line = line.rstrip()
            at = last_column(line)
            kind = "minirl-rule" if RULE.match(line) else "minirl-cell"
            out.append(f'{escape(line[:at], quote=False)}<span class="{kind}" style="--at: {at}ch">'
                       f"{words(line[at:]) if kind == 'minirl-cell' else line[at:]}</span>")
    return "\n".join(out)


def fit_outputs(html: str) -> str:
    """A page's HTML, each printed output fitted by `fit_output` (one with markup inside, ANSI colours, as it was)."""

    def one(m: re.Match) -> str:
        if "<" in m[2]:
            return m[0]
        return m[1] + ' class="minirl-output">' + fit_output(unescape(m[2])) + "</pre>"

    return OUTPUT_PRE.sub(one, html)


def on_page_content(html: str, **_) -> str:
    """MkDocs hook (mkdocs.yml: hooks): a page's HTML with its printed outputs fitted to the column (`fit_outputs`)."""
    return fit_outputs(html)


def build_site(root: Path, site_dir: Path, write_index: bool = True) -> None:
    """Write docs/index.md (unless told not to), then build the static site from docs/ with MkDocs.

    MkDocs executes nothing: each notebook page is its executed copy, converted by nbconvert.
    """
    if write_index:
        write_atomic(root / INDEX, index_page(root, read_stamps(root)).encode())
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-q",
               "-f", str(root / "mkdocs.yml"), "-d", str(site_dir)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if done.returncode != 0:
        raise RenderError(f"mkdocs build failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    pages = list(site_dir.rglob("*.html"))
    print(f"site: {len(pages)} pages in {site_dir} (from {len(list((root / COPIES).glob('*.ipynb')))} "
          "rendered notebooks)")


# ---------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="NN[,NN]", help="render only these notebooks (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"MINIRL_SMOKE=1, copies to {SMOKE_DIR}/ only: a quick try, never stamped")
    parser.add_argument("--check", action="store_true", help="list the copies whose stamp no longer matches")
    parser.add_argument("--strict", action="store_true", help="with --check: exit 1 if any copy needs a refresh")
    parser.add_argument("--site", action="store_true", help="only rebuild docs/index.md and the site")
    parser.add_argument("--no-site", action="store_true", help="render without building the site afterwards")
    parser.add_argument("--site-dir", type=Path, help="where the site goes (default: ROOT/site)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one cell may run (default: %(default)s)")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: %(default)s)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    site_dir = (args.site_dir or root / "site").resolve()
    try:
        if sum([args.check, args.site, args.smoke]) > 1:
            raise RenderError("--check, --site and --smoke: give one at most")
        if args.timeout <= 0:
            raise RenderError(f"--timeout {args.timeout}: must be a positive number of seconds")
        if args.check:
            lines, refresh = check(root)
            for line in lines:
                print(line)
            total = len(sources(root))
            if refresh:
                print(f"render check: {total - len(refresh)} of {total} rendered copies current, "
                      f"{len(refresh)} to refresh: python tools/render.py --only {','.join(refresh)}")
            elif lines:
                print(f"render check: all {total} rendered copies current; see the lines above")
            else:
                print(f"render check: all {total} rendered copies match their sources")
            return 1 if args.strict and lines else 0
        if args.site:
            build_site(root, site_dir)
            return 0
        paths = select(sources(root), args.only)
        started = time.perf_counter()
        failures = render(root, paths, args.smoke, args.timeout)
        print(f"rendered {len(paths) - len(failures)} of {len(paths)} notebooks in "
              f"{clock(time.perf_counter() - started)}" + (f" (smoke mode, into {SMOKE_DIR}/)" if args.smoke else ""))
        if not args.smoke and not args.no_site:
            build_site(root, site_dir)
        for line in failures:
            print(line)
        return 1 if failures else 0
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
