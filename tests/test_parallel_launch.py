"""minirl.runtime.launch.torchrun, the one launcher: a script or a function, and no rank left alive after a
timeout, even a rank that ignores SIGTERM (torchrun starts every rank in a session of its own)."""

import os
import re
import subprocess
import sys
import time

import psutil
import pytest
from refusals import load_factor

from minirl.runtime.launch import REPO, stop_job, torchrun

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
    timeout = 25 * load_factor()                          # long enough for two ranks to start on a busy machine
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        torchrun(script, 2, [tmp_path, sigterm], timeout=timeout, grace=2.0)
    pids = wait_for_pids(tmp_path, 2, seconds=1.0)        # they ran: the timeout is what ended them
    assert "waiting" in expired.value.output
    assert len(set(pids)) == 2 and not any(alive(p) for p in pids), f"ranks {pids} still running"
    assert time.monotonic() - started < timeout + 3 * 2.0 + 10 * load_factor(), \
        "SIGKILL follows SIGTERM after the grace period"


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
    parent.wait(timeout=10 * load_factor())
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


def test_one_launcher_in_the_package_and_the_chapters():
    """Every torchrun job that minirl or a chapter starts goes through runtime/launch.py's torchrun (whose timeout
    ends the ranks); chapter 04's --nproc-per-node is its in-process mode."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    launching = sorted(str(p.relative_to(root)) for folder in ("minirl", "chapters", "benchmarks")
                       for p in (root / folder).rglob("*.py") if "torch.distributed.run" in p.read_text())
    assert launching == ["minirl/runtime/launch.py"], launching


# --- a job that stops early (issue 22): who died, which signal, one line from one rank ---------------------------

STOPPING = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from minirl.parallel.launch import init_distributed
from minirl.runtime.stops import StopSignals, rank_processes, why_stopped
rank, processes = int(os.environ["RANK"]), [(None, os.getpid())]
with StopSignals() as signals:                      # what chapter 04's main does around its ranks
    try:
        init_distributed("gloo", "cpu")
        processes = rank_processes()
        if rank == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)      # the last rank dies
        elif rank == 0:
            dist.recv(torch.zeros(1), src=1)          # until rank 1 is gone: the dead one, or one torchrun stopped
        else:
            time.sleep(300)                           # until torchrun's SIGTERM
    except BaseException as err:
        signals.quiet()
        stop = why_stopped(err, signals, processes, rank, sys.argv[1])
        if stop.what is not None:
            print("stop line:", stop.what, flush=True)
        os._exit(stop.code)
"""


def stop_lines(output: str) -> list[str]:
    return [line.split("stop line: ", 1)[1] for line in output.splitlines() if line.startswith("stop line: ")]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_every_job_with_the_same_master_port_says_who_died(tmp_path):
    """torchrun names every job started with --master_port "none": a second job on the same host and port still
    says who died (issue 34: a stop marker left by the first one silenced every later job)."""
    script = tmp_path / "stopping.py"
    script.write_text(STOPPING)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(port), "--nproc_per_node", "2",
           str(script), str(tmp_path)]
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"))
    for job in (1, 2):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=120 * load_factor())
        finally:
            stop_job(proc.pid)
        said = stop_lines(output)
        assert proc.returncode != 0 and len(said) == 1, (job, output[-3000:])
        assert re.fullmatch(r"rank 1 \(pid \d+ on \S+\) died", said[0]), (job, said)
    assert not list((tmp_path / "tmp").glob("minirl-*")), "no marker file left behind"


@pytest.mark.distributed
def test_the_rank_named_dead_is_the_one_that_died_not_one_torchrun_stopped(tmp_path):
    """Three ranks: rank 2 dies (SIGKILL), torchrun stops rank 1 (SIGTERM), and only then does rank 0 see that
    rank 1 is gone too: it names rank 2 alone."""
    script = tmp_path / "stopping.py"
    script.write_text(STOPPING)
    job = torchrun(script, 3, [tmp_path], timeout=120 * load_factor())
    said = stop_lines(job.stdout)
    assert job.returncode != 0 and len(said) == 1, job.stdout[-3000:]
    assert re.fullmatch(r"rank 2 \(pid \d+ on \S+\) died", said[0]), said


def test_dead_ranks_sees_a_process_of_this_host_that_ended():
    import socket

    from minirl.runtime.stops import dead_ranks
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        processes = [(socket.gethostname(), os.getpid()), (socket.gethostname(), child.pid),
                     ("another-host", child.pid)]
        assert dead_ranks(processes) == [], "alive: nobody is dead; another host is never judged"
        child.kill()
        time.sleep(0.5)                                 # a zombie until reaped: dead all the same
        assert dead_ranks(processes) == [1]
        child.wait()
        assert dead_ranks(processes) == [1]
    finally:
        child.kill()
        child.wait()


def _stop(err, received=(), rank=0, processes=None, out="/tmp/run", wait=0.0):
    from minirl.runtime.stops import StopSignals, why_stopped

    signals = StopSignals()
    signals.received = list(received)
    import socket
    processes = processes or [(socket.gethostname(), os.getpid()), (socket.gethostname(), os.getpid())]
    return why_stopped(err, signals, processes, rank, out, wait=wait)


def test_why_stopped_says_each_stop_once_from_one_rank(monkeypatch):
    import errno
    import signal
    import socket

    import torch.distributed as dist

    from minirl.runtime.ranks import RankFailed
    from minirl.runtime.stops import Terminated
    from minirl.runtime.validate import ConfigError

    stores = []

    def new_job():                                  # what torchrun gives its ranks: its agent's store for the job
        stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(stores[-1].port))

    # Ctrl-C: rank 0 says it, once, exit 130; rank 1 is quiet (also when its error is the broken collective)
    new_job()
    assert _stop(RuntimeError("Connection reset by peer"), [signal.SIGINT], rank=1).what is None
    stop = _stop(KeyboardInterrupt())
    assert (stop.what, stop.code) == ("interrupted", 130) and _stop(KeyboardInterrupt()).what is None
    # an error every rank met: rank 0 says it; bad input is exit 2 and needs no resume hint
    bad = ConfigError("lora_target_modules", "wq", "matches no linear layer")
    bad.agreed = True
    stop = _stop(bad)
    assert stop.code == 2 and not stop.resumable and stop.what.startswith("error: lora_target_modules='wq'")
    assert _stop(bad, rank=1).what is None
    # a full disk on rank 1 reaches rank 0 as RankFailed with the OSError: one line naming the file
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/run/checkpoints/.tmp-step-000004/rank-1.pt")
    stop = _stop(RankFailed("writing: rank 1 failed with OSError", 1, full))
    assert stop.code == 1 and stop.resumable
    assert stop.what.startswith("error: cannot write /tmp/run/checkpoints/.tmp-step-000004/rank-1.pt (No space")
    # a rank of this host that died: the lowest rank alive says so, once (the rank that died may have said why)
    new_job()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host = socket.gethostname()
    three = [(host, os.getpid()), (host, child.pid), (host, os.getpid())]
    said = [_stop(RuntimeError("Connection reset by peer"), rank=r, processes=three) for r in (2, 0, 0)]
    assert said[0].what is None, "rank 2 is not the lowest rank alive"
    assert said[1].what == f"rank 1 (pid {child.pid} on {host}) died" and said[1].code == 1
    assert said[2].what is None, "said once"
    # this rank's own error (nobody else has it), once per job
    new_job()
    stop = _stop(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore"), rank=1)
    assert stop.what == f"rank 1 (pid {os.getpid()} on {host}) failed with RuntimeError: CUDA out of memory. " \
                        "Tried to allocate 2 GiB" and stop.code == 1
    # SIGTERM without a dead rank: someone stopped the job
    new_job()
    stop = _stop(RuntimeError("Connection closed by peer"), [signal.SIGTERM])
    assert (stop.what, stop.code) == ("stopped by SIGTERM", 143)
    # a rank that ended after coming here (torchrun stopped it) did not die: only the one that did is named
    new_job()
    stopped = subprocess.Popen([sys.executable, "-c", "pass"])
    stopped.wait()
    three = [(host, os.getpid()), (host, stopped.pid), (host, child.pid)]
    assert _stop(Terminated(), [signal.SIGTERM], rank=1, processes=three).what is None, "rank 1, before it ended"
    stop = _stop(RuntimeError("Connection closed by peer"), [signal.SIGTERM], rank=0, processes=three)
    assert (stop.what, stop.code) == (f"rank 2 (pid {child.pid} on {host}) died", 1)
    # a rank that said its own error and ended: nobody names it dead, and the SIGTERM that follows adds no line
    new_job()
    two = [(host, os.getpid()), (host, stopped.pid)]
    assert _stop(ValueError("bad row"), rank=1, processes=two).what == f"rank 1 (pid {stopped.pid} on {host}) " \
                                                                       "failed with ValueError: bad row"
    stop = _stop(RuntimeError("Connection closed by peer"), [signal.SIGTERM], rank=0, processes=two)
    assert (stop.what, stop.code) == (None, 143)


def test_stop_signals_raise_once_and_deferred_signals_wait_for_the_block():
    import signal

    from minirl.runtime.stops import StopSignals, Terminated, deferred_signals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)              # the second one is only recorded
        events = []
        with pytest.raises(Terminated):
            with deferred_signals():
                signal.raise_signal(signal.SIGTERM)
                events.append("the block finished first")
        assert events == ["the block finished first"]
        assert signals.received == [signal.SIGINT, signal.SIGINT, signal.SIGTERM]
        signals.quiet()
        signal.raise_signal(signal.SIGTERM)            # quiet: recorded, nothing raised
    assert signal.getsignal(signal.SIGTERM) is before, "the handlers are put back"


def test_relaunch_command_repeats_the_world(monkeypatch):
    from minirl.runtime.stops import relaunch_command

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert relaunch_command("chapters/04_fsdp_lora.py", ["--out", "runs/my run", "--resume"]) == \
        "torchrun --nproc_per_node 8 chapters/04_fsdp_lora.py --out 'runs/my run' --resume"
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert relaunch_command("x.py", ["--resume"]).startswith("torchrun --nnodes 2 --nproc_per_node 8 x.py")


def test_a_rank_is_named_before_the_ranks_have_swapped_their_pids():
    """A rank that fails before `rank_processes()` knows only its own (host, pid): others are named by rank."""
    from minirl.runtime.stops import _names

    assert _names([0, 1], [("host", 5)]) == "rank 0 (pid 5 on host), rank 1"
