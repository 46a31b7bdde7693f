"""Build the minirl package, the exercises and the .ipynb files from the notebooks.

The jupytext "percent" files notebooks/NN_slug.py are the single source of truth:

    notebooks/NN_slug.py --+--> minirl/<module>.py       its export cells, gathered per module
                           +--> exercises/NN_slug.py     the same cells, solutions cut out
                           +--> notebooks/NN_slug.ipynb  for Jupyter, without outputs

An export cell is a code cell whose first non-blank line is `# | export minirl/tasks.py`.
Notebooks are read in filename order and cells in notebook order, so a module may gather
cells from several notebooks. In a module the cells' top-level imports are hoisted, the
first cell's docstring becomes the module docstring, and the `# BEGIN SOLUTION` /
`# END SOLUTION` marker lines are dropped. In an exercise file each marked span becomes a
`raise NotImplementedError(...)` stub.

    python tools/build.py           write what changed, delete stale generated files
    python tools/build.py --check   write nothing; exit 1 if anything is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent

# Modules under minirl/ that no notebook generates (any __init__.py is allowed as well).
HAND_WRITTEN = ("minirl/__init__.py", "minirl/grade.py", "minirl/utils/cli.py", "minirl/utils/io.py",
                "minirl/utils/rundir.py", "minirl/utils/seeding.py", "minirl/utils/timing.py",
                "minirl/utils/validate.py")

MODULE_PREFIX = "# Generated from notebooks/"
EXERCISE_PREFIX = "# Exercises of notebooks/"
OUT_OF_SYNC = "notebooks and package out of sync: run python tools/build.py"
STALE = "stale (no notebook generates it any more)"
UNLISTED = "unlisted hand-written module (add it to HAND_WRITTEN in tools/build.py)"
ORPHAN = "no notebooks/*.py source (pair it with jupytext or delete it)"

CELL_RE = re.compile(r"^# ?%%(.*)$")
EXPORT_RE = re.compile(r"^#\s*\|\s*export\s+(\S+)\s*$")
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
KERNEL = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


class BuildError(Exception):
    """A notebook that cannot be built; the message names the file and line."""


@dataclass
class Cell:
    """One export cell. Line indices are 0-based into `lines`, ast line numbers 1-based."""

    notebook: str  # "notebooks/00_task_and_policy.py"
    target: str  # "minirl/tasks.py"
    first_line: int  # notebook line number of lines[0]
    lines: list[str]  # the cell's source, with the export marker line blanked
    tree: ast.Module = None
    spans: list[tuple[int, int]] = None  # solution spans: (BEGIN index, END index)

    def where(self, index: int) -> str:
        return f"{self.notebook}:{self.first_line + index}"

    def segment(self, node: ast.stmt) -> str:
        return ast.get_source_segment("\n".join(self.lines), node)

    def docstring(self) -> ast.Expr | None:
        first = self.tree.body[0] if self.tree.body else None
        is_str = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        return first if is_str and isinstance(first.value.value, str) else None

    def imports(self) -> list[ast.Import | ast.ImportFrom]:
        return [node for node in self.tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def lines_of(node: ast.stmt) -> range:
    return range(node.lineno - 1, node.end_lineno)


# ---------------------------------------------------------------- reading notebooks


def code_cells(text: str) -> list[tuple[int, list[str]]]:
    """Split a percent-format notebook into (line number of first line, lines) per code cell."""
    cells = []
    for number, line in enumerate(text.splitlines(), 1):
        if m := CELL_RE.match(line):
            is_code = not re.search(r"\[(markdown|md|raw)\]", m[1])
            cells.append((number + 1, [] if is_code else None))
        elif cells and cells[-1][1] is not None:
            cells[-1][1].append(line)
    return [(first, lines) for first, lines in cells if lines is not None]


def export_cells(notebook: str, text: str) -> list[Cell]:
    """The export cells of one notebook, in order, parsed and checked."""
    cells = []
    for first_line, lines in code_cells(text):
        head = next((i for i, line in enumerate(lines) if line.strip()), None)
        if head is None or not (m := EXPORT_RE.match(lines[head])):
            continue
        cell = Cell(notebook, m[1], first_line, lines[:head] + [""] + lines[head + 1 :])
        path = PurePosixPath(cell.target)
        if path.parts[0] != "minirl" or len(path.parts) < 2 or path.suffix != ".py" or ".." in path.parts:
            raise BuildError(f"{cell.where(head)}: export target must be a .py file under minirl/, got {cell.target!r}")
        try:
            cell.tree = ast.parse("\n".join(cell.lines))
        except SyntaxError as e:
            raise BuildError(f"{cell.where((e.lineno or 1) - 1)}: {e.msg}") from None
        for node in cell.tree.body:
            if is_debris(node):
                raise BuildError(
                    f"{cell.where(node.lineno - 1)}: exported cells hold package code only; "
                    f"move `{ast.unparse(node)}` to a cell without the export marker"
                )
        cell.spans = solution_spans(cell)
        cells.append(cell)
    return cells


def is_debris(node: ast.stmt) -> bool:
    """A top-level `x`, `x.attr`, `print(...)`, `display(...)` or `plt.anything(...)`: notebook output."""
    if not isinstance(node, ast.Expr):
        return False
    value = node.value
    if isinstance(value, (ast.Name, ast.Attribute)):
        return True
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Name):
        return func.id in ("print", "display")
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id == "plt"


def import_group(node: ast.Import | ast.ImportFrom) -> int:
    """0 `from __future__`, 1 the standard library, 2 third party, 3 minirl's own modules."""
    if isinstance(node, ast.ImportFrom):
        if node.module == "__future__":
            return 0
        names = ["minirl"] if node.level else [node.module]
    else:
        names = [alias.name for alias in node.names]
    tops = {n.split(".")[0] for n in names}
    if tops == {"minirl"}:
        return 3
    return 1 if tops <= sys.stdlib_module_names else 2


def solution_spans(cell: Cell) -> list[tuple[int, int]]:
    spans, begin = [], None
    for i, line in enumerate(cell.lines):
        if line.strip() == BEGIN:
            if begin is not None:
                raise BuildError(f"{cell.where(i)}: nested {BEGIN} (the one at {cell.where(begin)} is still open)")
            begin = i
        elif line.strip() == END:
            if begin is None:
                raise BuildError(f"{cell.where(i)}: {END} without a {BEGIN}")
            spans.append((begin, i))
            begin = None
    if begin is not None:
        raise BuildError(f"{cell.where(begin)}: {BEGIN} without an {END} in the same cell")
    return spans


def enclosing_function(tree: ast.Module, lineno: int) -> str:
    """Name of the innermost def around 1-based line `lineno`, or "module level"."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno < lineno <= node.end_lineno:
            if best is None or node.lineno > best.lineno:
                best = node
    return best.name if best else "module level"


# ---------------------------------------------------------------- writing Python files


def body(cell: Cell, drop_docstring: bool, stubs: list[str] | None) -> str:
    """The cell's code without imports (and docstring); solutions kept, or replaced by `stubs`."""
    dropped = [*cell.imports(), cell.docstring()] if drop_docstring else cell.imports()
    edits: dict[int, str | None] = {i: None for node in dropped for i in lines_of(node)}
    for k, (begin, end) in enumerate(cell.spans):
        if stubs is None:
            edits[begin] = edits[end] = None
        else:
            edits.update({i: None for i in range(begin, end + 1)})
            line = cell.lines[begin]
            edits[begin] = line[: len(line) - len(line.lstrip())] + stubs[k]
    lines = [edits[i] if i in edits else line for i, line in enumerate(cell.lines)]
    text = "\n".join(line for line in lines if line is not None)
    return re.sub(r"\A(?:[ \t]*\n)+", "", text).rstrip()  # no blank lines around the cell


def import_block(cells: list[Cell]) -> str:
    """All top-level imports of `cells`, de-duplicated, grouped: __future__, stdlib, third party, minirl.

    Imports are kept as written, except that several `from M import ...` of one module are
    merged into a single statement (cells often import from the same module one name at a time).
    """
    froms: dict[str, list[str]] = {}           # module -> imported names, first-seen order
    for cell in cells:
        for node in cell.imports():
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = froms.setdefault(node.module, [])
                names += [n for n in (ast.unparse(a) for a in node.names) if n not in names]
    seen, groups = set(), ([], [], [], [])
    for cell in cells:
        for node in cell.imports():
            merged = isinstance(node, ast.ImportFrom) and node.level == 0
            key = ("from", node.module) if merged else ast.unparse(node)
            if key in seen:
                continue
            seen.add(key)
            text = cell.segment(node)
            if merged and froms[node.module] != [ast.unparse(a) for a in node.names]:
                text = from_import(node.module, froms[node.module])
            groups[import_group(node)].append(text)
    return "\n\n".join("\n".join(g) for g in groups if g)


def from_import(module: str, names: list[str], width: int = 100) -> str:
    """`from module import a, b`, wrapped in parentheses when longer than `width`."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= width:
        return line
    lines, current = [], f"from {module} import ("
    for name in names:
        if len(current) + len(name) + 2 > width:
            lines.append(current.rstrip())
            current = " " * (len(module) + 14)
        current += name + ", "
    return "\n".join(lines + [current.rstrip(", ") + ")"])


def assemble(head: str, imports: str, bodies: list[str], path: str) -> str:
    """Join header+docstring, imports and cell bodies with PEP 8 spacing; check it compiles."""
    text = head + ("\n\n" + imports if imports else "")
    for i, block in enumerate(b for b in bodies if b):
        # two blank lines between cells and before a top-level def/class, else one (like isort)
        text += "\n\n\n" if i or re.match(r"(@|def |async def |class )", block) else "\n\n"
        text += block
    text += "\n"
    try:
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise BuildError(f"{path}:{e.lineno}: generated code does not compile: {e.msg}") from None
    return text


def header(notebooks: list[str]) -> str:
    """The first line of a generated module; it starts with MODULE_PREFIX."""
    sources = ", ".join(sorted(set(notebooks)))
    return f"# Generated from {sources} by tools/build.py -- edit the notebook, not this file."


def render_module(target: str, cells: list[Cell]) -> str:
    first = cells[0]
    if first.docstring() is None:
        raise BuildError(f"{first.where(0)}: {target}: the first exported cell must start with a module docstring")
    head = header([c.notebook for c in cells]) + "\n" + first.segment(first.docstring())
    bodies = [body(c, drop_docstring=c is first, stubs=None) for c in cells]
    return assemble(head, import_block(cells), bodies, target)


def render_exercises(notebook: str, cells: list[Cell], firsts: dict[str, Cell]) -> str:
    """The notebook's export cells with every solution span replaced by a NotImplementedError stub."""
    nn = PurePosixPath(notebook).name[:2]
    docstring = cells[0].docstring() or firsts[cells[0].target].docstring()
    summary = next(iter(docstring.value.value.strip().splitlines()), "")
    head = (
        f"{EXERCISE_PREFIX}{PurePosixPath(notebook).name}, generated by tools/build.py"
        " -- fill in the stubs, then grade:\n"
        f"#     python -m minirl.grade --only {nn}\n"
        f'"""Exercises for notebook {nn}: {summary}\n\n'
        "Each `raise NotImplementedError` marks code to write; the docstring above it says what to return.\n"
        '"""'
    )
    bodies, count = [], 0
    for cell in cells:
        stubs = []
        for begin, _ in cell.spans:
            count += 1
            name = enclosing_function(cell.tree, begin + 1)
            stubs.append(
                f'raise NotImplementedError("exercise {int(nn)}.{count}: {name} -- see its docstring and notebook {nn}")'
            )
        bodies.append(body(cell, drop_docstring=firsts[cell.target] is cell, stubs=stubs))
    return assemble(head, import_block(cells), bodies, f"exercises/{PurePosixPath(notebook).name}")


def render_ipynb(text: str) -> str:
    """The notebook as .ipynb: no outputs, fixed metadata and cell ids, so the bytes are reproducible."""
    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata = nbformat.from_dict(KERNEL)
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:03d}"
        cell.metadata.pop("lines_to_next_cell", None)  # jupytext's round-trip hint, noise here
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nbformat.writes(nb, version=4) + "\n"


# ---------------------------------------------------------------- the build


def is_generated(path: Path) -> bool:
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline().startswith((MODULE_PREFIX, EXERCISE_PREFIX))


def package_markers(root: Path, modules: dict[str, list[Cell]]) -> dict[str, str]:
    """A generated __init__.py for each subpackage of minirl/ that exports land in, unless one is hand-written."""
    sources: dict[str, list[str]] = {}
    for target, cells in modules.items():
        parts = PurePosixPath(target).parent.parts
        for k in range(2, len(parts) + 1):
            sources.setdefault("/".join(parts[:k]), []).extend(c.notebook for c in cells)
    markers = {}
    for package, notebooks in sorted(sources.items()):
        init = f"{package}/__init__.py"
        path = root / init
        if init in modules or init in HAND_WRITTEN or path.exists() and not is_generated(path):
            continue
        markers[init] = f'{header(notebooks)}\n"""{package.replace("/", ".")}."""\n'
    return markers


def generate(root: Path) -> dict[str, str]:
    """Every generated file, as {path relative to root: content}. Reads only; raises BuildError."""
    files, by_notebook = {}, {}
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.py")):
        notebook = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        files[notebook.removesuffix(".py") + ".ipynb"] = render_ipynb(text)
        by_notebook[notebook] = export_cells(notebook, text)
    modules: dict[str, list[Cell]] = {}
    for cells in by_notebook.values():
        for cell in cells:
            modules.setdefault(cell.target, []).append(cell)
    for target, cells in modules.items():
        path = root / target
        if target in HAND_WRITTEN or path.exists() and not is_generated(path):
            raise BuildError(f"{cells[0].where(0)}: exports to {target}, a hand-written module; pick another name")
        files[target] = render_module(target, cells)
    firsts = {target: cells[0] for target, cells in modules.items()}
    for notebook, cells in by_notebook.items():
        if any(cell.spans for cell in cells):
            files[f"exercises/{PurePosixPath(notebook).name}"] = render_exercises(notebook, cells, firsts)
    files.update(package_markers(root, modules))
    return files


def leftovers(root: Path, files: dict[str, str]) -> list[tuple[str, str]]:
    """Files in the generated folders that no notebook produces, with the reason they are a problem."""
    found = [*(root / "minirl").rglob("*.py"), *(root / "exercises").rglob("*.py")]
    found += (root / "notebooks").glob("[0-9][0-9]_*.ipynb")
    problems = []
    for path in sorted(found):
        rel = path.relative_to(root).as_posix()
        if rel in files or any(part.startswith(".") for part in PurePosixPath(rel).parts):
            continue
        if path.suffix == ".ipynb":
            problems.append((rel, ORPHAN))
        elif is_generated(path):
            problems.append((rel, STALE))
        elif rel.startswith("minirl/") and rel not in HAND_WRITTEN and path.name != "__init__.py":
            problems.append((rel, UNLISTED))
    return problems


def sync(root: Path, files: dict[str, str], check: bool) -> list[str]:
    """Compare `files` with the tree; unless `check`, write changes and delete stale files."""
    report = []
    for rel, text in sorted(files.items()):
        path = root / rel
        old = path.read_bytes() if path.exists() else None
        if old == text.encode("utf-8"):
            continue
        if check:
            report.append(f"{rel}: {'missing' if old is None else 'differs'}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
            report.append(f"{rel}: written")
    for rel, reason in leftovers(root, files):
        if reason == STALE and not check:
            (root / rel).unlink()
            reason = "deleted (stale)"
        report.append(f"{rel}: {reason}")
    return report


def build(root: Path, check: bool) -> list[str]:
    """Regenerate everything under `root`; returns "path: what" lines (problems if `check`, else changes)."""
    return sync(Path(root), generate(Path(root)), check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        files = generate(args.root)
        report = sync(args.root, files, args.check)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in report:
        print(f"  {line}")
    if args.check:
        print(OUT_OF_SYNC if report else f"in sync ({len(files)} files)")
        return 1 if report else 0
    if any(line.endswith((UNLISTED, ORPHAN)) for line in report):
        print("built, but the files above need a hand: see their messages")
        return 1
    print(f"built {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
