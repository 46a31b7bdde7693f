"""Issue 34 item 2: a full or read-only disk ends chapters 01, 04, 06 and 07 with one line, and leaves no temporary.

Each chapter runs as a user would, with --out on a small tmpfs: too small for the first checkpoint
(case A: "no checkpoint was written yet", and the command that starts again, never --resume), or
big enough for two checkpoints and not the third (case B: the last intact checkpoint and the
--resume command); and chapter 01 resumed onto checkpoints that became read-only. Each checks the
exit status (1), that stderr ends with the one line naming what could not be written, no traceback,
and no `.tmp*` left under --out (looked for before the tmpfs is unmounted).

The tmpfs is mounted by `mount` (root), else inside a user namespace (`unshare -rm`, where the
chapter then runs too); the tests are skipped, saying why, only when neither is allowed. A
checkpoint of the embedded policy is about 12 MB (weights and AdamW state); chapter 07 also
writes a 4 MB snapshot first.
"""

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from refusals import load_factor

REPO = Path(__file__).resolve().parent.parent
FIRST, MID_RUN = "6m", "30m"      # the first checkpoint does not fit / two fit, the third does not
TINY = ["--steps", "4", "--checkpoint-every", "1", "--prompts-per-step", "2", "--num-generations", "2"]
FLAGS = {
    "01_single_process.py": [*TINY, "--eval-every", "0", "--no-progress"],
    "04_fsdp_lora.py": ["--nproc-per-node", "2", *TINY, "--eval-every", "0"],
    "06_ray.py": [*TINY, "--eval-every", "0", "--num-cpus", "1"],
    "07_async.py": ["--steps", "4", "--checkpoint-every", "1", "--producers", "2", "--prompts-per-call", "2",
                    "--prompts-per-step", "4", "--num-generations", "2", "--env-latency", "0.001"],
}

# $1: the mount point, $2: its size, $3: where to list what is left, $4: "ro" to remount it read-only first
# (after copying $1.saved into it); the rest: the command. Exit 97: the mount was refused.
ON_A_TMPFS = r"""
dir=$1 size=$2 left=$3 mode=$4
shift 4
mount -t tmpfs -o "size=$size" tmpfs "$dir" || exit 97
trap 'umount "$dir"' EXIT
if [ "$mode" = ro ]; then
    cp -a "$dir.saved/." "$dir/" && rm -rf "$dir.saved" && mount -o remount,ro "$dir" || exit 98
fi
"$@"
status=$?
find "$(dirname "$dir")" -name '.tmp*' > "$left"
exit $status
"""


@functools.cache
def mounter() -> list[str]:
    """The prefix that lets this process's children mount a tmpfs: [] (root), or `unshare -rm` (a user namespace)."""
    probe = tempfile.mkdtemp(prefix="minirl-tmpfs-probe-")
    why = []
    try:
        for prefix in ([], ["unshare", "-rm"]):
            if prefix and shutil.which("unshare") is None:
                why.append("no unshare command")
                continue
            proc = subprocess.run([*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0" && umount "$0"', probe],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return prefix
            why.append(f"{' '.join(prefix) or 'mount'}: {proc.stderr.strip() or proc.returncode}")
    finally:
        os.rmdir(probe)
    pytest.skip("cannot mount a small tmpfs here, neither as root nor in a user namespace (" + "; ".join(why) + ")")


def on_tmpfs(tmp_path, script, size, *args, mount_at=None, read_only=False, timeout=300):
    """(exit status, stdout, stderr, the `.tmp*` paths left) of a chapter run with a tmpfs of `size` at `mount_at`
    (default: the --out directory, `tmp_path/run`)."""
    out = tmp_path / "run"
    where = mount_at or out
    where.mkdir(parents=True, exist_ok=True)
    left = tmp_path / "left.txt"
    command = [*mounter(), "sh", "-c", ON_A_TMPFS, "sh", str(where), size, str(left), "ro" if read_only else "rw",
               sys.executable, str(REPO / "chapters" / script), "--out", str(out), *map(str, args)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout * load_factor(),
                          env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"})
    assert proc.returncode not in (97, 98), f"the tmpfs: {proc.stderr[-2000:]}"
    return proc.returncode, proc.stdout, proc.stderr, left.read_text().split()


def check_one_line(code, stdout, stderr, left, out, script, checkpoint, why="No space left on device"):
    """Exit 1; stderr's last line names what could not be written and goes on from `checkpoint` (a step, or None)."""
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert left == [], f"temporaries left under --out: {left}"
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    lines = [line for line in stderr.splitlines() if "cannot write" in line]
    assert lines == [last], stderr[-3000:]
    written = checkpoint + 1 if checkpoint else 1
    assert re.match(rf"error: cannot write {out}/checkpoints/step-{written:06d}\S* \({why}\): ", last), last
    if checkpoint is None:
        assert "no checkpoint was written yet; start the run again with: " in last and "--resume" not in last, last
        assert re.search(rf"{script}( --nproc-per-node 2)? --out {out} --overwrite$", last), last
    else:
        assert f"the last intact checkpoint is {out}/checkpoints/step-{checkpoint:06d}; continue with: " in last, last
        assert re.search(rf"{script}( --nproc-per-node 2)? --out {out} --resume$", last), last


@pytest.mark.parametrize("script, size, checkpoint", [
    ("01_single_process.py", FIRST, None), ("01_single_process.py", MID_RUN, 2),
    ("07_async.py", FIRST, None), ("07_async.py", MID_RUN, 2),
    ("04_fsdp_lora.py", MID_RUN, 2),                       # slower (two ranks): mid-run only
    pytest.param("06_ray.py", FIRST, None, marks=pytest.mark.ray),   # Ray starts slowly: the first checkpoint only
])
def test_a_full_disk_ends_the_chapter_in_one_line(tmp_path, script, size, checkpoint):
    if script == "06_ray.py":
        pytest.importorskip("ray")
    check_one_line(*on_tmpfs(tmp_path, script, size, *FLAGS[script]), tmp_path / "run", script, checkpoint)


def test_checkpoints_that_turned_read_only_end_chapter_01_in_one_line(tmp_path):
    """Two checkpoints written, then their directory remounted read-only: the resumed run stops at its next one."""
    out = tmp_path / "run"
    flags = FLAGS["01_single_process.py"]
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "01_single_process.py"), "--out", str(out), *flags,
                           "--stop-after", "2"], capture_output=True, text=True, cwd=REPO, timeout=300 * load_factor(),
                          env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"})
    assert proc.returncode == 1 and "stopped after step 2" in proc.stdout, proc.stderr[-3000:]
    (out / "checkpoints").rename(out / "checkpoints.saved")
    code, stdout, stderr, left = on_tmpfs(tmp_path, "01_single_process.py", "64m", "--resume", "--no-progress",
                                          mount_at=out / "checkpoints", read_only=True)
    check_one_line(code, stdout, stderr, left, out, "01_single_process.py", 2, why="Read-only file system")
    assert "make it writable" in stderr.splitlines()[-1]


def test_every_writer_s_report_of_a_failed_write_is_one_oserror_naming_what_it_was_for(tmp_path):
    """`writing`: the temporary goes on any error; safetensors' SafetensorError and an OSError naming a file in the
    temporary come out as the OSError naming the checkpoint's file; other errors pass through unchanged."""
    import errno

    from safetensors import SafetensorError

    from minirl.runtime.io import as_write_error, writing

    final, tmp = tmp_path / "step-000003", tmp_path / ".tmp-step-000003-x"
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    tmp.mkdir()
    with pytest.raises(OSError) as raised, writing(final, tmp):
        raise full
    assert (raised.value.errno, raised.value.filename, raised.value.__cause__) == (errno.ENOSPC, str(final), full)
    assert not tmp.exists(), "the temporary is gone"
    ro = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp / "training_state.pt"))
    assert as_write_error(ro, final, tmp).filename == str(final / "training_state.pt")
    assert as_write_error(OSError(errno.ENOENT, "gone", "x"), final, tmp) is None, "not a disk's"
    assert as_write_error(KeyboardInterrupt(), final, tmp) is None
    assert as_write_error(RuntimeError("unexpected pos 1 vs 2"), final, tmp) is None, "this disk has room"
    tmp.mkdir()
    with pytest.raises(ValueError), writing(final, tmp):
        raise ValueError("a bug")
    assert not tmp.exists()
