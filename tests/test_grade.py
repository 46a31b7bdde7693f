"""The grader: stubs score zero, the reference scores full marks, student errors never crash it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def grade(*args: str) -> tuple[list[str], int, int]:
    """Run the grader; return its table rows and the X, Y of its last line `score: X/Y`."""
    out = subprocess.run([sys.executable, "-m", "minirl.grade", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    x, y = map(int, re.fullmatch(r"score: (\d+)/(\d+)", lines[-1]).groups())
    return lines, x, y


def test_untouched_stubs_score_zero_and_reference_full_marks():
    rows, x, y = grade()
    assert y >= 4 and x == 0, "\n".join(rows)
    assert all("NotImplementedError" in r for r in rows[2:-1]), "each stub's row names the failing check"
    rows, x, y_ref = grade("--reference")
    assert x == y_ref == y, "\n".join(rows)


def test_partial_work_and_broken_code(tmp_path):
    source = (ROOT / "exercises" / "00_task_and_policy.py").read_text()
    solved = source.replace(
        'raise NotImplementedError("exercise 0.1: format_answer -- see its docstring and notebook 00")',
        'digits = str(abs(value))[::-1] if reverse else str(abs(value))\n    return ("-" if value < 0 else "") + digits')
    solved = solved.replace(
        'raise NotImplementedError("exercise 0.2: parse_answer -- see its docstring and notebook 00")',
        'raise KeyError("student bug")')
    assert solved != source
    (tmp_path / "00_task_and_policy.py").write_text(solved)
    rows, x, y = grade("--only", "00", "--dir", str(tmp_path))
    assert (x, y) == (1, 4), "\n".join(rows)
    assert any(r.startswith("0.2") and "KeyError" in r for r in rows), "\n".join(rows)

    (tmp_path / "00_task_and_policy.py").write_text(source + "\ndef broken(:\n")
    rows, x, y = grade("--only", "00", "--dir", str(tmp_path))
    assert (x, y) == (0, 4), "a file that does not import scores 0 without crashing the grader"


def test_only_rejects_a_bad_notebook_number():
    out = subprocess.run([sys.executable, "-m", "minirl.grade", "--only", "7"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--only '7'" in out.stderr
