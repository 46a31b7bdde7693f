"""The grader's child process: runs one notebook's checks under pytest, in a copy of the checkout, and reports each
over a pipe.

Hand-written (it teaches nothing); `minirl.grade` starts it in a copy of the checkout as
`python -c "from minirl.grade_child import child_main; child_main([...])"`, hands it the pipe and a
secret token on its standard input, and reads its events: one line each, `TOKEN {json}`.
`CheckoutSnapshot` is that copy's content, read by the parent before any student code runs;
`Reporter` is the pytest plugin that sends each check's start and outcome; `GlobalState` puts
the attributes of torch's public namespaces, `math`, `builtins` and torch's global settings back
as they were after every check, so that no student function can change a later check's result.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

READ_BY_CHECKS = ("minirl/**/*", "tests/conftest.py", "tests/exercises/conftest.py",  # what a child reads
                  "tests/exercises/test_[0-9][0-9]_*.py", "notebooks/[0-9][0-9]_*.py", "pyproject.toml")
GRADED = "graded"  # the folder of the exercise files graded, in a child's copy


class StoppedByCode(Exception):
    """A KeyboardInterrupt or pytest.exit raised by the code under test, turned into a failed check."""


class Reporter:
    """A pytest plugin (in the child) that sends each event to the parent as one JSON line."""

    def __init__(self, out, token: str, skip_nodes: set[str], skip_exercises: set[str]):
        self.out, self.token, self.skip_nodes, self.skip_exercises = out, token, skip_nodes, skip_exercises
        self.state: GlobalState | None = None

    def send(self, **event) -> None:
        self.out.write(f"{self.token} {json.dumps(event)}\n")
        self.out.flush()

    def pytest_collection_modifyitems(self, config, items):
        keep, checks = [], {}
        for item in items:
            marker = item.get_closest_marker("exercise")
            if marker and item.nodeid not in self.skip_nodes and marker.args[0] not in self.skip_exercises:
                keep.append(item)
                checks[item.nodeid] = marker.args[0]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
        self.state = GlobalState()  # after the checks' imports, before any student code runs
        self.send(event="collected", checks=checks)

    def pytest_collectreport(self, report):
        if report.failed and (m := re.search(r"test_(\d\d)_\w*\.py$", report.nodeid)):
            self.send(event="collect_error", notebook=int(m[1]), message=first_line(report))

    def pytest_runtest_logstart(self, nodeid, location):
        self.send(event="start", node=nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.argname != "ex":
            return (yield)
        self.send(event="load")  # importing the exercise file: its own clock
        try:
            return (yield)
        finally:
            self.send(event="loaded")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from stopped_by_code())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from stopped_by_code())

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.failed:
            self.send(event="report", node=report.nodeid, passed=report.passed,
                      message="" if report.passed else first_line(report))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        try:
            return (yield from stopped_by_code())
        finally:
            if self.state is not None:
                self.state.restore()  # whatever this check's code patched, the next check does not see

    def pytest_runtest_logfinish(self, nodeid, location):
        self.send(event="finish", node=nodeid)

    def pytest_sessionfinish(self, session, exitstatus):
        self.send(event="done")


class GlobalState:
    """What student code may patch in the interpreter, saved once and put back after every check.

    The attributes of a few namespaces every check uses (a replaced function is restored, an
    added attribute removed unless it is a submodule that an import bound there) and torch's
    global settings. Not saved: the random number generators (the checks seed their own).
    """

    def __init__(self):
        import builtins
        import math

        import torch
        import torch.nn.functional
        import torch.testing

        self.torch = torch
        self.spaces = [torch, torch.Tensor, torch.nn.functional, torch.testing, torch.linalg, torch.nn.Module,
                       math, builtins]
        self.saved = [dict(vars(space)) for space in self.spaces]
        self.settings = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())

    def restore(self) -> None:
        for space, saved in zip(self.spaces, self.saved, strict=True):
            now = vars(space)
            for name in [n for n in now if n not in saved and not isinstance(now[n], types.ModuleType)]:
                delattr(space, name)
            for name, value in saved.items():
                if now.get(name, _MISSING) is not value:
                    setattr(space, name, value)
        dtype, grad, threads = self.settings
        self.torch.set_default_dtype(dtype)
        self.torch.set_grad_enabled(grad)
        if self.torch.get_num_threads() != threads:
            self.torch.set_num_threads(threads)


_MISSING = object()


def stopped_by_code():
    """The body of a hook wrapper: pytest stops the whole run on these two; here they fail one check."""
    try:
        return (yield)
    except (KeyboardInterrupt, pytest.exit.Exception) as e:
        raise StoppedByCode(f"{type(e).__name__} raised by the code under test") from None


def first_line(report) -> str:
    """The most useful one-line reason a check failed."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash else str(report.longrepr)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else "failed"
    if m := re.match(r'File "(.+)", line (\d+)', line):  # a SyntaxError: its message is on the last line
        line = f"{lines[-1]} ({Path(m[1]).name}, line {m[2]})"
    return line.removeprefix(f"{__name__}.{StoppedByCode.__name__}: ")[:160]


class CheckoutSnapshot:
    """What the checks read of the checkout at `root`, as it was before any student code ran: {path relative to
    the root: bytes}.

    `lay_out` writes a fresh copy for one child; `changed` lists the installed files that differ
    from it now (changed, removed, or new in the package), and `put_back` restores them.
    """

    def __init__(self, root: Path, exercise_files: list[Path]):
        self.root = root
        self.files = {str(path.relative_to(self.root)): path.read_bytes()
                      for pattern in READ_BY_CHECKS for path in sorted(self.root.glob(pattern))
                      if path.is_file() and "__pycache__" not in path.parts}
        self.installed = set(self.files)  # the exercise files graded are the student's own: not watched
        self.files.update({f"{GRADED}/{path.name}": path.read_bytes() for path in exercise_files if path.is_file()})

    def lay_out(self) -> Path:
        """A fresh temporary copy, files and folders read-only (root may still write into it: it is thrown away)."""
        where = Path(tempfile.mkdtemp(prefix="minirl-grade-"))
        (where / GRADED).mkdir()
        for rel, data in self.files.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(data)
        for folder, _, names in os.walk(where, topdown=False):
            for name in names:
                os.chmod(os.path.join(folder, name), 0o444)
            os.chmod(folder, 0o555)
        return where

    def changed(self) -> list[str]:
        now = {str(path.relative_to(self.root)) for path in self.root.glob("minirl/**/*")
               if path.is_file() and "__pycache__" not in path.parts}
        differ = [rel for rel in sorted(self.installed)
                  if not (self.root / rel).is_file() or (self.root / rel).read_bytes() != self.files[rel]]
        return differ + sorted(now - self.installed)

    def put_back(self, paths: list[str]) -> Path:
        """Put `paths` back as they were (a new one is removed); returns the folder that keeps what they had become
        (the grader cannot tell a student's write from an edit made meanwhile: nothing is lost)."""
        kept = Path(tempfile.mkdtemp(prefix="minirl-grade-changed-"))
        for rel in paths:
            if (self.root / rel).is_file():
                (kept / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.root / rel, kept / rel)
            if rel in self.installed:
                (self.root / rel).write_bytes(self.files[rel])
            else:
                (self.root / rel).unlink()
        return kept


def remove_copy(where: Path) -> None:
    """Remove a child's copy of the checkout (its folders are read-only)."""
    for folder, _, _ in os.walk(where):
        os.chmod(folder, 0o755)
    shutil.rmtree(where, ignore_errors=True)


def child_main(files: list[str]) -> None:
    """Run the checks files (paths relative to the copy of the checkout this module is in); the events go to
    the pipe whose fd the first line of standard input names, each line led by that line's token."""
    setup = json.loads(sys.stdin.readline())  # {"fd": ..., "token": ..., "skip": {"nodes": [...], "exercises": [...]}}
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the code under test reads nothing from the grader
    os.close(null)
    out, skip, root = os.fdopen(setup["fd"], "w"), setup["skip"], Path(__file__).resolve().parent.parent
    parent = os.getppid()

    def watch_parent():  # a parent killed hard cannot stop us (nor remove our copy): do not spin on alone
        while os.getppid() == parent:
            time.sleep(1)
        remove_copy(root)
        os._exit(3)

    threading.Thread(target=watch_parent, daemon=True).start()
    reporter = Reporter(out, setup.pop("token"), set(skip["nodes"]), set(skip["exercises"]))
    pytest.main([*files, "-q", "--tb=line", "-p", "no:cacheprovider", "--rootdir", str(root),
                 "-o", "addopts="], plugins=[reporter])
    out.flush()
    os._exit(0)  # not sys.exit: a thread the code under test left running must not keep us alive
