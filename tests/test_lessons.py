"""The lessons stay lessons (issue 29): each notebook reads in an evening, and most of its code is not package code.

A notebook holds what the source teaches; plumbing lives in minirl/runtime/ (tools/build.py's HAND_WRITTEN).
Measured on the jupytext sources: all lines, and the non-blank lines of code cells, of which those in export
cells (`# | export minirl/...`) are package code. `python tests/test_lessons.py` prints the table.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
MAX_LINES, MAX_TOTAL, MAX_EXPORTED = 1600, 12000, 0.70
EXPORT = re.compile(r"^#\s*\|\s*export\s+minirl/")


def measure(text: str) -> dict:
    """lines: all lines; code: non-blank lines of code cells; exported: those of export cells."""
    lines = text.split("\n")
    code = exported = 0
    kind, first = None, None
    for line in lines:
        if line.startswith("# %%"):
            kind, first = ("markdown" if "[markdown]" in line else "code"), None
            continue
        if kind != "code" or not line.strip():
            continue
        first = line if first is None else first
        code += 1
        exported += bool(EXPORT.match(first))
    return {"lines": len(lines), "code": code, "exported": exported}


SIZES = {p.stem: measure(p.read_text()) for p in NOTEBOOKS}


def test_the_measure_counts_export_cells():
    text = "# %% [markdown]\n# prose\n\n# %%\n# | export minirl/x.py\ndef f():\n    pass\n\n# %%\nf()\n"
    assert measure(text) == {"lines": 11, "code": 4, "exported": 3}


@pytest.mark.parametrize("name", list(SIZES))
def test_a_lesson_reads_in_an_evening(name):
    size = SIZES[name]
    assert size["lines"] <= MAX_LINES, f"{name}: {size['lines']} lines (at most {MAX_LINES})"
    share = size["exported"] / max(size["code"], 1)
    assert share <= MAX_EXPORTED, f"{name}: {share:.0%} of its code lines are package code (at most 70 %)"


def test_the_lessons_together():
    total = sum(s["lines"] for s in SIZES.values())
    assert total <= MAX_TOTAL, f"the notebooks hold {total} lines (at most {MAX_TOTAL})"


COMMANDS = ("pip install -r requirements.txt && python chapters/01_single_process.py --out runs/01",
            "pip install -r requirements.txt && python -m pytest")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:January|February|March|April|May|June|July|August|September|"
                  r"October|November|December) 20\d\d\b")
LOAD = re.compile(r"\bload(?: average)?(?: of| at| was|:)? ~?\d|\(load \d", re.I)


def history(text: str) -> list[str]:
    """The lines of `text` that give a date or a machine load (a lab log's marks)."""
    return [line for line in text.splitlines() if DATE.search(line) or LOAD.search(line)]


def test_history_finds_dates_and_loads():
    assert history("Tried on 2026-12-01 at\nload 8.2-18.2\nmachine (load 0.20)\nthe load factor\nupload 5") == [
        "Tried on 2026-12-01 at", "load 8.2-18.2", "machine (load 0.20)"]


def test_the_readme_reads_in_five_minutes():
    """At most 150 lines, the two commands verbatim, short table rows, no dates or machine loads."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md: {len(lines)} lines (at most 150)"
    for command in COMMANDS:
        assert f"\n{command}\n" in text, f"README.md lacks the command {command!r} on a line of its own"
    assert "## The learning path" in text, "tools/render.py builds the site's index from that table"
    shown = [re.sub(r"\]\([^)]*\)", "]", line) for line in lines if line.startswith("|")]  # links as read
    wide = [line[:60] for line in shown if len(line) > 130]
    assert not wide, f"README.md table rows over 130 characters: {wide}"
    assert not history(text), history(text)


def test_the_benchmarks_readme_is_not_a_lab_log():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert not history(text), history(text)


if __name__ == "__main__":
    for name, s in SIZES.items():
        print(f"{name:24s} {s['lines']:6d} lines  code {s['code']:5d}  exported {s['exported']:5d} "
              f"({s['exported'] / max(s['code'], 1):.0%})")
    print(f"{'total':24s} {sum(s['lines'] for s in SIZES.values()):6d} lines")
