"""The notebooks' kernel setup: figures shown inline, and an exported cell, once run, is the code the package runs.

Hand-written (notebook plumbing, it teaches nothing). Every notebook loads it in its first
code cell (`%load_ext minirl.runtime.notebook`), which does two things.

Figures: matplotlib's inline backend, whatever `MPLBACKEND` says (with `MPLBACKEND=Agg` in
the environment, a notebook would otherwise draw nothing).

Edits take effect. After a cell whose first line is an export marker
(`# | export minirl/algo/advantages.py`) runs without error, the extension runs the same
source again inside that module (`minirl.algo.advantages`), so the module's names are the
cell's, and then patches the objects the module held before in place, with IPython's own
autoreload machinery (`update_generic`: a function gets the new code, a class the new
methods). References other modules took earlier (`from minirl.algo.advantages import
group_advantages` in `minirl.train.step`) therefore run the edited code too, for the rest of
the kernel's life.

Edits reach the processes a notebook starts, too. The extension keeps the exported cells this
kernel ran in a file, and puts a folder on `PYTHONPATH` whose `sitecustomize.py` replays them:
in a chapter script, a torchrun rank or a Ray worker started from the notebook, each module of
the package takes the kernel's cells for it when it is first imported. A process started
before a cell ran (a Ray worker that was already up) keeps what it had. `run_script(path, *args)`
starts such a script (notebook 01 §8 runs its chapter with it) and streams its output, progress
bar included, into the cell.

A long class is built up across cells in d2l's style: `@add_to_class(Actor)` over a def in a
later export cell makes it a method of `Actor` here, and the build moves it into the class's
body in the generated module (tools/notebook_cells.py), so the package reads as one piece.

Simplified: the files on disk do not change (save the notebook and run `python tools/build.py`
to regenerate them); a cell that fails is not applied; an object the edit deletes stays in
the module until the kernel restarts; instances created before the edit keep their data.
"""

from __future__ import annotations

import codecs
import importlib
import importlib.abc
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

EXPORT = re.compile(r"^#\s*\|\s*export\s+(minirl/\S+)\.py\s*$")

_shell = None
_told = False
_cells: list[tuple[str, str]] = []      # (module, source) of every exported cell this kernel applied, in order
_overlay: Path | None = None            # the folder on PYTHONPATH whose sitecustomize.py replays them

SITECUSTOMIZE = '''"""Written by minirl.runtime.notebook: this process runs the exported cells its kernel ran."""
import json as _json
import os as _os

try:
    with open(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "cells.json")) as _f:
        _cells = _json.load(_f)
    if _cells:
        from minirl.runtime.notebook import replay_on_import
        replay_on_import(_cells)
except Exception as _err:  # never stop the process: say that it runs the package on disk
    print(f"[minirl] could not replay the notebook's cells ({type(_err).__name__}: {_err}); "
          "this process runs the package as it is on disk", flush=True)
'''


def export_target(source: str) -> str | None:
    """The module a cell exports to ("minirl.algo.advantages"), from its first non-blank line; None if none."""
    for line in source.splitlines():
        if line.strip():
            m = EXPORT.match(line.strip())
            return m[1].replace("/", ".").removesuffix(".__init__") if m else None
    return None


def patch_function(old: types.FunctionType, new: types.FunctionType) -> bool:
    """Make `old` run `new`'s code in place (code, defaults, closure cells, attributes); False if it cannot."""
    try:
        old.__code__ = new.__code__                 # refused when the number of free variables differs
    except ValueError:
        return False
    for name, old_cell, new_cell in zip(new.__code__.co_freevars, old.__closure__ or (), new.__closure__ or (),
                                        strict=True):
        if name != "__class__":          # a method's own class (for super()) stays the class it is patched into
            old_cell.cell_contents = new_cell.cell_contents       # a decorator's wrapped function, say
    old.__defaults__, old.__kwdefaults__, old.__doc__ = new.__defaults__, new.__kwdefaults__, new.__doc__
    old.__dict__.update(new.__dict__)
    return True


SLOT_TYPES = (types.MemberDescriptorType, types.GetSetDescriptorType)


def _functions_of(value) -> list:
    """The plain functions inside a class attribute: itself, a classmethod's or staticmethod's, a property's."""
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    value = getattr(value, "__func__", value)
    return [value] if isinstance(value, types.FunctionType) else []


def patch_class(old: type, new: type) -> None:
    """Give the class `old` the attributes of `new` in place, its methods patched so bound copies follow.

    A method's `__class__` cell (what zero-argument `super()` reads) is pointed at `old` first: the
    instances that exist are `old`'s, and `super(new, instance)` would raise TypeError for them."""
    for value in vars(new).values():
        for func in _functions_of(value):
            for cell in func.__closure__ or ():
                try:
                    if cell.cell_contents is new:
                        cell.cell_contents = old
                except ValueError:                   # an empty cell
                    pass
    for name, value in vars(new).items():
        if name in ("__dict__", "__weakref__", "__slots__") or isinstance(value, SLOT_TYPES):
            continue                         # a slot's descriptor only reads the instances of its own class
        current = vars(old).get(name)
        if isinstance(current, types.FunctionType) and isinstance(value, types.FunctionType):
            if patch_function(current, value):
                continue
        try:
            setattr(old, name, value)
        except (AttributeError, TypeError):          # __doc__ of some builtins' subclasses, say
            pass


def patch(old, new) -> bool:
    """Make `old` behave as `new` in place (a function or a class); False when it is some other value."""
    if isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
        return patch_function(old, new)
    if isinstance(old, type) and isinstance(new, type):
        patch_class(old, new)
        return True
    return False


class MethodAdded:
    """What `@add_to_class(cls)` leaves under the function's name: a note that it went into the class."""

    def __init__(self, cls: type, name: str):
        self.cls, self.name = cls, name

    def __repr__(self) -> str:
        return f"<{self.cls.__name__}.{self.name}: a method, added by add_to_class>"


def add_to_class(cls: type):
    """Decorator: the function below becomes the method of `cls` of the same name (d2l's `add_to_class`).

    Put it outermost, above `@property`, `@staticmethod` or any other decorator. A method of that
    name already on `cls` is patched in place (bound copies and other modules' references
    follow the edit); otherwise the attribute is set. The cell's own name for it keeps what it
    held before (a notebook's `model` stays the model when `ColocatedEngine.model` is added),
    or, where it held nothing, a `MethodAdded` note: the method lives on the class.
    """
    def attach(function):
        inner = function.fget if isinstance(function, property) else getattr(function, "__func__", function)
        name = inner.__name__
        current = vars(cls).get(name)
        if not (isinstance(current, types.FunctionType) and isinstance(function, types.FunctionType)
                and patch_function(current, function)):
            setattr(cls, name, function)
        caller = sys._getframe(1).f_globals           # the namespace the decorated def is binding a name in
        return caller[name] if name in caller else MethodAdded(cls, name)
    return attach


def apply_cell(source: str, module_name: str) -> list[str]:
    """Run `source` inside `module_name` and patch the objects it replaces in place; returns the names it set.

    A method added with `@add_to_class` goes into its class; the module's own name for it (if any) is kept."""
    module = importlib.import_module(module_name)
    namespace = vars(module)
    before = dict(namespace)
    namespace.setdefault("add_to_class", add_to_class)      # the notebook's import, for this run only
    try:
        exec(compile(source, f"<exported cell: {module_name}>", "exec"), namespace)  # noqa: S102 (not the file's lines)
    finally:
        if "add_to_class" not in before:
            namespace.pop("add_to_class", None)
    changed = []
    for name, new in list(namespace.items()):
        old = before.get(name)
        if isinstance(new, MethodAdded):                       # a method, not a module-level name
            if name in before:
                namespace[name] = old
            else:
                del namespace[name]
            continue
        if name.startswith("__") or new is old:
            continue
        changed.append(name)
        if old is not None and patch(old, new):
            namespace[name] = old             # one object per name, edit after edit: earlier imports follow it
    return changed


class _Replay(importlib.abc.MetaPathFinder):
    """Finds a module as the other finders do, then runs the kernel's cells for it right after its own code."""

    def __init__(self, cells: dict[str, list[str]]):
        self.cells = cells

    def find_spec(self, name, path=None, target=None):
        if name not in self.cells:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module
                sources = self.cells.pop(name)

                def exec_module(module, run=run, sources=sources):
                    run(module)
                    sys.modules[name] = module        # apply_cell imports it by name
                    for source in sources:
                        apply_cell(source, name)
                spec.loader.exec_module = exec_module
                return spec
        return None


def replay_on_import(cells: list[list[str]]) -> None:
    """Apply each (module, source) cell when its module is first imported (now, if it already is)."""
    pending: dict[str, list[str]] = {}
    for name, source in cells:
        pending.setdefault(name, []).append(source)
    for name in [n for n in pending if n in sys.modules]:
        for source in pending.pop(name):
            apply_cell(source, name)
    sys.meta_path.insert(0, _Replay(pending))


def _remember(target: str, source: str) -> None:
    """Add an applied cell to the file the kernel's subprocesses replay (written whole, then renamed)."""
    if _overlay is None:
        return
    _cells.append((target, source))
    tmp = _overlay / "cells.json.tmp"
    tmp.write_text(json.dumps(_cells))
    os.replace(tmp, _overlay / "cells.json")


def _start_overlay() -> None:
    """The folder whose sitecustomize.py replays this kernel's cells, first on PYTHONPATH for every subprocess."""
    global _overlay
    _overlay = Path(tempfile.mkdtemp(prefix="minirl-kernel-"))
    (_overlay / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (_overlay / "cells.json").write_text("[]")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_overlay), os.environ.get("PYTHONPATH")]))


def _post_run_cell(result) -> None:
    global _told
    source = getattr(result.info, "raw_cell", "") or ""
    target = export_target(source)
    if target is None or not result.success:
        return
    try:
        names = apply_cell(source, target)
        module = vars(importlib.import_module(target))
        for name in names:                   # the notebook's names are the package's objects: one class, not two
            if name in _shell.user_ns and name in module:
                _shell.user_ns[name] = module[name]
    except Exception as err:  # the notebook's own run succeeded; say why the package could not take it
        print(f"[minirl] this cell ran, but {target} could not take it: {type(err).__name__}: {err}")
        return
    _remember(target, source)
    if not _told:
        _told = True
        print(f"[minirl] {target} now runs this cell's code,\n"    # said once per kernel, in lines a page fits
              "  here and in the scripts, torchrun jobs and Ray workers this kernel starts;\n"
              "  the files on disk change when you save the notebook and run python tools/build.py")


def run_script(script, *args: str) -> None:
    """Run `python script *args` in a subprocess that takes this kernel's edited cells (the PYTHONPATH above),
    streaming its output, progress bar included, into the cell; AssertionError if it fails."""
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    for chunk in iter(lambda: proc.stdout.read1(256), b""):
        sys.stdout.write(decode(chunk))
    assert proc.wait() == 0, f"{script} failed"


def load_ipython_extension(ipython) -> None:
    """`%load_ext minirl.runtime.notebook`: figures inline; every exported cell applied to the package after it runs."""
    global _shell
    ipython.run_line_magic("matplotlib", "inline")
    if _shell is not None:
        return
    _shell = ipython
    from minirl.runtime.progress import bars_wanted  # noqa: PLC0415

    bars_wanted(no_progress=True)   # transformers' and the Hub's loading bars off (minirl's own bars stay)
    _start_overlay()
    ipython.events.register("post_run_cell", _post_run_cell)


def unload_ipython_extension(ipython) -> None:
    global _shell
    if _shell is not None:
        ipython.events.unregister("post_run_cell", _post_run_cell)
        _shell = None
