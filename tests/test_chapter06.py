"""chapters/06_ray.py: bad flags and an unreachable cluster fail fast, before Ray or a model is touched.

In-process (the script's `main`), to spare a Python start per case. The end-to-end run of the chapter
(joining an existing cluster with --address) is in test_controller.py, which shares that module's cluster.
"""

import importlib.util
import time
from pathlib import Path

import pytest

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
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, message):
    assert main("--out", tmp_path / "run", *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing written"


def test_unreachable_address_fails_within_seconds(tmp_path, capsys):
    import ray
    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray cluster")
    start = time.perf_counter()
    assert main("--out", tmp_path / "run", "--address", "127.0.0.1:9", "--steps", 1) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster answers there" in err and "ray start --head" in err, err
    assert time.perf_counter() - start < 10 and not ray.is_initialized()
    assert not (tmp_path / "run").exists()
