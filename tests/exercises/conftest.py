"""The `ex` fixture: the implementation a graded check runs against.

A check file is named `test_NN_<slug>.py`; its `ex` is notebook NN's code:
- the reference in a normal test run: the minirl modules that hold notebook NN's exercises
  (those its solution cells export to), or
- the student's `exercises/NN_<slug>.py` when `MINIRL_GRADE_TARGET=exercises` (set by
  `python -m minirl.grade`), or the exercise files of another directory when the variable
  holds a path.
Both hold the same exercise functions: an exercise file is made of those same cells.
"""

import importlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPORT = re.compile(r"^#\s*\|\s*export\s+minirl/(\S+)\.py\s*$")
CELL = re.compile(r"^# ?%%(.*)$", re.M)  # a jupytext percent cell marker; group 1: "[markdown]" or ""


def notebook_source(nn: str) -> Path:
    matches = sorted((ROOT / "notebooks").glob(f"{nn}_*.py"))
    if not matches:
        raise FileNotFoundError(f"no notebooks/{nn}_*.py for the checks of notebook {nn}")
    return matches[0]


def exercise_modules(nn: str) -> list[str]:
    """The modules notebook NN's solution cells export to, in notebook order: ["algo.losses", ...]."""
    modules = []
    parts = CELL.split(notebook_source(nn).read_text())  # [preamble, marker, cell, marker, cell, ...]
    for marker, cell in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in cell.splitlines() if line.strip()]
        if re.search(r"\[(markdown|md|raw)\]", marker) or not lines:
            continue
        if (m := EXPORT.match(lines[0])) and any(line.strip() == "# BEGIN SOLUTION" for line in lines):
            modules.append(m[1].replace("/", "."))
    return list(dict.fromkeys(modules))


def reference(nn: str) -> types.SimpleNamespace:
    """Every public name of the modules that hold notebook NN's exercises, later modules winning."""
    namespace = {}
    for module in exercise_modules(nn):
        mod = importlib.import_module("minirl." + module)
        namespace.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    return types.SimpleNamespace(**namespace)


def student(nn: str, directory: Path) -> types.ModuleType:
    path = directory / notebook_source(nn).name
    name = f"_student_exercises_{nn}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ex(request):
    nn = re.match(r"test_(\d\d)_", Path(request.module.__file__).name).group(1)
    target = os.environ.get("MINIRL_GRADE_TARGET", "reference")
    if target == "reference":
        return reference(nn)
    return student(nn, ROOT / "exercises" if target == "exercises" else Path(target))
