"""Starting a torchrun job from Python, and ending it: the one launcher every notebook, test and chapter uses.

Hand-written (it teaches nothing about RL): notebook 04 teaches what a rank does inside a job
(`minirl.parallel.launch`); this module only starts one and stops it.

- `torchrun(target, nproc, args)` runs `torch.distributed.run --standalone --nproc-per-node N`
  on a script or on a "package.module:function". By default in a subprocess whose output
  comes back as text (`capture=True`: the notebooks, the tests and the measurement jobs of
  notebooks 03 and 08); with `capture=False`, torchrun's launcher runs in this process and the
  ranks write to this process's terminal (`python chapters/04_fsdp_lora.py --nproc-per-node N`),
  quiet: torchrun's own log lines and failure report are dropped, the ranks say what happened.
- `stop_job(pid)` ends a job and every rank it started (torchrun puts each rank in a session
  of its own, so signalling the launcher's process group is not enough).
- `leave(code)` ends a rank without the interpreter's teardown, where a gloo thread can abort
  a rank whose work is done.
- `output_ends(text)` is what an error message shows of a long job output.

Simplified vs torchrun's CLI: one node (`--standalone`), no elastic restarts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def leave(code: int = 0) -> None:
    """End this rank's process now with exit status `code`, after flushing stdout and stderr.

    A rank whose work is done can still die in the interpreter's teardown: a gloo thread that
    is still joinable gets destroyed, and C++ aborts the process ("terminate called without
    an active exception", SIGABRT). Measured on a two-rank job: 1 run in 29 aborted at exit;
    with os._exit, which skips that teardown, 0 in 87. Call it last, after closing the group.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun_command(target, nproc: int, args=()) -> list[str]:
    """torchrun's arguments (after `python -m torch.distributed.run`) that start `target` on `nproc` local ranks.

    target: a script's path, or "package.module:function" (every rank imports the module, calls
    the function, which reads its flags from sys.argv, then `leave(0)`).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: must be an int >= 1")
    module, _, function = str(target).partition(":")
    if function and not Path(str(target)).exists():       # an entry point, not a file
        entry = ["--no-python", sys.executable, "-c",     # `leave`: no teardown abort after the work is done
                 f"from {module} import {function}; from minirl.runtime.launch import leave; {function}(); leave(0)"]
    else:
        entry = [str(target)]
    return ["--standalone", f"--nproc-per-node={nproc}", *entry, *map(str, args)]


def torchrun(target, nproc: int, args=(), *, capture: bool = True, timeout: float | None = 600,
             stream: bool = False, threads: int = 1, env: dict | None = None,
             grace: float = 5.0) -> subprocess.CompletedProcess:
    """Run `target` (see `torchrun_command`) on `nproc` local ranks; returns the finished job.

    `env` is added to the ranks' environment.
    capture=True: torchrun runs in a subprocess of its own session, its ranks importing this
    checkout's minirl (PYTHONPATH) with `threads` torch threads each; stdout and stderr come back
    together in `.stdout` (stream=True also prints them as they come: a notebook cell shows
    progress). After `timeout` seconds (None: no limit), or on Ctrl-C, `stop_job` ends all of
    them (SIGTERM, then SIGKILL `grace` seconds later), and a timeout raises
    subprocess.TimeoutExpired with the output so far.
    capture=False: torchrun's launcher runs in this process and its ranks inherit this process's
    environment, stdout and stderr (progress bars on a terminal); quiet: torchrun's log lines
    and failure report are dropped, a Ctrl-C reaches the ranks as SIGINT (they say where the run
    stopped). `.returncode` is the ranks' exit status: 128 + the signal when one stopped them
    (130 on Ctrl-C), the first failed rank's status when one failed. `timeout`, `stream`,
    `threads` and `grace` do not apply.
    """
    command = torchrun_command(target, nproc, args)
    if not capture:
        return _torchrun_here(command, env or {})
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", *command]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    expired = threading.Event()

    def on_timeout():
        expired.set()
        stop_job(proc.pid, grace)

    timer = threading.Timer(timeout, on_timeout) if timeout is not None else None
    if timer is not None:
        timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if stream:
                sys.stdout.write(line)
        proc.wait()
    except BaseException:                            # Ctrl-C in the notebook: stop the job too
        stop_job(proc.pid, grace)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        proc.stdout.close()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout, "".join(lines))
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


def _torchrun_here(command: list[str], env: dict) -> subprocess.CompletedProcess:
    """torchrun's launcher in this process, its log lines and failure report silenced (see `torchrun`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415 (torch: when asked)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.run import parse_args, run  # noqa: PLC0415

    os.environ.update(env, LOGLEVEL="CRITICAL")     # torchrun's agent logs each signal it forwards and each exit
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    cmd = [sys.executable, "-m", "torch.distributed.run", *command]
    try:
        run(parse_args(command))
    except SignalException as stop:                  # Ctrl-C: the ranks have said where the run stopped
        return subprocess.CompletedProcess(cmd, 128 + int(stop.sigval))
    except ChildFailedError as failed:
        return subprocess.CompletedProcess(cmd, max(1, failed.get_first_failure()[1].exitcode))
    return subprocess.CompletedProcess(cmd, 0)


def output_ends(text: str, n: int = 2500) -> str:
    """The first and last `n` characters of a job's output, or all of a short one (a rank's own
    error comes before torchrun's long summary of the failure, which ends the output)."""
    return text if len(text) <= 2 * n else f"{text[:n]}\n[...]\n{text[-n:]}"


def stop_job(pid: int, grace: float = 5.0) -> None:
    """End process `pid` and everything under it: SIGTERM to all, SIGKILL to what is left after `grace` s.

    torchrun starts every rank in a session of its own (so that it can signal each rank's
    group), so killing the launcher's process group alone would leave the ranks running:
    the processes are found through their parents (psutil), before any is signalled.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
