"""Grade the exercises: `python -m minirl.grade [--reference] [--only NN]`.

Hand-written (it teaches nothing). Each exercise N.M has checks in
`tests/exercises/test_NN_*.py`, marked `@pytest.mark.exercise("N.M")`. The grader runs
them with pytest, in this process, against the student's `exercises/NN_*.py` (default) or
against the package's own solutions (`--reference`), and prints one row per exercise:
an exercise scores 1 when all of its checks pass, and its first failing check's message
is shown otherwise. Exceptions in student code fail a check; they never stop the grader.
The exit status is 0 either way; the last line is `score: X/Y`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB = re.compile(r'NotImplementedError\("exercise (\d+\.\d+): (\w[\w ]*?) --')


def exercise_names(only: str | None) -> dict[str, str]:
    """{"0.1": "format_answer", ...} from the stubs in exercises/, in notebook order."""
    names = {}
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.py")):
        if only is None or path.name.startswith(only + "_"):
            names.update(dict(STUB.findall(path.read_text())))
    return names


class Collector:
    """A pytest plugin that records each check's outcome under its exercise id."""

    def __init__(self):
        self.exercise_of = {}             # test node id -> "N.M"
        self.results = defaultdict(list)  # "N.M" -> [(check name, passed, message)]

    def pytest_collection_modifyitems(self, items):
        for item in items:
            if marker := item.get_closest_marker("exercise"):
                self.exercise_of[item.nodeid] = marker.args[0]

    def pytest_runtest_logreport(self, report):
        # one entry per check: its call phase, or the setup phase if that already failed
        exercise = self.exercise_of.get(report.nodeid)
        if exercise and (report.when == "call" or report.failed):
            message = "" if report.passed else first_line(report)
            self.results[exercise].append((report.nodeid.split("::")[-1], report.passed, message))


def first_line(report) -> str:
    """The most useful one-line reason a check failed."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash else str(report.longrepr)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "failed")[:160]


def run_checks(target: str, only: str | None) -> Collector:
    pattern = f"test_{only}_*.py" if only else "test_[0-9][0-9]_*.py"
    files = sorted(str(p) for p in (ROOT / "tests" / "exercises").glob(pattern))
    collector = Collector()
    os.environ["MINIRL_GRADE_TARGET"] = target
    if not files:
        return collector
    import pytest

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        pytest.main([*files, "-q", "--tb=line", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                     "-o", "addopts="], plugins=[collector])
    return collector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.grade", description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true", help="grade the package's own solutions")
    parser.add_argument("--only", metavar="NN", help="one notebook's exercises, e.g. 00")
    parser.add_argument("--dir", type=Path, help="grade exercise files in this directory instead of exercises/")
    args = parser.parse_args(argv)
    if args.only is not None and not re.fullmatch(r"\d\d", args.only):
        parser.error(f"--only {args.only!r}: give a two-digit notebook number such as 00")

    target = "reference" if args.reference else str(args.dir.resolve()) if args.dir else "exercises"
    names = exercise_names(args.only)
    results = run_checks(target, args.only).results
    ids = sorted(set(names) | set(results), key=lambda i: tuple(map(int, i.split("."))))

    print(f"grading {'reference solutions' if args.reference else target}")
    print(f"{'exercise':<9} {'function':<28} {'checks':>7}  score  first failing check")
    total = 0
    for i in ids:
        checks = results.get(i, [])
        passed = sum(ok for _, ok, _ in checks)
        score = int(bool(checks) and passed == len(checks))
        total += score
        why = "no checks found" if not checks else next((f"{n}: {m}" for n, ok, m in checks if not ok), "")
        print(f"{i:<9} {names.get(i, '?'):<28} {passed:>3}/{len(checks):<3}  {score:>5}  {why}")
    print(f"score: {total}/{len(ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
