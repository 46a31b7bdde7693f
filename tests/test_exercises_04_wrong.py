"""Notebook 04's exercise checks fail each wrong version in tests/exercises/wrong/ex4_*.py and pass the reference.

Each wrong module holds `EXERCISE = "4.M"` and the exercise's function with one plausible
mistake (its docstring says which). The checks of that exercise run against the reference
with the function swapped in; at least one must fail. (The grader's generic runner of
wrong versions, when present, covers these files too.)
"""

import importlib.util
import inspect
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "exercises"
WRONG = sorted((HERE / "wrong").glob("ex4_*.py"))
FUNCTION = {"4.1": "rank_loss_weight", "4.2": "gather_by_layer", "4.3": "merge_lora"}


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_checks(exercise: str, replacement=None) -> list:
    conftest = load(HERE / "conftest.py", "minirl_exercise_conftest_04")
    namespace = vars(conftest.reference("04")).copy()
    if replacement is not None:
        namespace[FUNCTION[exercise]] = replacement
    checks = load(HERE / "test_04_fsdp_lora.py", "minirl_checks_04")
    results = []
    for name, check in vars(checks).items():
        if not any(m.name == "exercise" and m.args == (exercise,) for m in getattr(check, "pytestmark", [])):
            continue
        assert list(inspect.signature(check).parameters) == ["ex"]
        try:
            check(types.SimpleNamespace(**namespace))
            results.append((name, None))
        except Exception as err:                 # the check caught the mistake
            results.append((name, f"{type(err).__name__}: {err}"))
    assert results, f"no checks for exercise {exercise}"
    return results


@pytest.mark.parametrize("path", WRONG, ids=[p.stem for p in WRONG])
def test_checks_fail_the_wrong_version(path):
    module = load(path, f"minirl_wrong_{path.stem}")
    results = run_checks(module.EXERCISE, getattr(module, FUNCTION[module.EXERCISE]))
    assert any(error for _, error in results), f"every check of {module.EXERCISE} passes {path.name}: {module.__doc__}"


@pytest.mark.parametrize("exercise", sorted(FUNCTION))
def test_checks_pass_the_reference(exercise):
    failed = [f"{name}: {error}" for name, error in run_checks(exercise) if error]
    assert not failed, failed


def test_every_exercise_has_wrong_versions():
    covered = {load(p, f"minirl_wrong_{p.stem}").EXERCISE for p in WRONG}
    assert covered == set(FUNCTION)
