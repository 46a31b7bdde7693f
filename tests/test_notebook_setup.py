"""The notebooks' kernel setup: figures whatever MPLBACKEND says; a learner's edit to an exported cell is what
the package runs afterwards."""

import os
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

from minirl.runtime.notebook import apply_cell, export_target

ROOT = Path(__file__).resolve().parents[1]


def exported_cell(notebook: str, defines: str) -> str:
    """The source of the exported cell of notebooks/<notebook> that defines `defines`."""
    text = (ROOT / "notebooks" / notebook).read_text()
    cells = re.split(r"^# %%.*$", text, flags=re.M)
    return next(c.strip("\n") for c in cells if export_target(c) and f"\ndef {defines}(" in c)


def test_export_target_reads_the_first_line():
    assert export_target("\n# | export minirl/algo/advantages.py\nx = 1") == "minirl.algo.advantages"
    assert export_target("# | export minirl/tasks/__init__.py\n") == "minirl.tasks"
    assert export_target("x = 1\n# | export minirl/algo/advantages.py") is None
    assert export_target("") is None


@pytest.mark.notebook
def test_an_edited_exported_cell_changes_what_package_code_computes(monkeypatch):
    """Copy notebook 01's cell that defines group_advantages, break it on purpose, run it in a kernel:
    minirl.train.step (which imported group_advantages before the edit) now computes the edited version."""
    cell = exported_cell("01_single_process.py", "group_advantages")
    edited = cell.replace("    return advantages.reshape(-1)                                         # [N]",
                          "    return advantages.reshape(-1) * 0 + 42.0                              # edited")
    assert edited != cell, "the cell's return line moved: update this test"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext minirl.runtime.notebook"),
                nbformat.v4.new_code_cell("import torch\nimport minirl.train.step as step\n"
                                          "before = step.group_advantages(torch.tensor([1., 0.]), 2).tolist()"),
                nbformat.v4.new_code_cell(edited),
                nbformat.v4.new_code_cell("after = step.group_advantages(torch.tensor([1., 0.]), 2).tolist()\n"
                                          "print('before', before, 'after', after)")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "before [0.7" in printed and "after [42.0, 42.0]" in printed, printed
    assert "[minirl] minirl.algo.advantages now runs this cell's code" in printed, printed
    assert max(map(len, printed.splitlines())) <= 100, "the notice fits a page"


@pytest.mark.notebook
def test_an_edited_exported_cell_reaches_the_processes_the_notebook_starts(monkeypatch):
    """The same edit, then a script started from the kernel (as notebook 01 starts its chapter): the script's
    minirl.train.step computes the edited group_advantages too, whether the module was imported at start-up or
    later; without the kernel's edit the script computes the code on disk."""
    cell = exported_cell("01_single_process.py", "group_advantages")
    edited = cell.replace("    return advantages.reshape(-1)                                         # [N]",
                          "    return advantages.reshape(-1) * 0 + 42.0                              # edited")
    script = (
        "import subprocess, sys\n"
        "code = 'import torch, minirl.train.step as s; print(s.group_advantages(torch.tensor([1., 0.]), 2).tolist())'\n"
        "print('child', subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout)")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext minirl.runtime.notebook"), nbformat.v4.new_code_cell(script),
                nbformat.v4.new_code_cell(edited), nbformat.v4.new_code_cell(script)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    before, after = ("".join(o.get("text", "") for o in nb.cells[i].get("outputs", [])) for i in (1, 3))
    assert "child [0.7" in before, before
    assert "child [42.0, 42.0]" in after, after

def test_apply_cell_patches_earlier_references_in_place():
    import torch

    import minirl.train.step as step

    cell = exported_cell("01_single_process.py", "group_advantages")
    try:
        names = apply_cell(cell.replace("grouped.mean(1, keepdim=True)", "grouped.mean(1, keepdim=True) * 0"),
                           "minirl.algo.advantages")
        assert "group_advantages" in names
        out = step.group_advantages(torch.tensor([1.0, 3.0]), 2, "none")
        assert out.tolist() == [1.0, 3.0], "step.py's reference runs the edited code (mean no longer subtracted)"
    finally:
        apply_cell(cell, "minirl.algo.advantages")              # the notebook's own code again
    assert step.group_advantages(torch.tensor([1.0, 3.0]), 2, "none").tolist() == [-1.0, 1.0]


def test_decorated_functions_classes_and_repeated_edits_follow(monkeypatch):
    """A @torch.no_grad() function, a class's method and a dataclass: references taken before the first
    edit run the code of the latest edit, edit after edit (IPython's autoreload misses the decorated one)."""
    import sys
    import types

    scratch = types.ModuleType("minirl_live_scratch")
    monkeypatch.setitem(sys.modules, "minirl_live_scratch", scratch)
    source = '''
import dataclasses
import torch

@torch.no_grad()
def double(x):
    return x * {k}

class Scale:
    def apply(self, x):
        return x * {k}

@dataclasses.dataclass
class Box:
    size: int = {k}
'''
    apply_cell(source.format(k=2), "minirl_live_scratch")
    double, Scale, Box, instance = scratch.double, scratch.Scale, scratch.Box, scratch.Scale()
    for k in (3, 5):
        apply_cell(source.format(k=k), "minirl_live_scratch")
        assert double(1) == k, "the decorated function taken before the edits runs the latest code"
        assert instance.apply(1) == k and Scale().apply(1) == k, "old instances and the old class follow"
        assert Box().size == k and scratch.Box is Box, "one class object per name, edit after edit"


def test_zero_argument_super_still_works_after_an_edit(monkeypatch):
    """A class whose methods call super() (notebook 04's RankFailed, its roles): instances made after an edit,
    through a reference taken before it, still initialise (super(new_class, old_instance) would fail)."""
    import sys
    import types

    scratch = types.ModuleType("minirl_live_super")
    monkeypatch.setitem(sys.modules, "minirl_live_super", scratch)
    source = (
        "class Failed(RuntimeError):\n"
        "    def __init__(self, message, rank={k}):\n"
        "        super().__init__(message)\n"
        "        self.rank = rank\n")
    apply_cell(source.format(k=1), "minirl_live_super")
    Failed = scratch.Failed
    for k in (2, 3):
        apply_cell(source.format(k=k), "minirl_live_super")
        err = Failed("boom")
        assert (str(err), err.rank) == ("boom", k) and scratch.Failed is Failed


@pytest.mark.notebook
def test_figures_show_inline_even_with_mplbackend_agg(monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext minirl.runtime.notebook"),
                nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()")]
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    images = [o for o in nb.cells[1].get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"no figure in the cell's outputs: {nb.cells[1].get('outputs')}"


def test_zero_argument_super_still_works_on_instances_made_before_an_edit(monkeypatch):
    """An exception class whose __init__ calls super() (stage 6's WorkerDiedError): the class a module imported
    before the edit still builds, and instances made before it still call their methods."""
    import sys
    import types

    scratch = types.ModuleType("minirl_super_scratch")
    monkeypatch.setitem(sys.modules, "minirl_super_scratch", scratch)
    source = '''
class Died(RuntimeError):
    def __init__(self, what):
        super().__init__(f"{what} {k}")

    @property
    def label(self):
        return super().__str__() + " {k}"
'''
    apply_cell(source.replace("{k}", "1"), "minirl_super_scratch")
    Early = scratch.Died                                    # `from module import Died` before the edit
    before = Early("worker")
    apply_cell(source.replace("{k}", "2"), "minirl_super_scratch")
    assert str(Early("worker")) == "worker 2" and str(scratch.Died("rank")) == "rank 2"
    assert before.label == "worker 1 2"


def test_a_class_with_slots_keeps_working_after_an_edit(monkeypatch):
    """A class with __slots__ (notebook 05's radix Node): instances made before an edit still read their slots,
    and new instances get the edited methods (moving the new class's slot descriptors across would break both)."""
    import sys
    import types

    scratch = types.ModuleType("minirl_live_slots")
    monkeypatch.setitem(sys.modules, "minirl_live_slots", scratch)
    source = (
        "class Node:\n"
        "    __slots__ = ('parent', 'size')\n"
        "    def __init__(self, parent=None):\n"
        "        self.parent, self.size = parent, 0\n"
        "    def depth(self):\n"
        "        return {k} + (0 if self.parent is None else self.parent.depth())\n")
    apply_cell(source.format(k=1), "minirl_live_slots")
    Node = scratch.Node
    root = Node()
    apply_cell(source.format(k=10), "minirl_live_slots")
    child = Node(root)
    assert scratch.Node is Node and root.parent is None and child.parent is root
    assert child.depth() == 20, "both the old and the new instance run the edited method"


def test_a_method_added_in_a_later_cell_goes_into_the_package_class(monkeypatch):
    """d2l's style: `@add_to_class(Square)` in a later cell. Run as the notebook runs it (the cell, then the
    extension's apply_cell), the package's class has the method, old instances and bound copies follow a
    second edit, and the module gains no stray name (neither the method's nor `add_to_class`)."""
    import sys
    import types

    from minirl.runtime.notebook import MethodAdded, add_to_class

    scratch = types.ModuleType("minirl_live_methods")
    monkeypatch.setitem(sys.modules, "minirl_live_methods", scratch)
    apply_cell("class Square:\n    def __init__(self, side):\n        self.side = side\n", "minirl_live_methods")
    method = "@add_to_class(Square)\ndef area(self):\n    return self.side ** {k}\n"
    user = {"add_to_class": add_to_class, "Square": scratch.Square}      # the notebook's namespace
    exec(method.format(k=2), user)                                       # the cell itself
    apply_cell(method.format(k=2), "minirl_live_methods")                # then the extension
    square = scratch.Square(3)
    bound = square.area
    assert (square.area(), bound()) == (9, 9)
    assert isinstance(user["area"], MethodAdded) and "Square.area" in repr(user["area"])
    assert not hasattr(scratch, "area") and not hasattr(scratch, "add_to_class"), "no stray module names"
    user["side"] = "the notebook's own variable"
    exec("@add_to_class(Square)\n@property\ndef side(self):\n    return 1\n", user)
    assert user["side"] == "the notebook's own variable", "a name the notebook already uses keeps its value"
    del scratch.Square.side
    apply_cell(method.format(k=3), "minirl_live_methods")                # a learner edits the method
    assert (square.area(), bound(), scratch.Square(2).area()) == (27, 27, 8), "old instances, bound copies follow"
    apply_cell("class Square:\n    def __init__(self, side):\n        self.side = side + 1\n", "minirl_live_methods")
    assert scratch.Square(2).area() == 27, "re-running the class cell keeps the methods added to it"
