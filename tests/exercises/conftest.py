"""The `ex` fixture: the implementation a graded check runs against.

A check file is named `test_NN_<slug>.py`; its `ex` is notebook NN's code:
- the reference (the minirl modules that notebook NN exports) in a normal test run, or
- the student's `exercises/NN_<slug>.py` when `MINIRL_GRADE_TARGET=exercises` (set by
  `python -m minirl.grade`), or the exercise files of another directory when the variable
  holds a path.
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
EXPORT = re.compile(r"^#\s*\|\s*export\s+minirl/(\S+)\.py\s*$", re.M)


def notebook_source(nn: str) -> Path:
    matches = sorted((ROOT / "notebooks").glob(f"{nn}_*.py"))
    if not matches:
        raise FileNotFoundError(f"no notebooks/{nn}_*.py for the checks of notebook {nn}")
    return matches[0]


def reference(nn: str) -> types.SimpleNamespace:
    """Every public name of every module notebook NN exports to, later modules winning."""
    namespace = {}
    for module in dict.fromkeys(EXPORT.findall(notebook_source(nn).read_text())):
        mod = importlib.import_module("minirl." + module.replace("/", "."))
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
