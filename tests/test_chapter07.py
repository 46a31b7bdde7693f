"""chapters/07_async.py: bad flags are named before anything loads; a short run writes summary.json.

In-process (the script's `main`), to spare a Python start per case; one small end-to-end run on a saved
tiny model (`--model`), and a second one into the same directory refused without --overwrite.
"""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("chapter07", REPO / "chapters" / "07_async.py")
chapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter)


def main(*args) -> int:
    try:
        return chapter.main([str(a) for a in args])
    except SystemExit as exit_:                 # argparse's parser.error
        return exit_.code


@pytest.mark.parametrize("flags, message", [
    (["--max-staleness", "-1"], "argument --max-staleness: -1: must be >= 0"),
    (["--correction", "vtrace"], "argument --correction: invalid choice: 'vtrace'"),
    (["--queue-capacity", "8"], "the queue must hold at least one batch of --prompts-per-step 16"),
    (["--env-latency", "-0.1"], "argument --env-latency: -0.1"),
    (["--env-timeout", "0"], "argument --env-timeout: 0.0"),
    (["--producers", "0"], "argument --producers: 0: must be >= 1"),
    (["--ray", "--in-flight"], "in-flight updates run in local producer threads only"),
    (["--threads", "-1"], "argument --threads: -1"),
    (["--model", "/no/such/model"], "no such directory"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, message):
    assert main("--out", tmp_path / "run", *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing written"


def test_short_run_writes_the_summary_and_refuses_to_overwrite(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--steps", 3, "--prompts-per-step", 4, "--num-generations", 4,
             "--max-staleness", 1, "--correction", "areal", "--producers", 2, "--prompts-per-call", 2,
             "--env-latency", 0.001, "--snapshot-every", 3]
    assert main("--out", out, *flags) == 0
    printed = capsys.readouterr().out
    assert "trajectories/s" in printed and "trainer idle" in printed and "queue depth" in printed
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "trajectories_per_second", "trainer_idle_share",
                "max_staleness_seen"):
        assert key in summary, key
    assert 0 <= summary["trainer_idle_share"] <= 1 and summary["max_staleness_seen"] <= 1
    assert summary["trajectories_per_second"] > 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and "queue/depth" in json.loads(lines[0])
    assert (out / "timeline.png").exists() and (out / "learning_curve.png").exists()
    assert (out / "final" / "config.json").exists()
    assert main("--out", out, *flags) == 2
    assert "already holds a run" in capsys.readouterr().err
