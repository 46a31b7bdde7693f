"""The grader's child process: runs one notebook's checks under pytest and reports each over a pipe.

Hand-written (it teaches nothing); `minirl.grade` starts it as
`python -c "from minirl.grade_child import child_main; child_main([...])"` and reads its events.
`Reporter` is the pytest plugin that sends each check's start and outcome; `GlobalState` puts
the attributes of torch's public namespaces, `math`, `builtins` and torch's global settings back
as they were after every check, so that no student function can change a later check's result.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class StoppedByCode(Exception):
    """A KeyboardInterrupt or pytest.exit raised by the code under test, turned into a failed check."""


class Reporter:
    """A pytest plugin (in the child) that sends each event to the parent as one JSON line."""

    def __init__(self, out, skip_nodes: set[str], skip_exercises: set[str]):
        self.out, self.skip_nodes, self.skip_exercises = out, skip_nodes, skip_exercises
        self.state: GlobalState | None = None

    def send(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
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


def child_main(files: list[str]) -> None:
    """Run the checks files; the events go to the pipe whose fd is in MINIRL_GRADE_FD."""
    out = os.fdopen(int(os.environ["MINIRL_GRADE_FD"]), "w")
    skip = json.loads(os.environ["MINIRL_GRADE_SKIP"])
    parent = os.getppid()

    def watch_parent():  # a parent killed hard cannot stop us: do not spin on alone
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(3)

    threading.Thread(target=watch_parent, daemon=True).start()
    reporter = Reporter(out, set(skip["nodes"]), set(skip["exercises"]))
    pytest.main([*files, "-q", "--tb=line", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                 "-o", "addopts="], plugins=[reporter])
    out.flush()
    os._exit(0)  # not sys.exit: a thread the code under test left running must not keep us alive


# ---------------------------------------------------------------- in the parent: children, clocks, the table
