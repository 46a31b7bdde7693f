"""Grade the exercises: `python -m minirl.grade [--reference] [--only NN[,NN]] [--dir DIR] [--timeout S]`.

Hand-written (it teaches nothing). Each exercise N.M has checks in
`tests/exercises/test_NN_*.py`, marked `@pytest.mark.exercise("N.M")`. The grader runs
them with pytest against the student's `exercises/NN_*.py` (default), the exercise files of
another directory (`--dir`), or the package's own solutions (`--reference`), and prints one
row per exercise: an exercise scores 1 when all of its checks pass, and its first failing
check's message is shown otherwise. The last line is `score: X/Y`; the exit status is 0.

Student code cannot take the grader down with it. The checks run under pytest in a child
process (`minirl.grade_child`) that reports each check's start and outcome over a pipe. An exercise gets
--timeout seconds for all of its checks together; importing an exercise file gets the same
again, on its own clock. When an exercise runs past its time, or the child dies inside one
of its checks (`os._exit`, a segfault), the parent kills the child, scores that exercise 0
("timeout" or "crash") and starts a fresh child that skips what has been graded. A
`KeyboardInterrupt` or `pytest.exit` raised by student code fails that check only.

No exercise can change another's score. Each notebook's checks run in a child of their own
(a Python start-up and the imports of torch, a few seconds each), so nothing one notebook's
code does to the interpreter reaches another's. Inside a child, the attributes of torch's
public namespaces (`torch`, `torch.Tensor`, `torch.nn.functional`, `torch.testing`, ...),
`math` and `builtins`, and torch's global settings (default dtype, grad mode, threads), are
put back as they were after every check: a student function that patches `torch.allclose`
or `torch.Tensor.sum` cannot make a later check pass or fail.

Student code cannot change the package or forge its score. Before any student code runs, the
grader reads what the checks read (the package, the checks, the notebooks' sources, the exercise
files graded) into memory; each child runs in a fresh temporary copy of it (read-only where the
file system lets it), so a solution that writes into the package it imports writes into a copy
that is thrown away. After each child the installed package is compared with what was read: a
file written by its absolute path is put back (what it had become is kept in a temporary folder
the row names: an edit of the package made while the grader runs looks the same), and that
notebook's exercises score 0 ("tampered"). The child reports over a pipe whose every line starts
with a secret token handed to it on its standard input before any student code runs; a line
without it ("passed" events written to the pipe by the code under test) stops the child and
scores 0 what it was running. Simplified: student code shares the interpreter with the checks,
so code written to dig the token out of the grader's own objects, or to patch pytest, could
still lie; this grader is for learning, not an exam proctor.

Ctrl-C stops the child and prints the table so far, the exercises not graded marked
"interrupted", and a last line `score: X/Y (interrupted)`; the exit status is then 130.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minirl.grade_child import GRADED, CheckoutSnapshot, remove_copy

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "exercises"
STUB = re.compile(r'NotImplementedError\("exercise (\d+\.\d+): (\w[\w ]*?) --')
STARTUP_S = 120.0  # a child's start-up and collection, and the gaps between checks: no student code runs there
CHILD = "from minirl.grade_child import child_main; child_main({!r})"   # the child process's program
INTERRUPTED = 130  # the exit status after Ctrl-C, as a shell reports SIGINT


def exercise_names(only: list[str] | None) -> dict[str, str]:
    """{"0.1": "format_answer", ...} from the stubs in exercises/ (of the notebooks in `only`), in notebook order."""
    names = {}
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.py")):
        if only is None or path.name[:2] in only:
            names.update(dict(STUB.findall(path.read_text())))
    return names


def notebook_of(exercise: str) -> int:
    return int(exercise.split(".")[0])


def exercise_key(exercise: str) -> tuple[int, ...]:
    return tuple(map(int, exercise.split(".")))


# ---------------------------------------------------------------- in the child: the checks under pytest


class Child:
    """The child process running the checks in a copy of the checkout, and where it is: which check,
    importing or not, since when."""

    def __init__(self, files: list[Path], target: str, skip: dict, snapshot: CheckoutSnapshot):
        self.files, self.copy = files, snapshot.lay_out()
        read, write = os.pipe()
        self.token = secrets.token_hex(16)  # the child's lines must start with it: student code never sees it
        self.log = tempfile.TemporaryFile()  # the child's own output: shown only if it dies outside a check
        env = dict(os.environ, MINIRL_GRADE_TARGET=target if target == "reference" else str(self.copy / GRADED),
                   PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(self.copy), os.environ.get("PYTHONPATH")])))
        env.pop("MINIRL_GRADE_FD", None)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CHILD.format([str(f.relative_to(ROOT)) for f in files])],
                cwd=self.copy, env=env, pass_fds=(write,), stdin=subprocess.PIPE, stdout=self.log,
                stderr=subprocess.STDOUT, start_new_session=True)  # a group of its own: Ctrl-C reaches us only
            with self.proc.stdin:  # read by the child before it imports any student code
                self.proc.stdin.write(json.dumps({"fd": write, "token": self.token, "skip": skip}).encode() + b"\n")
        finally:
            os.close(write)
        os.set_blocking(read, False)
        self.fd, self.buffer, self.eof, self.done = read, b"", False, False
        self.node: str | None = None  # the check running now
        self.loading = False  # the check's setup is importing the exercise file
        self.clock = time.monotonic()  # when the current phase started

    def events(self) -> list[dict]:
        """The events that arrived; sets `eof` once the child has exited and the pipe is drained."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:  # nothing now; if the child has exited, nothing ever (a grandchild
                self.eof = self.proc.poll() is not None  # may hold the pipe open after its parent died)
                break
            if not data:
                self.eof = True
                break
            self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [self.parse(line) for line in lines if line.strip()]

    def parse(self, line: bytes) -> dict:
        """One line `TOKEN {json}` as an event; a line without the token is {"event": "forged"}."""
        token, _, body = line.partition(b" ")
        if not hmac.compare_digest(token, self.token.encode()):
            return {"event": "forged"}
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        os.close(self.fd)
        self.log.close()
        remove_copy(self.copy)

    def how_it_ended(self) -> str:
        code = self.proc.wait()
        if code < 0:
            name = signal.Signals(-code).name
            return f"killed the process ({name}{', a segmentation fault' if name == 'SIGSEGV' else ''})"
        return f"ended the process (exit code {code}{', os._exit?' if code else ''})"

    def last_output(self) -> str:
        self.log.seek(0)
        lines = [ln.strip() for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:120] if lines else "no output"


class Grader:
    """Runs the checks in a child process, keeps each exercise's clock, records every check's outcome."""

    def __init__(self, files: list[Path], target: str, timeout: float, names: dict[str, str],
                 snapshot: CheckoutSnapshot):
        self.files, self.target, self.timeout, self.names, self.snapshot = files, target, timeout, names, snapshot
        self.exercise_of: dict[str, str] = {}  # check node id -> "N.M"
        self.outcome: dict[str, tuple[bool, str]] = {}  # check node id -> (passed, message)
        self.status: dict[str, str] = {}  # "N.M" -> why it scores 0 whatever its checks say (timeout, crash)
        self.used: dict[str, float] = {}  # "N.M" -> seconds its checks have run
        self.child: Child | None = None
        self.notebook: int | None = None  # the notebook whose checks the current child runs

    def run(self) -> None:
        """Each notebook's checks in a child of their own; after a timeout or a crash, a fresh child for
        that notebook runs its checks not yet run."""
        for path in self.files:
            self.notebook = int(re.match(r"test_(\d\d)_", path.name)[1])
            skip = {"nodes": [], "exercises": []}
            while skip is not None:
                self.child = Child([path], self.target, skip, self.snapshot)
                skip = self.watch(self.child)
                self.child = None
                if self.package_changed():
                    skip = None

    def package_changed(self) -> bool:
        """After a child: if the installed package differs from the snapshot, put it back, and the notebook's
        exercises score 0 ("tampered")."""
        changed = self.snapshot.changed()
        if changed:
            kept = self.snapshot.put_back(changed)
            why = (f"tampered: the checks' process wrote into the package ({', '.join(changed[:3])}"
                   f"{', ...' if len(changed) > 3 else ''}); put back as it was (what it wrote: {kept})")
            self.status.update({i: why for i in self.exercises() if notebook_of(i) == self.notebook})
        return bool(changed)

    def watch(self, child: Child) -> dict | None:
        """Follow the child to its end; returns what a fresh child must skip, or None when all is done."""
        with selectors.DefaultSelector() as selector:
            selector.register(child.fd, selectors.EVENT_READ)
            while True:
                selector.select(timeout=min(max(self.deadline(child) - time.monotonic(), 0.0), 0.5))
                for event in child.events():
                    if event["event"] == "forged":
                        child.stop()
                        return self.lost(child, "tampered: a line on the grader's pipe without its token "
                                                "(written by the code under test)")
                    self.handle(child, event)
                if child.eof:
                    child.stop()
                    return None if child.done else self.lost(child, self.crash_reason(child))
                if time.monotonic() > self.deadline(child):
                    child.stop()
                    return self.lost(child, self.timeout_reason(child))

    def deadline(self, child: Child) -> float:
        if child.node is None:
            return child.clock + max(STARTUP_S, self.timeout)
        if child.loading:
            return child.clock + self.timeout
        return child.clock + self.timeout - self.used.get(self.exercise_of[child.node], 0.0)

    def handle(self, child: Child, event: dict) -> None:
        now, kind = time.monotonic(), event["event"]
        if kind == "collected":
            self.exercise_of.update(event["checks"])
        elif kind == "collect_error":
            self.status.update({i: f"crash: the checks did not load: {event['message']}"
                                for i in self.ungraded(notebook=event["notebook"])})
        elif kind == "start":
            child.node, child.loading, child.clock = event["node"], False, now
        elif kind == "load":
            self.charge(child, now)
            child.loading = True
        elif kind == "loaded":
            child.loading, child.clock = False, now
        elif kind == "report":
            previous = self.outcome.get(event["node"])
            if previous is None or previous[0]:  # the first failure (setup, call or teardown) is the one shown
                self.outcome[event["node"]] = (event["passed"], event["message"])
        elif kind == "finish":
            self.charge(child, now)
            child.node, child.loading = None, False
        elif kind == "done":
            child.done = True

    def charge(self, child: Child, now: float) -> None:
        """Add the time since the clock last started to the running check's exercise."""
        if child.node is not None and not child.loading:
            exercise = self.exercise_of[child.node]
            self.used[exercise] = self.used.get(exercise, 0.0) + now - child.clock
        child.clock = now

    def crash_reason(self, child: Child) -> str:
        how = child.how_it_ended()
        if child.node is None:
            return f"crash: the checks' process died outside any check ({child.last_output()})"
        if child.loading:
            return f"crash: importing the exercise file {how}"
        return f"crash: {child.node.split('::')[-1]} {how}"

    def timeout_reason(self, child: Child) -> str:
        if child.node is None:
            return f"timeout: the checks did not run within {max(STARTUP_S, self.timeout):g} s"
        if child.loading:
            return f"timeout: importing the exercise file took over {self.timeout:g} s"
        return f"timeout: over {self.timeout:g} s, stopped in {child.node.split('::')[-1]} (a loop that never ends?)"

    def lost(self, child: Child, why: str) -> dict | None:
        """The child is gone: score 0 what it was in, and say what a fresh child must skip (None: stop).

        In a check, that is the check's exercise. While importing an exercise file, it is every
        exercise of that notebook not yet graded. Outside any check the cause is not student
        code (none runs there), so every exercise of the notebook not yet graded scores 0 and no
        child follows for it.
        """
        if child.node is None:
            self.status.update({i: why for i in self.ungraded(notebook=self.notebook)})
            return None
        exercise = self.exercise_of[child.node]
        lost = self.ungraded(notebook=notebook_of(exercise)) if child.loading else [exercise]
        self.status.update({i: why for i in lost})
        if not self.ungraded(notebook=self.notebook):
            return None
        return {"nodes": sorted(self.outcome), "exercises": sorted(self.status)}

    def exercises(self) -> list[str]:
        return sorted(set(self.names) | set(self.exercise_of.values()) | set(self.status), key=exercise_key)

    def checks(self, exercise: str) -> list[str]:
        return [node for node, e in self.exercise_of.items() if e == exercise]

    def ungraded(self, notebook: int | None = None) -> list[str]:
        """Exercises (of one notebook) with checks not run yet, or none collected yet, and no status."""
        return [i for i in self.exercises() if i not in self.status and (notebook is None or notebook_of(i) == notebook)
                and (not self.checks(i) or any(n not in self.outcome for n in self.checks(i)))]

    def interrupt(self) -> None:
        if self.child is not None:
            for event in self.child.events():  # what the child reported before Ctrl-C and we had not read yet
                if event["event"] == "forged":
                    break
                self.handle(self.child, event)
            self.child.stop()
            self.package_changed()

    def row(self, exercise: str, interrupted: bool) -> tuple[int, int, int, str]:
        """(checks passed, checks, score, why) for one exercise."""
        checks = self.checks(exercise)
        passed = sum(self.outcome.get(n, (False, ""))[0] for n in checks)
        why = self.status.get(exercise, "")
        if not why and interrupted and exercise in self.ungraded():
            why = "interrupted (not graded)"
        if not why and not checks:
            why = "no checks found"
        if not why and any(n not in self.outcome for n in checks):
            why = "not run (the checks' process stopped early)"
        if not why:
            why = next((f"{n.split('::')[-1]}: {self.outcome[n][1]}" for n in checks if not self.outcome[n][0]), "")
        return passed, len(checks), int(not why), why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.grade", description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true", help="grade the package's own solutions")
    parser.add_argument("--only", metavar="NN[,NN]", help="these notebooks' exercises, e.g. 00 or 00,01")
    parser.add_argument("--dir", type=Path, help="grade exercise files in this directory instead of exercises/")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds each exercise's checks may run in all (default: %(default)g)")
    args = parser.parse_args(argv)
    if args.only is not None and not re.fullmatch(r"\d\d(,\d\d)*", args.only):
        parser.error(f"--only {args.only!r}: give two-digit notebook numbers such as 00 or 00,01")
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout:g}: give a positive number of seconds, such as 60")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {str(args.dir)!r}: no such directory")

    target = "reference" if args.reference else str(args.dir.resolve()) if args.dir else "exercises"
    only = args.only.split(",") if args.only else None
    names = exercise_names(only)
    files = sorted(f for f in CHECKS.glob("test_[0-9][0-9]_*.py") if only is None or f.name[5:7] in only)
    folder = None if args.reference else args.dir.resolve() if args.dir else ROOT / "exercises"
    graded = [] if folder is None else [path for f in files for path in sorted(folder.glob(f"{f.name[5:7]}_*.py"))]
    print(f"grading {'reference solutions' if args.reference else target}", flush=True)
    grader = Grader(files, target, args.timeout, names, CheckoutSnapshot(ROOT, graded))
    interrupted = False
    try:
        if files:
            grader.run()
    except KeyboardInterrupt:
        interrupted = True
        grader.interrupt()
    print(f"{'exercise':<9} {'function':<30} {'checks':>7}  score  first failing check")
    total = 0
    for i in grader.exercises():
        passed, count, score, why = grader.row(i, interrupted)
        total += score
        print(f"{i:<9} {names.get(i, '?'):<30} {passed:>3}/{count:<3}  {score:>5}  {why}")
    if interrupted:
        print(f"score: {total}/{len(grader.exercises())} (interrupted)")
        return INTERRUPTED
    print(f"score: {total}/{len(grader.exercises())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
