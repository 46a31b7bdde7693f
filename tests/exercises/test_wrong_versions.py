"""The checks of each exercise fail plausible wrong versions of it, and pass its reference.

Each module in tests/exercises/wrong/ holds one wrong version: `EXERCISE = "N.M"` and the
exercise's function written with one mistake a student could make (its docstring says which).
Here the exercise's checks (the `@pytest.mark.exercise("N.M")` functions of
tests/exercises/test_NN_*.py) run against notebook NN's reference with that one function
swapped for the wrong one; at least one check must fail. Not an exercise itself: the grader
runs only the test_NN_*.py files.
"""

import functools
import importlib.util
import inspect
import re
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WRONG = sorted((HERE / "wrong").glob("ex*.py"))
STUB = re.compile(r'NotImplementedError\("exercise (\d+\.\d+): (\w+) --')


def load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def answers() -> dict[str, str]:
    """{"2.4": "importance_sampling_weights", ...} from the stubs in exercises/."""
    return {number: name for path in sorted((HERE.parents[1] / "exercises").glob("[0-9][0-9]_*.py"))
            for number, name in STUB.findall(path.read_text())}


@functools.cache
def checks_module(nn: str) -> types.ModuleType:
    (path,) = HERE.glob(f"test_{nn}_*.py")
    return load(path, f"minirl_checks_{nn}")


@functools.cache
def reference(nn: str) -> dict:
    return vars(load(HERE / "conftest.py", "minirl_exercise_conftest").reference(nn)).copy()


@functools.cache
def tokenizer():
    from minirl.models.policy import build_tokenizer

    return build_tokenizer()


def run_checks(exercise: str, replacement=None) -> list[tuple[str, str | None]]:
    """Run exercise N.M's checks against the reference (with `replacement` swapped in); (name, error)."""
    nn = f"{int(exercise.split('.')[0]):02d}"
    namespace = reference(nn)
    if replacement is not None:
        namespace = {**namespace, answers()[exercise]: replacement}
    fixtures = {"ex": lambda: types.SimpleNamespace(**namespace), "tokenizer": tokenizer}
    results = []
    for name, check in vars(checks_module(nn)).items():
        marks = getattr(check, "pytestmark", [])
        if not any(m.name == "exercise" and m.args == (exercise,) for m in marks):
            continue
        kwargs = {arg: fixtures[arg]() for arg in inspect.signature(check).parameters}
        try:
            check(**kwargs)
            results.append((name, None))
        except Exception as e:  # a failed assert, or the wrong version raising: the check caught it
            results.append((name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    assert results, f"no checks marked exercise({exercise!r}) in tests/exercises/test_{nn}_*.py"
    return results


@pytest.mark.parametrize("path", WRONG, ids=[p.stem for p in WRONG])
def test_checks_fail_the_wrong_version(path):
    module = load(path, f"minirl_wrong_{path.stem}")
    name = answers()[module.EXERCISE]
    results = run_checks(module.EXERCISE, getattr(module, name))
    assert any(error for _, error in results), \
        f"every check of exercise {module.EXERCISE} passes {path.name}: {module.__doc__.strip()}"


@pytest.mark.parametrize("exercise", sorted(answers(), key=lambda i: tuple(map(int, i.split(".")))))
def test_checks_pass_the_reference(exercise):
    failed = [f"{name}: {error}" for name, error in run_checks(exercise) if error]
    assert not failed, "\n".join(failed)


def test_every_exercise_has_wrong_versions():
    covered = {load(path, f"minirl_wrong_{path.stem}").EXERCISE for path in WRONG}
    assert set(answers()) <= covered, f"exercises without a wrong version: {sorted(set(answers()) - covered)}"
