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

A long class is built up across cells in d2l's style: `@add_to_class(Actor)` over a def in a
later export cell makes it a method of `Actor` here, and the build moves it into the class's
body in the generated module (tools/notebook_cells.py), so the package reads as one piece.

Simplified: the files on disk do not change (save the notebook and run `python tools/build.py`
to regenerate them); a cell that fails is not applied; an object the edit deletes stays in
the module until the kernel restarts; instances created before the edit keep their data.
"""

from __future__ import annotations

import importlib
import re
import sys
import types

EXPORT = re.compile(r"^#\s*\|\s*export\s+(minirl/\S+)\.py\s*$")

_shell = None
_told = False


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
    if not _told:
        _told = True
        print(f"[minirl] exported cell: {target} now runs this cell's code ({', '.join(names[:4]) or 'no names'}"
              f"{', ...' if len(names) > 4 else ''}), and so does every module that imported it, until the kernel "
              "restarts. The files on disk change when you save the notebook and run `python tools/build.py`.")


def load_ipython_extension(ipython) -> None:
    """`%load_ext minirl.runtime.notebook`: figures inline; every exported cell applied to the package after it runs."""
    global _shell
    ipython.run_line_magic("matplotlib", "inline")
    if _shell is not None:
        return
    _shell = ipython
    ipython.events.register("post_run_cell", _post_run_cell)


def unload_ipython_extension(ipython) -> None:
    global _shell
    if _shell is not None:
        ipython.events.unregister("post_run_cell", _post_run_cell)
        _shell = None
