"""The module map of DESIGN.md holds: each layer imports only from the layers above it, and no cycles."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "minirl"
# DESIGN.md's layers, top (imported by everything) to bottom (may import anything above it), as one order
# memory comes after parallel: notebook 03 measures the wrappers of minirl.parallel.wrap (notebook 04)
# runtime (hand-written: real models fetched offline) imports only the standard library at its top, so that
# utils.cli can take its `--model` alias before torch loads
LAYERS = ["runtime", "utils", "config", "data", "algo", "tasks", "models", "rollout", "sync", "roles", "train",
          "diagnostics", "parallel", "memory", "controller", "asyncrl", "profiling", "grade"]
LEVEL = {name: i for i, name in enumerate(LAYERS)}


def top_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "minirl" and len(parts) > 1 else None


def minirl_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported minirl module, line, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [(n, node.lineno, False) for n in names if n.startswith("minirl")]
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_imports_go_up_the_layers(path):
    rel = path.relative_to(ROOT)
    own = rel.parts[0].removesuffix(".py")
    if own not in LEVEL:
        return                                     # minirl/__init__.py
    for module, line, _ in minirl_imports(path):
        other = top_package(module)
        if other is None or other == own:
            continue
        assert other in LEVEL, f"{rel}:{line} imports {module}: its package is not in DESIGN.md's module map"
        assert LEVEL[other] < LEVEL[own], \
            f"{rel}:{line} imports {module}: {own} may only import the packages above it in {LAYERS}"


def test_pure_algorithm_code_imports_no_orchestration():
    for path in (ROOT / "algo").glob("*.py"):
        for module, line, _ in minirl_imports(path):
            assert top_package(module) in ("algo", "config", "data", "utils"), f"{path.name}:{line} imports {module}"


def test_the_design_layout_imports():
    for name in ("minirl.algo", "minirl.rollout.base", "minirl.sync", "minirl.roles", "minirl.train",
                 "minirl.config", "minirl.data"):
        importlib.import_module(name)
