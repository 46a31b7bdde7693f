"""minirl.runtime.timing: stage timers that wait for the GPU's queued work, and do nothing extra on a CPU."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minirl.runtime.timing import StageTimer, cuda_in_use

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'in use' in this process; synchronize() takes 50 ms, as if kernels were still queued."""
    calls = []

    def synchronize(device=None):
        calls.append(device)
        time.sleep(0.05)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return calls


def test_a_cpu_process_never_synchronizes(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timer = StageTimer()
    for _ in range(3):
        with timer("generate"):
            pass
    assert calls == [] and not cuda_in_use()
    assert set(timer.times) == {"time/generate"} and timer.times["time/generate"] >= 0


def test_a_stage_on_cuda_includes_its_queued_work(fake_cuda):
    timer = StageTimer()
    with timer("update"):
        pass                                      # the kernels "queued" here finish in the closing synchronize
    assert len(fake_cuda) == 2, "waits when the stage starts (earlier work) and when it ends (its own)"
    assert timer.times["time/update"] >= 0.05, "the stage's seconds include the wait for its own kernels"
    cuda1 = StageTimer(device="cuda:1")
    with cuda1("sync"):
        pass
    assert fake_cuda[-2:] == ["cuda:1", "cuda:1"]


def test_a_cpu_stage_is_not_synchronized_even_with_cuda_up(fake_cuda):
    timer = StageTimer(device="cpu")
    with timer("score"):
        pass
    assert fake_cuda == [], "a CPU stage never waits for the GPU"
    synced = StageTimer()                         # the same empty stage, on the (fake) GPU: two 50 ms waits
    with synced("score"):
        pass
    # a relation, not an absolute time (a loaded machine can stretch any stage): the CPU stage's seconds hold
    # none of the waits the GPU stage's hold
    assert timer.times["time/score"] < synced.times["time/score"]


def test_an_error_inside_a_stage_is_not_hidden_by_the_wait(fake_cuda):
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="boom"):
        with timer("generate"):
            raise RuntimeError("boom")
    assert len(fake_cuda) == 1 and "time/generate" in timer.times, "no closing wait; the time is still counted"


def test_the_timer_does_not_import_torch():
    code = ("import sys, minirl.runtime.timing as t; s = t.StageTimer()\nwith s('x'): pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
