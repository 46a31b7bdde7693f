"""Files that are never half-written: atomic text and JSON, JSON lines, the summary file.

Hand-written (it teaches nothing). Every write that a crash could cut in half goes through a
temporary file in the same directory and an `os.replace`, which is atomic on POSIX and
Windows: a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path, value) -> Path:
    """`value` as indented JSON (keys sorted; anything unusual through `str`), written atomically."""
    return atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl(path, records: list[dict]) -> Path:
    """Replace `path` with one JSON object per line, atomically."""
    return atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def append_jsonl(path, record: dict) -> None:
    """Append one JSON object as a line (a crash may cut the last line; `read_jsonl` skips it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path) -> list[dict]:
    """The records of a JSON-lines file; a truncated last line (a crash mid-append) is dropped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
    return records


def write_summary(out, summary: dict) -> Path:
    """Write `out/summary.json` atomically and return its path."""
    return atomic_write_json(Path(out) / "summary.json", summary)
