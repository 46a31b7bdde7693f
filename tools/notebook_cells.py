"""The cells of a notebook and the module they make: tools/build.py's parsing and rendering half.

`export_cells` reads a notebook's export cells (`# | export minirl/x.py`), parsed and checked
(`Cell`: its lines, tree, imports, definitions, solution spans); `render_module` turns the
cells of one module into its text: the first cell's docstring, the hoisted imports (grouped
here, ordered by ruff afterwards), `__all__`, and the bodies with runs of blank lines
collapsed. A def under `@add_to_class(C)` (d2l's style, minirl/runtime/notebook.py) is moved
into the body of class C, defined in an earlier cell of the module (`with_methods`), so a
long class can be built up across cells and still read as one piece in the package.
Hand-written: what the build does is described in tools/build.py.
"""

from __future__ import annotations

import ast
import io
import re
import symtable
import sys
import textwrap
import tokenize
import warnings
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"   # a solution span's marker lines
CELL_RE = re.compile(r"^# ?%%(.*)$")
EXPORT_RE = re.compile(r"^#\s*\|\s*export\s+(\S+)\s*$")


class BuildError(Exception):
    """A notebook that cannot be built; the message names the file and line."""


class BuildWarning(UserWarning):
    """Something to fix in a notebook that still builds; printed by the CLI, never an error."""


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

    def defines(self) -> list[str]:
        """Names bound at top level other than by imports (defs, classes, assignments), in order."""
        names = []
        for node in self.tree.body:
            if method_target(node) is not None:         # a method of an earlier class, not a module name
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        return list(dict.fromkeys(names))

    def uses(self) -> set[str]:
        """Global names the cell reads (at top level or inside its functions and classes)."""
        top = symtable.symtable("\n".join(self.lines), self.notebook, "exec")
        names = {s.get_name() for s in top.get_symbols()
                 if s.is_referenced() and not (s.is_assigned() or s.is_imported() or s.is_namespace())}
        tables = list(top.get_children())
        while tables:
            table = tables.pop()
            names |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
            tables += table.get_children()
        return names

    def answers(self) -> list[str | None]:
        """For each solution span, the top-level def or class that holds it (None at module level)."""
        return [next((node.name for node in self.tree.body
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.lineno <= begin + 1 <= node.end_lineno), None)
                for begin, _ in self.spans]


ADD_TO_CLASS = "add_to_class"


def method_target(node: ast.stmt) -> str | None:
    """C for a top-level def whose outermost decorator is `@add_to_class(C)`; None for any other statement."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.decorator_list:
        return None
    first = node.decorator_list[0]
    is_it = (isinstance(first, ast.Call) and isinstance(first.func, ast.Name) and first.func.id == ADD_TO_CLASS)
    if is_it and len(first.args) == 1 and not first.keywords and isinstance(first.args[0], ast.Name):
        return first.args[0].id
    return None


def bound_name(alias: ast.alias, node: ast.Import | ast.ImportFrom) -> str:
    """The name an import binds: `import a.b` binds a, `import a.b as c` and `from a import b as c` bind c."""
    if alias.asname:
        return alias.asname
    return alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name


def is_minirl_import(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or node.module.split(".")[0] == "minirl"
    return any(alias.name.split(".")[0] == "minirl" for alias in node.names)


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
        if "__all__" in cell.defines():
            raise BuildError(f"{cell.where(0)}: {cell.target}: the build writes __all__ from the public names; "
                             "remove it from the cell (a name starting with _ stays private)")
        cell.spans = solution_spans(cell)
        warn_function_level_imports(cell)
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


def warn_function_level_imports(cell: Cell) -> None:
    """A BuildWarning for each minirl import inside a function whose lines carry no comment."""
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(cell.lines) + "\n").readline)
    commented = {token.start[0] for token in tokens if token.type == tokenize.COMMENT}
    inside: dict[int, tuple[ast.stmt, str]] = {}  # id(import) -> (import, innermost function)
    for function in ast.walk(cell.tree):  # breadth first: an inner function comes after its outer one
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and is_minirl_import(node):
                    inside[id(node)] = (node, function.name)
    for node, function in sorted(inside.values(), key=lambda item: item[0].lineno):
        if not commented.intersection(range(node.lineno, node.end_lineno + 1)):
            warnings.warn(BuildWarning(
                f"{cell.where(node.lineno - 1)}: `{ast.unparse(node)}` inside {function}() in {cell.target}: "
                "move it to the top of the module, or say on its line why it must stay "
                "(`# lazy: ...`, `# avoids a cycle: ...`)"), stacklevel=2)


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


Import = tuple[ast.Import | ast.ImportFrom, str]  # an import statement and its text as written


def cell_imports(cells: list[Cell]) -> list[Import]:
    return [(node, cell.segment(node)) for cell in cells for node in cell.imports()]


def import_groups(imports: list[Import]) -> list[str]:
    """The imports, de-duplicated, as four blocks: __future__, stdlib, third party, minirl.

    Imports are kept as written, except that several `from M import ...` of one module are
    merged into a single statement (cells often import from the same module one name at a time).
    """
    froms: dict[str, list[str]] = {}           # module -> imported names, first-seen order
    for node, _ in imports:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = froms.setdefault(node.module, [])
            names += [n for n in (ast.unparse(a) for a in node.names) if n not in names]
    seen, groups = set(), ([], [], [], [])
    for node, text in imports:
        merged = isinstance(node, ast.ImportFrom) and node.level == 0
        key = ("from", node.module) if merged else ast.unparse(node)
        if key in seen:
            continue
        seen.add(key)
        if merged and froms[node.module] != [ast.unparse(a) for a in node.names]:
            text = from_import(node.module, froms[node.module])
        groups[import_group(node)].append(text)
    return ["\n".join(g) for g in groups]


def from_import(module: str, names: list[str], width: int = 100) -> str:
    """`from module import a, b`, wrapped in parentheses when longer than `width`."""
    return wrapped(f"from {module} import (", names, ")", width, flat=f"from {module} import {', '.join(names)}")


def wrapped(opening: str, items: list[str], closing: str, width: int, flat: str) -> str:
    """`flat` if it fits in `width`, else `opening` + items + `closing` over lines aligned after `opening`."""
    if len(flat) <= width:
        return flat
    lines, current = [], opening
    for item in items:
        if len(current) + len(item) + 2 > width and current.strip() != opening.strip():
            lines.append(current.rstrip())
            current = " " * len(opening)
        current += item + ", "
    return "\n".join(lines + [current.rstrip(", ") + closing])


PUBLIC_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")


def public_names(cells: list[Cell]) -> list[str]:
    """Top-level defs and classes, and UPPER_CASE constants, not starting with _, in order of definition."""
    names = []
    for cell in cells:
        for node in cell.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Assign) or isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [n.id for t in targets for n in ast.walk(t)
                          if isinstance(n, ast.Name) and PUBLIC_CONSTANT.fullmatch(n.id)]
    return [name for name in dict.fromkeys(names) if not name.startswith("_")]


def all_statement(names: list[str], width: int = 100) -> str:
    items = [f'"{name}"' for name in names]
    return wrapped("__all__ = [", items, "]", width, flat=f"__all__ = [{', '.join(items)}]")


def collapse_blank_lines(text: str, tree: ast.Module) -> str:
    """Runs of blank lines cut to two before a top-level line and one before an indented one.

    Lines inside multi-line strings are left as they are (they are part of a value).
    """
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            inside.update(range(node.lineno + 1, node.end_lineno + 1))
    out, blank = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if number not in inside and not line.strip():
            blank += 1
            continue
        if blank:
            limit = 1 if line[:1] in (" ", "\t") and number not in inside else 2
            out += [""] * min(blank, limit)
            blank = 0
        out.append(line)
    return "\n".join(out) + "\n"


def assemble(head: str, imports: list[str], bodies: list[str], path: str, public: list[str] | None = None) -> str:
    """Join header+docstring, imports, `__all__` and cell bodies with PEP 8 spacing; check it compiles.

    `imports` are the four blocks of `import_groups`; `__all__` follows `from __future__` (PEP 8).
    """
    future, *rest = imports
    blocks = [future, all_statement(public) if public else "", *rest]
    text = "".join("\n\n" + block for block in [head, *blocks] if block).removeprefix("\n\n")
    for i, block in enumerate(b for b in bodies if b):
        # two blank lines between cells and before a top-level def/class, else one (like isort)
        text += "\n\n\n" if i or re.match(r"(@|def |async def |class )", block) else "\n\n"
        text += block
    try:
        text = collapse_blank_lines(text, ast.parse(text))
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise BuildError(f"{path}:{e.lineno}: generated code does not compile: {e.msg}") from None
    return text


def header(notebooks: list[str], width: int = 120) -> str:
    """The comment that opens a generated module (its first line starts with MODULE_PREFIX), within `width`."""
    sources = ", ".join(sorted(set(notebooks)))
    tail = "by tools/build.py -- edit the notebook, not this file."
    if len(line := f"# Generated from {sources} {tail}") <= width:
        return line
    lines = textwrap.wrap(f"Generated from {sources}", width - 2, break_on_hyphens=False)
    return "\n".join(f"# {line}" for line in [*lines, tail])


# ---------------------------------------------------------------- methods added to a class


def check_method(cell: Cell, node: ast.FunctionDef, classes: dict) -> str:
    """The class `node` goes into; BuildError for a move that would change what the code does."""
    name = method_target(node)
    where = cell.where(node.lineno - 1)
    if name not in classes:
        raise BuildError(f"{where}: @add_to_class({name}) over {node.name}(): no earlier export cell of "
                         f"{cell.target} defines class {name}; define the class first, in this module")
    home, _ = classes[name]
    if home.spans or cell.spans:
        raise BuildError(f"{where}: @add_to_class({name}) over {node.name}(): a class or method that holds an "
                         "exercise (BEGIN SOLUTION) stays in one cell; keep the method inside the class")
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super" \
                and not inner.args:
            raise BuildError(f"{cell.where(inner.lineno - 1)}: {node.name}() calls super() without arguments, "
                             "which works only inside a class body; keep the method inside the class cell")
        if isinstance(inner, ast.Attribute) and inner.attr.startswith("__") and not inner.attr.endswith("__"):
            raise BuildError(f"{cell.where(inner.lineno - 1)}: {node.name}() uses `{inner.attr}`, which Python "
                             "renames only inside a class body; keep the method inside the class cell")
    if (line := multiline_string(cell, node)) is not None:
        raise BuildError(f"{cell.where(line)}: {node.name}() holds a multi-line string, which would change when "
                         "the build indents the method into the class; keep it in the class cell")
    return name


def multiline_string(cell: Cell, node: ast.FunctionDef) -> int | None:
    """The line index of the first string token inside `node` that spans lines, its docstring aside; else None.

    Tokens, not the tree: the pieces of an f-string written over two lines are one node, but
    indenting the lines only adds spaces between them, never inside a string."""
    doc = docstring_node(node)
    source = "\n".join(cell.lines[node.lineno - 1:node.end_lineno]) + "\n"
    kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line = node.lineno - 1 + token.start[0] - 1
        if token.type in kinds and token.end[0] > token.start[0] and not (doc and line == doc.lineno - 1):
            return line
    return None


def docstring_node(node: ast.FunctionDef) -> ast.Constant | None:
    first = node.body[0] if node.body else None
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return first.value if is_doc and isinstance(first.value.value, str) else None


def method_lines(cell: Cell, node: ast.FunctionDef) -> range:
    """The def's lines with its decorators and the comment lines right above them (0-based indices)."""
    start = node.decorator_list[0].lineno - 1
    while start > 0 and cell.lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return range(start, node.end_lineno)


def with_methods(cells: list[Cell], width: int = 120) -> list[Cell]:
    """`cells` with every `@add_to_class(C)` def moved to the end of class C's body, decorator line dropped.

    C must be defined at top level earlier in the module (an earlier cell, or earlier in the same
    cell); methods go in cell order, each indented as the class's body is. Refused (BuildError):
    a method using zero-argument super() or a `__private` name (both need a class body), one
    holding a multi-line string (indenting would change it), a line that would pass `width`.
    """
    classes: dict[str, tuple[Cell, ast.ClassDef]] = {}
    inserts: dict[tuple[int, int], list[str]] = {}      # (id(cell), index of a class's last line) -> lines
    dropped: dict[int, set[int]] = {}                   # id(cell) -> indices moved away
    for cell in cells:
        for node in cell.imports():
            if any(bound_name(alias, node) == ADD_TO_CLASS for alias in node.names):
                raise BuildError(f"{cell.where(node.lineno - 1)}: import {ADD_TO_CLASS} in a cell without the "
                                 "export marker (it is notebook plumbing, not part of the module)")
        for node in cell.tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (cell, node)
            elif method_target(node) is not None:
                home, cls = classes[check_method(cell, node, classes)]
                indent = " " * cls.body[0].col_offset
                span = method_lines(cell, node)
                decorator = node.decorator_list[0]
                skip = set(range(decorator.lineno - 1, decorator.end_lineno))
                moved = []
                for i in (i for i in span if i not in skip):
                    line = indent + cell.lines[i] if cell.lines[i].strip() else ""
                    if len(line) > width:
                        raise BuildError(f"{cell.where(i)}: this line of {node.name}() is {len(line)} characters "
                                         f"once indented into class {cls.name}; wrap it to {width}")
                    moved.append(line)
                inserts.setdefault((id(home), cls.end_lineno - 1), []).extend(["", *moved])
                dropped.setdefault(id(cell), set()).update(span)
    if not inserts:
        return cells
    merged = []
    for cell in cells:
        lines = []
        for i, line in enumerate(cell.lines):
            if i not in dropped.get(id(cell), ()):
                lines.append(line)
            lines += inserts.get((id(cell), i), [])
        if lines != cell.lines:
            cell = replace(cell, lines=lines, tree=ast.parse("\n".join(lines)))
            cell.spans = solution_spans(cell)
        merged.append(cell)
    return merged


def render_module(target: str, cells: list[Cell]) -> str:
    cells = with_methods(cells)
    first = cells[0]
    if first.docstring() is None:
        raise BuildError(f"{first.where(0)}: {target}: the first exported cell must start with a module docstring")
    head = header([c.notebook for c in cells]) + "\n" + first.segment(first.docstring())
    bodies = [body(c, drop_docstring=c is first, stubs=None) for c in cells]
    return assemble(head, import_groups(cell_imports(cells)), bodies, target, public=public_names(cells))


def module_name(target: str) -> str:
    """"minirl/algo/losses.py" -> "minirl.algo.losses"; a package's __init__.py -> the package."""
    return ".".join(PurePosixPath(target).with_suffix("").parts).removesuffix(".__init__")


def one_name(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> ast.Import | ast.ImportFrom:
    """The import statement `node` cut down to `alias`."""
    if isinstance(node, ast.Import):
        return ast.Import(names=[alias])
    return ast.ImportFrom(module=node.module, names=[alias], level=node.level)
