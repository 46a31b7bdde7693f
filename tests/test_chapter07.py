"""chapters/07_async.py: bad flags are named before anything loads; a short run writes summary.json;
--resume continues a run (with a larger --steps) and refuses other settings in one line.

In-process (the script's `main`), to spare a Python start per case; small end-to-end runs on a saved
tiny model (`--model`).
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
    (["--in-flight", "--rollout-engine", "paged"], "argument --in-flight: True: in-flight updates run the shared"),
    (["--correction", "areal", "--importance-sampling-correction"], "argument --importance-sampling-correction"),
    (["--stop-after", "0"], "argument --stop-after: 0"),
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


def test_resume_continues_with_more_steps_and_refuses_other_settings(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--prompts-per-step", 4, "--num-generations", 4, "--producers", 2,
             "--prompts-per-call", 2, "--env-latency", 0.001, "--snapshot-every", 2]
    assert main("--steps", 3, "--checkpoint-every", 2, "--out", out, *flags) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    capsys.readouterr()
    assert main("--resume", "--max-staleness", 2, "--steps", 5, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--max-staleness 1 -> 2" in err[-1] and "--resume" in err[-1], err
    assert main("--resume", "--producers", 3, "--steps", 5, "--out", out) == 2
    assert "--producers 2 -> 3" in capsys.readouterr().err
    assert main("--resume", "--steps", 5, "--snapshot-every", 1, "--out", out) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5], "the resumed run continues the log after its checkpoint"
    assert [a["step"] for a in summary["accuracy_curve"]] == [0, 2, 3, 4, 5]


def test_stop_after_then_resume(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--prompts-per-step", 4, "--num-generations", 4, "--producers", 2,
             "--prompts-per-call", 2, "--env-latency", 0.001, "--max-staleness", 0, "--checkpoint-every", 2]
    assert main("--steps", 4, "--stop-after", 3, "--out", out, *flags) == 1
    assert "continue with" in capsys.readouterr().out
    assert not (out / "summary.json").exists()
    assert main("--steps", 4, "--resume", "--out", out) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
