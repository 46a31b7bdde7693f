"""chapters/06_ray.py: bad flags and an unreachable cluster fail fast, before Ray or a model is touched.

In-process (the script's `main`), to spare a Python start per case. The end-to-end runs of the chapter
(joining an existing cluster with --address: a data set with weighted rewards and a config file, a broken
checkpoint, Ctrl-C, a dead worker) are in test_controller.py, which shares that module's cluster.
"""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from refusals import load_factor

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("chapter06", REPO / "chapters" / "06_ray.py")
chapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter)


def main(*args) -> int:
    try:
        return chapter.main([str(a) for a in args])
    except SystemExit as exit_:                 # argparse's parser.error
        return exit_.code


@pytest.mark.parametrize("flags, message", [
    (["--placement", "ring"], "argument --placement: invalid choice: 'ring'"),
    (["--pools", "actor=two"], "'actor=two' is not role=N"),
    (["--pools", "critc=2"], "not a role; the roles are actor, rollout, reward, reference, critic"),
    (["--placement", "colocated", "--pools", "actor=2,rollout=1"], "share the pool 'shared'"),
    (["--placement", "disaggregated", "--pools", "actor=3", "--prompts-per-step", "4"],
     "4 prompts per step (groups of 8 completions) do not split into equal parts of whole groups across the 3 "
     "workers of pool 'train' (actor)"),
    (["--cpus-per-device", "0"], "argument --cpus-per-device: 0.0"),
    (["--model", "/no/such/model"], "no such directory"),
    (["--pools", "actor=0"], "argument --pools: 'actor=0': role 'actor' is given 0 devices; a pool needs at least 1"),
    (["--pools", "rollout=1+0"], "role 'rollout' is given 0 devices"),
    (["--out", "/sys/minirl-run"], "argument --out: /sys/minirl-run: cannot write in /sys"),
    (["--dataset", REPO / "data" / "word_problems" / "train.jsonl"], "argument --reward: a data set needs at least "
                                                                    "one reward"),
    (["--reward", "nope"], "argument --reward: nope: not a built-in reward"),
    (["--reward-weights", "1", "2"], "argument --reward-weights: 1.0 2.0: 2 weights for 1 reward"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, message):
    out = Path(flags[flags.index("--out") + 1]) if "--out" in flags else tmp_path / "run"
    assert main("--out", tmp_path / "run", *flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, "one line"
    assert not out.exists() and not (tmp_path / "run").exists(), "nothing written"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    assert main("--out", tmp_path / "run", "--device", "cuda") == 2
    err = capsys.readouterr().err
    assert "argument --device: 'cuda': this machine has no CUDA device" in err and "--device cpu" in err, err
    assert not (tmp_path / "run").exists()


def test_a_usage_error_comes_before_torch_and_ray_load():
    """Issue 22, item 5: the parser runs before the heavy imports (a typo must not wait for torch)."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(REPO / 'chapters' / '06_ray.py')!r}, '--placment', 'ring']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'ray', 'transformers') "
            "if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "exit 2 []", proc.stdout + proc.stderr[-2000:]
    assert "unrecognized arguments: --placment ring" in proc.stderr


def test_the_chapters_names_are_the_packages():
    """The chapter takes its choices from minirl.controller.names (no Ray, no torch), the names the package uses."""
    from minirl.controller import placement
    from minirl.controller.names import LAYOUTS, PLACEMENTS, SYNCS
    from minirl.runtime import placement_checks
    from minirl.runtime.training_cli import BUILT_IN_REWARDS, REWARD_SPEC_HELP
    from minirl.tasks.rewards import REWARDS, SPEC_HELP
    assert chapter.PLACEMENTS is PLACEMENTS is placement_checks.PLACEMENTS and placement.LAYOUTS is LAYOUTS
    assert chapter.SYNCS is SYNCS is placement_checks.SYNCS
    assert PLACEMENTS == tuple(LAYOUTS) == ("colocated", "disaggregated", "per-role")
    assert BUILT_IN_REWARDS == tuple(REWARDS) and REWARD_SPEC_HELP == SPEC_HELP


def test_help_names_the_task_flags_and_token_auth(capsys):
    with pytest.raises(SystemExit):
        chapter.main(["--help"])
    printed = capsys.readouterr().out
    for name in ("--dataset", "--eval-dataset", "--reward ", "--reward-weights", "--config", "RAY_AUTH_MODE"):
        assert name in printed, name


def test_unreachable_address_fails_within_seconds(tmp_path, capsys):
    import ray
    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray cluster")
    start = time.perf_counter()
    assert main("--out", tmp_path / "run", "--address", "127.0.0.1:9", "--steps", 1) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster answers there" in err and "ray start --head" in err, err
    assert time.perf_counter() - start < 10 * load_factor() and not ray.is_initialized()
    assert not (tmp_path / "run").exists()



def timeline_of(*iterations):
    """A Driver-style timeline ({worker: [(call, start, end)]}): the iterations' calls one after another, split
    across two workers the way a disaggregated run splits them, preceded by step 1's calls (before any sync)."""
    first = ["rollout.generate", "reward.score", "actor.logprobs", "critic.values", "actor.update", "critic.update"]
    calls = [*first, *[call for iteration in iterations for call in iteration]]
    timeline = {"train[0]": [], "rollout[0]": []}
    for k, call in enumerate(calls):
        worker = "rollout[0]" if call.startswith(("rollout.", "reward.", "sync.recv")) else "train[0]"
        timeline[worker].append((call, 100.0 + k, 100.5 + k))
    return timeline


RIGHT = ["sync.send", "sync.recv", "rollout.generate", "reward.score", "actor.logprobs", "reference.logprobs",
         "critic.values", "actor.update", "critic.update"]


def test_the_driver_order_check_reads_the_recorded_order_and_passes_the_source_order():
    """Issue 29 item 5: row 7's check compares every iteration's stages in the order the timeline recorded their
    starts with the source's loop."""
    from minirl.runtime.source_rows import SOURCE_LOOP, driver_order_agrees, recorded_iterations
    timeline = timeline_of(RIGHT, RIGHT, ["sync.send", "sync.recv", "actor.named_weights"])
    assert recorded_iterations(timeline) == [list(SOURCE_LOOP)] * 2, "step 1 (no sync yet) and the last sync left out"
    assert driver_order_agrees(timeline)


@pytest.mark.parametrize("swap", [("reward.score", "critic.values"), ("rollout.generate", "reward.score"),
                                  ("actor.update", "critic.update")])
def test_the_driver_order_check_fails_on_a_wrong_middle_order(swap):
    from minirl.runtime.source_rows import SOURCE_LOOP, driver_order_agrees, recorded_iterations
    a, b = RIGHT.index(swap[0]), RIGHT.index(swap[1])
    wrong = list(RIGHT)
    wrong[a], wrong[b] = wrong[b], wrong[a]
    timeline = timeline_of(RIGHT, wrong)
    assert recorded_iterations(timeline)[1] != list(SOURCE_LOOP)
    assert not driver_order_agrees(timeline), f"{swap[1]} recorded before {swap[0]} must fail the check"
    assert not driver_order_agrees({"shared[0]": []}), "no recorded iteration: nothing agrees"
