"""minirl.parallel.launch.torchrun, the one launcher: a script or a function, and no rank left alive after a
timeout, even a rank that ignores SIGTERM (torchrun starts every rank in a session of its own)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from minirl.parallel.launch import stop_job, torchrun

HANG = """
import os, signal, sys, time
from pathlib import Path
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)       # a rank stuck where SIGTERM does not reach it
Path(sys.argv[1], f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
print("rank", os.environ["RANK"], "waiting", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_pids(folder, n: int, seconds: float = 60.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        files = sorted(folder.glob("rank-*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"the ranks never started: {sorted(folder.iterdir())}")


@pytest.mark.distributed
@pytest.mark.parametrize("sigterm", ["obey", "ignore"])
def test_a_timed_out_launch_leaves_no_rank_alive(tmp_path, sigterm):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        torchrun(script, 2, [tmp_path, sigterm], timeout=25, grace=2.0)
    pids = wait_for_pids(tmp_path, 2, seconds=1.0)        # they ran: the timeout is what ended them
    assert "waiting" in expired.value.output
    assert len(set(pids)) == 2 and not any(alive(p) for p in pids), f"ranks {pids} still running"
    assert time.monotonic() - started < 25 + 3 * 2.0 + 10, "SIGKILL follows SIGTERM after the grace period"


def test_stop_job_ends_a_process_tree_in_sessions_of_its_own(tmp_path):
    """What torchrun does to its ranks, by hand: a parent whose child sits in a new session."""
    child = "import subprocess, sys, time; " \
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); " \
            f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(p.pid)); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    grandchild = int((tmp_path / "child.pid").read_text())
    assert alive(grandchild)
    stop_job(parent.pid, grace=2.0)
    parent.wait(timeout=10)
    assert not alive(parent.pid) and not alive(grandchild)


@pytest.mark.distributed
def test_a_function_target_runs_on_every_rank(tmp_path, monkeypatch):
    (tmp_path / "hello_ranks.py").write_text(
        "import os, sys\ndef main():\n    print(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: "
        "{sys.argv[1:]} threads {os.environ['OMP_NUM_THREADS']}\", flush=True)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    job = torchrun("hello_ranks:main", 2, ["--flag", 3], timeout=120, threads=2)
    assert job.returncode == 0, job.stdout[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: ['--flag', '3'] threads 2" in job.stdout, job.stdout[-2000:]


def test_bad_nproc_is_refused():
    with pytest.raises(ValueError, match=r"nproc=0: must be an int >= 1"):
        torchrun("x.py", 0)


def test_one_launcher_in_the_package():
    """Every torchrun job of minirl goes through launch.torchrun (whose timeout ends the ranks)."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "minirl"
    launching = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                       if "torch.distributed.run" in p.read_text())
    assert launching == ["parallel/launch.py"], launching
