"""The grader: stubs score zero, the reference scores full marks, student code never takes it down.

The planted bad code goes into a copy of notebook 03's exercise file (its checks are pure
arithmetic, so the child's work is start-up, and a small --timeout is safe on a busy machine).
"""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from refusals import load_factor

ROOT = Path(__file__).resolve().parents[1]
MEMORY = "03_training_memory.py"
REFERENCE = "\nfrom minirl.memory.calculator import {}  # noqa: E402  planted: the reference answer\n"


def grade(*args: str, expect: int = 0, timeout: float = 300, root: Path = ROOT) -> tuple[list[str], int, int]:
    """Run the grader of the checkout at `root`; return its output lines and the X, Y of its last line `score: X/Y`."""
    out = subprocess.run([sys.executable, "-m", "minirl.grade", *args], cwd=root, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == expect, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    x, y = map(int, re.fullmatch(r"score: (\d+)/(\d+)", lines[-1]).groups())
    return lines, x, y


def row(lines: list[str], exercise: str) -> str:
    return next(line for line in lines if line.startswith(exercise + " "))


def stub_count() -> int:
    return sum(len(re.findall(r'NotImplementedError\("exercise \d+\.\d+', p.read_text()))
               for p in (ROOT / "exercises").glob("[0-9][0-9]_*.py"))


def plant(directory: Path, name: str, bodies: dict[str, str], tail: str = "") -> Path:
    """A copy of exercises/<name> in `directory` with the stub of each exercise in `bodies` replaced."""
    text = (ROOT / "exercises" / name).read_text()
    for exercise, code in bodies.items():
        text, n = re.subn(rf'raise NotImplementedError\("exercise {re.escape(exercise)}:[^\n]*',
                          lambda _, code=code: code, text)
        assert n == 1, f"no stub of exercise {exercise} in exercises/{name}"
    (directory / name).write_text(text + tail)
    return directory


def test_untouched_stubs_score_zero_and_reference_full_marks():
    rows, x, y = grade()
    assert y == stub_count() >= 4 and x == 0, "\n".join(rows)
    assert all("NotImplementedError" in r for r in rows[2:-1]), "each stub's row names the failing check"
    rows, x, y_ref = grade("--reference")
    assert x == y_ref == y, "\n".join(rows)


def solved_files(directory: Path, *names: str) -> Path:
    """The exercise files `names` (default: all) with their solutions put back, written into `directory`."""
    spec = importlib.util.spec_from_file_location("minirl_tools_build", ROOT / "tools" / "build.py")
    build_tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build_tool
    spec.loader.exec_module(build_tool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", build_tool.BuildWarning)
        solved = build_tool.exercise_files(build_tool.read_notebooks(ROOT)[1], solutions=True)
    for rel, text in solved.items():
        assert "NotImplementedError(\"exercise" not in text
        if not names or Path(rel).name in names:
            (directory / Path(rel).name).write_text(text)
    return directory


def test_solved_exercise_files_score_full_marks(tmp_path):
    """The exercise files with their solutions put back pass every check: their imports are enough."""
    rows, x, y = grade("--dir", str(solved_files(tmp_path)))
    assert x == y == stub_count(), "\n".join(rows)


def test_partial_work_and_broken_code(tmp_path):
    plant(tmp_path, "00_task_and_policy.py", {
        "0.1": 'digits = str(abs(value))[::-1] if reverse else str(abs(value))\n'
               '    return ("-" if value < 0 else "") + digits',
        "0.2": 'raise KeyError("student bug")'})
    rows, x, y = grade("--only", "00", "--dir", str(tmp_path))
    assert (x, y) == (1, 4), "\n".join(rows)
    assert "KeyError" in row(rows, "0.2"), "\n".join(rows)

    (tmp_path / MEMORY).write_text((ROOT / "exercises" / MEMORY).read_text() + "\ndef broken(:\n")
    rows, x, y = grade("--only", "03", "--dir", str(tmp_path))
    assert (x, y) == (0, 4), "a file that does not import scores 0 without crashing the grader"
    assert "SyntaxError" in row(rows, "3.1"), "\n".join(rows)


def test_hang_exit_and_keyboard_interrupt_cost_one_exercise_each(tmp_path):
    plant(tmp_path, MEMORY, {"3.2": "while True:\n        pass",
                             "3.3": '__import__("os")._exit(1)',
                             "3.4": "raise KeyboardInterrupt"}, tail=REFERENCE.format("bytes_per_param"))
    start = time.monotonic()
    rows, x, y = grade("--only", "03", "--dir", str(tmp_path), "--timeout", "5", timeout=120)
    assert time.monotonic() - start < 100
    assert (x, y) == (1, 4), "\n".join(rows)
    assert row(rows, "3.1").split()[-1] == "1", "the correct exercise keeps its mark"
    assert "timeout: over 5 s, stopped in test_zero_per_gpu_stages" in row(rows, "3.2"), "\n".join(rows)
    assert "crash: test_checkpointed_none_and_full ended the process (exit code 1" in row(rows, "3.3"), \
        "\n".join(rows)
    assert "2/2" not in row(rows, "3.4") and "KeyboardInterrupt raised by the code under test" in row(rows, "3.4"), \
        "the checks after a hang and a crash still run; a KeyboardInterrupt fails its check only"


def test_segfault_costs_one_exercise(tmp_path):
    plant(tmp_path, MEMORY, {"3.1": '__import__("ctypes").string_at(0)'}, tail=REFERENCE.format("zero_per_gpu"))
    rows, x, y = grade("--only", "03", "--dir", str(tmp_path), "--timeout", "20", timeout=120)
    assert (x, y) == (1, 4), "\n".join(rows)
    assert "crash: test_bytes_per_param_mixed killed the process (SIGSEGV" in row(rows, "3.1"), "\n".join(rows)
    assert row(rows, "3.2").split()[-1] == "1", "the exercise after the crash is graded in a fresh process"


def test_hang_while_importing_costs_that_notebook_only(tmp_path):
    (tmp_path / MEMORY).write_text((ROOT / "exercises" / MEMORY).read_text() + "\n__import__('time').sleep(3600)\n")
    rows, x, y = grade("--only", "03", "--dir", str(tmp_path), "--timeout", "5", timeout=120)
    assert (x, y) == (0, 4), "\n".join(rows)
    assert all("timeout: importing the exercise file took over 5 s" in r for r in rows[2:-1]), "\n".join(rows)


def test_ctrl_c_prints_the_table_so_far(tmp_path):
    marker = tmp_path / "hanging"
    plant(tmp_path, MEMORY, {"3.2": f"open({str(marker)!r}, 'w').write(str(__import__('os').getpid()))\n"
                                    "    while True:\n        pass"}, tail=REFERENCE.format("bytes_per_param"))
    grader = subprocess.Popen([sys.executable, "-m", "minirl.grade", "--only", "03", "--dir", str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the planted hang never started"
        grader.send_signal(signal.SIGINT)
        out, err = grader.communicate(timeout=30 * load_factor())
    finally:
        grader.kill()
    lines = out.strip().splitlines()
    assert grader.returncode == 130, out + err
    assert lines[-1] == "score: 1/4 (interrupted)", out + err
    assert row(lines, "3.1").split()[-1] == "1", "what was graded before Ctrl-C keeps its mark"
    assert all("interrupted (not graded)" in row(lines, i) for i in ("3.2", "3.3", "3.4")), out
    assert "Traceback" not in err, err
    hung, gone = int(marker.read_text()), False
    for _ in range(50):  # the grader killed it before printing; give init a moment to reap it if need be
        try:
            os.kill(hung, 0)
        except ProcessLookupError:
            gone = True
            break
        time.sleep(0.1)
    assert gone, "the child running the hanging check is stopped with the grader"


ALLCLOSE_ALWAYS_TRUE = "\n__import__('torch').allclose = lambda *args, **kwargs: True  # planted\n"
PATCHES_IN_A_CHECK = ("    __import__('torch').allclose = lambda *args, **kwargs: True  # planted\n"
                      "    __import__('torch').Tensor.sum = lambda self, *a, **k: self.new_zeros(())  # planted\n")
POPULATION_STD = ("    r = rewards.view(-1, num_generations)\n"
                  "    return ((r - r.mean(1, keepdim=True)) / (r.std(1, correction=0, keepdim=True) + 1e-4))"
                  ".view(-1)\n")


def score_of(rows: list[str], exercise: str) -> int:
    return int(row(rows, exercise).split()[3])


def edit_function(path: Path, name: str, *, prepend: str = "", body: str | None = None) -> None:
    """In the exercise file `path`, put `prepend` at the start of function `name`'s body (after its
    docstring), or replace its body with `body`."""
    text = path.read_text()
    start = text.index(f"def {name}(")
    doc = text.index('"""', start)
    begin = text.index("\n", text.index('"""', doc + 3)) + 1           # the line after the docstring
    end = text.index("\n\n\n", begin) + 1
    text = text[:begin] + prepend + (text[begin:end] if body is None else body) + text[end:]
    path.write_text(text)


def test_an_exercise_that_patches_torch_cannot_pass_another_notebooks_wrong_exercise(tmp_path):
    """Notebook 00's file replaces torch.allclose; notebook 01's wrong 1.2 (population std) still fails."""
    plant(tmp_path, "00_task_and_policy.py", {}, tail=ALLCLOSE_ALWAYS_TRUE)
    solved_files(tmp_path, "01_single_process.py")
    edit_function(tmp_path / "01_single_process.py", "group_advantages", body=POPULATION_STD)
    rows, x, y = grade("--only", "00,01", "--dir", str(tmp_path))
    assert score_of(rows, "1.2") == 0, "\n".join(rows)
    assert score_of(rows, "1.1") == 1, "the other solved exercises of notebook 01 keep their marks\n" + "\n".join(rows)


def test_a_patch_inside_one_check_is_undone_before_the_next(tmp_path):
    """Exercise 1.1's solution also patches torch.allclose and torch.Tensor.sum when it runs: the wrong
    1.2 still fails, and every correct exercise after it keeps its mark."""
    solved_files(tmp_path, "01_single_process.py")
    edit_function(tmp_path / "01_single_process.py", "selective_log_softmax", prepend=PATCHES_IN_A_CHECK)
    edit_function(tmp_path / "01_single_process.py", "group_advantages", body=POPULATION_STD)
    rows, x, y = grade("--only", "01", "--dir", str(tmp_path))
    assert score_of(rows, "1.2") == 0, "\n".join(rows)
    assert x == y - 1, "every exercise but 1.2 passes: the patches did not outlive their check\n" + "\n".join(rows)


def test_bad_arguments():
    for args, message in ((["--only", "7"], "--only '7'"), (["--only", "00,1"], "--only '00,1'"),
                          (["--timeout", "0"], "--timeout 0"), (["--dir", "/nonexistent"], "--dir '/nonexistent'")):
        out = subprocess.run([sys.executable, "-m", "minirl.grade", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def checkout_copy(directory: Path) -> Path:
    """What the grader reads of this checkout (the package, the checks, the notebooks, the stubs), copied into
    `directory`: an attack on the installed package hits this copy, never the checkout the suite runs from."""
    ignore = shutil.ignore_patterns("__pycache__", "*.ipynb", "wrong")
    for folder in ("minirl", "tests/exercises", "notebooks", "exercises"):
        shutil.copytree(ROOT / folder, directory / folder, ignore=ignore)
    for name in ("tests/conftest.py", "pyproject.toml"):
        shutil.copy(ROOT / name, directory / name)
    return directory


def test_a_solution_that_writes_into_the_package_changes_no_score_and_not_the_package(tmp_path):
    """Notebook 00's file appends a torch.allclose patch to minirl/__init__.py, by the path of the package it
    imports and by the installed package's own path: notebook 01's wrong 1.2 still fails, notebook 00 scores 0
    for tampering, and the installed package is as it was."""
    root = checkout_copy(tmp_path / "checkout")
    init = root / "minirl" / "__init__.py"
    before = init.read_bytes()
    patch = "\n__import__('torch').allclose = lambda *args, **kwargs: True  # planted\n"
    plant(tmp_path, "00_task_and_policy.py", {}, tail=(
        "\nimport minirl as _minirl  # planted: every later import of minirl patches torch.allclose\n"
        f"for _path in (_minirl.__file__, {str(init)!r}):\n"
        "    try:\n"
        f"        open(_path, 'a').write({patch!r})\n"
        "    except OSError:\n"
        "        pass\n"))
    solved_files(tmp_path, "01_single_process.py")
    edit_function(tmp_path / "01_single_process.py", "group_advantages", body=POPULATION_STD)
    rows, x, y = grade("--only", "00,01", "--dir", str(tmp_path), root=root)
    assert init.read_bytes() == before, "the installed package is as it was before grading\n" + "\n".join(rows)
    assert score_of(rows, "1.2") == 0, "\n".join(rows)
    assert score_of(rows, "1.1") == 1, "\n".join(rows)
    assert all("tampered: the checks' process wrote into the package (minirl/__init__.py" in row(rows, i)
               for i in ("0.1", "0.2", "0.3", "0.4")), "\n".join(rows)
    kept = Path(re.search(r"what it wrote: (\S+)\)", row(rows, "0.1"))[1])
    assert "# planted" in (kept / "minirl" / "__init__.py").read_text(), "what it had become is kept, not lost"
    shutil.rmtree(kept)


def test_forged_events_on_the_grader_channel_score_nothing(tmp_path):
    """Notebook 03's file, when imported, writes "passed" for every check of the notebook to each pipe it holds
    open for writing (the grader's channel among them) and leaves: the forgery is seen and scores 0."""
    checks = re.findall(r"^def (test_\w+)", (ROOT / "tests/exercises/test_03_training_memory.py").read_text(), re.M)
    nodes = [f"tests/exercises/test_03_training_memory.py::{name}" for name in checks]
    (tmp_path / MEMORY).write_text((ROOT / "exercises" / MEMORY).read_text() + f"""
import json as _json, os as _os, stat as _stat  # noqa: E401,E402  planted: forge a full score
_lines = [_json.dumps({{"event": "report", "node": node, "passed": True, "message": ""}}) for node in {nodes!r}]
_lines.append(_json.dumps({{"event": "done"}}))
for _fd in map(int, _os.listdir("/proc/self/fd")):
    try:
        if _fd > 2 and _stat.S_ISFIFO(_os.fstat(_fd).st_mode):
            _os.write(_fd, ("\\n".join(_lines) + "\\n").encode())
    except OSError:
        pass
_os._exit(0)
""")
    rows, x, y = grade("--only", "03", "--dir", str(tmp_path), timeout=120)
    assert (x, y) == (0, 4), "\n".join(rows)
    assert all("tampered: " in row(rows, i) for i in ("3.1", "3.2", "3.3", "3.4")), "\n".join(rows)
