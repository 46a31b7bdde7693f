"""Files that are never half-written: atomic text and JSON, JSON lines, the summary file.

Hand-written (it teaches nothing). Every write that a crash could cut in half goes through a
temporary file in the same directory and an `os.replace`, which is atomic on POSIX and
Windows: a reader sees the old file or the new one, never a mix.

`writing(path, temporary)` is the one rule for a write that fails (a full or read-only disk):
the temporary file or directory goes, and the failure comes out as the OSError it is, naming
what could not be written, however the writer reported it (`as_write_error`). Every chapter's
one line for it is `minirl.runtime.training_cli.write_failure`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _disk_of(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def as_write_error(err: BaseException, where, temporary=None) -> OSError | None:
    """`err` as the OSError of a write that failed at `where` (a full or read-only disk, no permission), or None.

    Writers say it in their own ways: an OSError (named after `where` when it names no file or a
    file inside `temporary`, which is about to go), safetensors' SafetensorError ("... (os error
    28)", no file named), torch.save's RuntimeError ("unexpected pos": its zip writer's short write,
    no errno; taken for a full or read-only disk only when the disk holding `where` is one).
    """
    where, temporary = Path(where), None if temporary is None else Path(temporary)
    if isinstance(err, OSError):
        if err.errno not in WRITE_ERRNOS:
            return None
        name = Path(err.filename) if err.filename else None
        if name is not None and temporary is not None and name.is_relative_to(temporary):
            name = where / name.relative_to(temporary) if name != temporary else where
        if name is not None and str(name) == str(err.filename):
            return err
        return OSError(err.errno, err.strerror, str(name or where))
    if type(err).__name__ == "SafetensorError":
        code = re.search(r"\(os error (\d+)\)|code: (\d+)", str(err))
        number = int(code.group(1) or code.group(2)) if code else None
        return OSError(number, os.strerror(number), str(where)) if number in WRITE_ERRNOS else None
    if not isinstance(err, RuntimeError):           # torch.save's short write (and a rank's report of one)
        return None
    try:
        disk = os.statvfs(_disk_of(where))
    except (OSError, AttributeError):                # AttributeError: no statvfs (Windows)
        return None
    if disk.f_flag & os.ST_RDONLY:
        number = errno.EROFS
    elif disk.f_bavail * disk.f_frsize < 2**20:
        number = errno.ENOSPC
    else:
        return None
    return OSError(number, os.strerror(number), str(where))


@contextlib.contextmanager
def writing(where, temporary=None):
    """Around the write of `where` (through `temporary`, a file or directory renamed into place when whole).

    On any failure `temporary` is deleted (nothing half-written stays, and the space comes back);
    a failure to write (`as_write_error`) is raised as that OSError naming `where`, from the original.
    """
    try:
        yield
    except BaseException as err:
        error = as_write_error(err, where, temporary)   # first: the disk is full until `temporary` goes
        if temporary is not None:
            if Path(temporary).is_dir():
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                Path(temporary).unlink(missing_ok=True)
        if error is None or error is err:
            raise
        raise error from err


def temporary_beside(where, prefix: str = ".tmp-") -> Path:
    """A new temporary directory beside `where` (`prefix` + its name + a random part), for `writing(where, it)`;
    a failure to make it (a full or read-only disk) is an OSError naming `where`."""
    where = Path(where)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{where.name}-", dir=where.parent))
    except OSError as err:
        error = as_write_error(err, where, err.filename)
        if error is None or error is err:
            raise
        raise error from err


def atomic_write_text(path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename; returns the path."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with writing(path, tmp):
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return path


def atomic_write_json(path, value) -> Path:
    """`value` as indented JSON (keys sorted; anything unusual through `str`), written atomically."""
    return atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl(path, records: list[dict]) -> Path:
    """Replace `path` with one JSON object per line, atomically."""
    return atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def append_jsonl(path, record: dict) -> None:
    """Append one JSON object as a line (a crash may cut the last line; `read_jsonl` skips it)."""
    with writing(path), open(path, "a", encoding="utf-8") as f:
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
