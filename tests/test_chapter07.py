"""chapters/07_async.py: bad flags are named before anything loads; a short run writes summary.json;
--resume continues a run (with a larger --steps) and refuses other settings in one line.

In-process (the script's `main`), to spare a Python start per case; small end-to-end runs on a saved
tiny model (`--model`).
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from refusals import default_sigint, load_factor

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
    printed, err = capsys.readouterr()
    assert "trajectories/s" in printed and "trainer idle" in printed and "queue depth" in printed
    assert "Writing model shards" not in err and "Loading weights" not in err, "no bars where stderr is no terminal"
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



@pytest.mark.parametrize("flags, message", [
    (["--out", "/sys/minirl-run"], "argument --out: /sys/minirl-run: cannot write in /sys"),
    (["--dataset", REPO / "data" / "word_problems" / "train.jsonl", "--reward", "math", "--max-turns", "2"],
     "argument --max-turns: 2: a --dataset task is scored in one turn by its rewards"),
    (["--dataset", REPO / "data" / "word_problems" / "train.jsonl"], "argument --reward: a data set needs at least "
                                                                    "one reward"),
    (["--reward", "math", "--reward-weights", "1", "2"], "argument --reward-weights: 1.0 2.0: 2 weights for 1 reward"),
])
def test_bad_task_and_run_flags_are_one_line(tmp_path, capsys, flags, message):
    assert main("--out", tmp_path / "run", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    assert main("--out", tmp_path / "run", "--device", "cuda") == 2
    err = capsys.readouterr().err
    assert "argument --device: 'cuda': this machine has no CUDA device" in err and "Traceback" not in err, err


def test_a_usage_error_comes_before_torch_loads():
    """Issue 22, item 5: the parser runs before the heavy imports (a typo must not wait for torch)."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(REPO / 'chapters' / '07_async.py')!r}, '--max-stalness', '1']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'ray', 'transformers') "
            "if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "exit 2 []", proc.stdout + proc.stderr[-2000:]
    assert "unrecognized arguments: --max-stalness 1" in proc.stderr


def test_the_chapters_resume_rule_is_stage_1s():
    from minirl.runtime.callbacks import SAFE_ON_RESUME
    assert chapter.STAGE1_SAFE_ON_RESUME == tuple(k for k in SAFE_ON_RESUME if k not in chapter.SKIPPED)


# --- your model, your task (issue 19): --dataset, --eval-dataset, --reward, --reward-weights, --config ----------------

SPY = '''
import json, os
def spy(prompts, completions, answer, **columns):
    """Records what TRL's signature hands a reward; scores 1.0 for anything."""
    with open(os.path.join(os.path.dirname(__file__), "spy.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts[:2], "completions": completions[:2], "answer": answer[:2],
                            "columns": sorted(columns), "n": len(completions)}) + "\\n")
    return [1.0] * len(completions)
'''
KILLER = '''
import os
def kill(prompts, completions, **columns):
    """Kills the process it runs in when that is a Ray actor (a producer); 0 elsewhere."""
    import ray
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        os._exit(1)
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Word problems (text and chat); tiny Qwen2s with a byte-level BPE tokenizer, with and without a chat template."""
    from tiny_bpe import save_tiny_bpe_model

    from minirl.tasks.word_problems import write

    root = tmp_path_factory.mktemp("words")
    write(root / "plain", n_train=40, n_test=6)
    write(root / "chat", n_train=40, n_test=6, chat=True)
    (root / "spy.py").write_text(SPY)
    (root / "killer.py").write_text(KILLER)
    return {"root": root, "chat_model": save_tiny_bpe_model(root / "instruct"),
            "plain_model": save_tiny_bpe_model(root / "base", chat_template=False)}


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


ASYNC = ["--producers", 2, "--prompts-per-call", 2, "--prompts-per-step", 4]


def test_a_chat_model_trains_on_word_problems_with_weighted_rewards_and_a_config_file(tmp_path, capsys, words):
    """The issue's recipe on chapter 07: producers score each completion with the task's rewards (the row's
    columns, the weights), every record has rewards/<name> and frac_reward_zero_std, the YAML file is read."""
    root, out = words["root"], tmp_path / "run"
    (tmp_path / "words.yaml").write_text(f"""
dataset: {root / "chat" / "train.jsonl"}
eval_dataset: {root / "chat" / "test.jsonl"}
reward: [math, format, {root / "spy.py"}:spy]
reward_weights: [1, 0.5, 0.25]
max-completion-length: 12
learning_rate: 1.0e-3
num_generations: 2
steps: 9
""")
    assert main("--config", tmp_path / "words.yaml", "--model", words["chat_model"], "--out", out, "--steps", 3,
                "--snapshot-every", 3, *ASYNC) == 0
    assert "held-out accuracy (math_reward)" in capsys.readouterr().out
    recs = records(out)
    assert len(recs) == 3, "--steps on the command line overrides the file's 9"
    names = ("math_reward", "math_format_reward", "spy")
    for m in recs:
        assert all(f"rewards/{n}" in m for n in names), sorted(m)
        assert m["rewards/spy"] == 1.0 and m["env/failures"] == 0, "rewards/<name>: the unweighted mean, as TRL's"
        assert m["reward"] == pytest.approx(sum(k * m[f"rewards/{n}"]
                                               for k, n in zip([1, 0.5, 0.25], names, strict=True)),
                                            abs=1e-6), "the reward trained on is the weighted sum"
        assert 0 <= m["frac_reward_zero_std"] <= 1
    calls = [json.loads(line) for line in (root / "spy.jsonl").read_text().splitlines()]
    sessions = [c for c in calls if c["n"] == 1]                   # one call per completion, in its session
    assert len(sessions) >= 3 * 4 * 2 and {c["n"] for c in calls} == {1, 6}, "and the 6 held-out rows per snapshot"
    first = sessions[0]
    assert first["columns"] == ["completion_ids", "log_extra", "log_metric", "trainer_state"], "and TRL's extras"
    assert first["answer"][0].split("\n")[-1].startswith("#### "), "the row's columns"
    assert first["prompts"][0][0]["role"] == "system", "a conversational prompt reaches the rewards as messages"
    assert first["completions"][0][0]["role"] == "assistant"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"]["rewards"] == list(names) and summary["task"]["reward_weights"] == [1.0, 0.5, 0.25]
    assert summary["task"]["eval_rows"] == 6 and summary["eval_metric"] == "accuracy (math_reward)"
    assert summary["settings"]["learning_rate"] == 1e-3 and summary["settings"]["steps"] == 3
    assert summary["config_file"] == str(tmp_path / "words.yaml")
    assert [a["step"] for a in summary["accuracy_curve"]] == [0, 3] and 0 <= summary["accuracy_after"] <= 1


def test_a_text_dataset_resumes_with_its_task(tmp_path, capsys, words):
    """--resume restores --dataset and --reward from run.json; another --reward is refused by name."""
    root, out = words["root"], tmp_path / "run"
    task = ["--dataset", root / "plain" / "train.jsonl", "--reward", "math", "--reward", "format",
            "--reward-weights", 1, 0.5]
    assert main("--model", words["plain_model"], "--out", out, *task, *ASYNC, "--num-generations", 2,
                "--max-completion-length", 8, "--steps", 2, "--checkpoint-every", 1) == 0
    assert "no held-out evaluation" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["accuracy_before"] is None
    assert main("--out", out, "--resume", "--reward", "math") == 2
    assert "--reward ['math', 'format'] -> ['math']" in capsys.readouterr().err
    assert main("--out", out, "--resume", "--steps", 3) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == 3 and resumed["resumed"] and resumed["task"]["rewards"] == ["math_reward",
                                                                                           "math_format_reward"]
    assert "rewards/math_format_reward" in records(out)[-1] and [r["step"] for r in records(out)] == [1, 2, 3]


def test_a_resume_refuses_changed_data_unless_allowed(tmp_path, capsys, words):
    """An answer edited in the data set after the run started: --resume is refused in one line naming the file;
    --allow-changed-data goes on, and run.json records the change."""
    data, out = tmp_path / "train.jsonl", tmp_path / "run"
    data.write_text((words["root"] / "plain" / "train.jsonl").read_text())
    assert main("--model", words["plain_model"], "--out", out, "--dataset", data, "--reward", "math", *ASYNC,
                "--num-generations", 2, "--max-completion-length", 8, "--steps", 2, "--checkpoint-every", 1) == 0
    data.write_text(data.read_text().replace("#### ", "#### 9", 1))
    capsys.readouterr()
    assert main("--out", out, "--resume", "--steps", 3) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: --resume: --dataset {data} changed since the run started" in err, err
    assert main("--out", out, "--resume", "--steps", 3, "--allow-changed-data") == 0
    record = json.loads((out / "run.json").read_text())
    assert [e["path"] for e in record["changed_data"]] == [str(data)] and [r["step"] for r in records(out)] == [1, 2, 3]


# --- nothing lost, nothing hangs (issue 22) -------------------------------------------------------------------------

def test_ctrl_c_stops_with_one_line(tmp_path, tiny_model_dir):
    """SIGINT: one line with the last intact checkpoint and the resume command, no traceback, exit 130."""
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(REPO / "chapters" / "07_async.py"), "--model", str(tiny_model_dir),
                             "--out", str(out), "--steps", "100000", "--checkpoint-every", "2",
                             *map(str, ASYNC), "--num-generations", "2", "--env-latency", "0.001"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 300 * load_factor()
    while not list((out / "checkpoints").glob("step-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120 * load_factor())
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("interrupted: the last intact checkpoint is ") and "step-" in lines[-1], lines
    assert lines[-1].endswith(f"--out {out} --resume")


LEAVE_WITH_A_THREAD_IN_TORCH = """
import importlib.util, sys, threading, time
import torch
spec = importlib.util.spec_from_file_location("chapter07", sys.argv[1])
chapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter)
def generate():                                   # a producer still generating when the run ends
    a = torch.randn(300, 300)
    while True:
        a = torch.mm(a, a).clamp(-1, 1)
threading.Thread(target=generate, daemon=True).start()
time.sleep(0.5)
chapter.leave_now(130) if sys.argv[2] == "leave_now" else sys.exit(130)
"""


@pytest.mark.parametrize("how", ["leave_now", "sys.exit"])
def test_exit_with_a_thread_still_in_torch_never_aborts(how):
    """Ctrl-C ends the run while a daemon thread (a producer whose generation outlived the join, a scoring
    session) is inside a torch op: the chapter's exit skips the interpreter's teardown, which would abort
    ("terminate called without an active exception", exit 134), as sys.exit does here."""
    procs = [subprocess.run([sys.executable, "-c", LEAVE_WITH_A_THREAD_IN_TORCH, str(REPO / "chapters" / "07_async.py"),
                             how], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            timeout=120 * load_factor()) for _ in range(3)]
    aborted = sum(p.returncode == -signal.SIGABRT or "terminate called" in p.stderr for p in procs)
    if how == "leave_now":
        assert aborted == 0 and all(p.returncode == 130 for p in procs), [p.stderr[-500:] for p in procs]
    else:
        assert aborted == 3, "the control: with sys.exit the teardown aborts (else this test shows nothing)"


def test_a_full_disk_is_one_line_and_promotes_nothing(tmp_path, capsys, tiny_model_dir, monkeypatch):
    import errno

    import minirl.runtime.callbacks as run_module  # where LocalCheckpoints calls save_checkpoint

    def full(root, state, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(root) / ".tmp-step-000002-x"))
    monkeypatch.setattr(run_module, "save_checkpoint", full)
    out = tmp_path / "run"
    assert main("--model", tiny_model_dir, "--out", out, "--steps", 3, "--checkpoint-every", 2, *ASYNC,
                "--num-generations", 2, "--env-latency", 0.001) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1, err
    assert f"cannot write {out}/checkpoints/.tmp-step-000002-x (No space left on device)" in lines[0]
    assert "free some space" in lines[0] and "no checkpoint was written yet" in lines[0]
    assert lines[0].endswith(f"--out {out} --overwrite"), "nothing to resume: start again"
    assert "Traceback" not in err and not (out / "checkpoints").exists() and not (out / "final").exists()


@pytest.mark.ray
def test_a_killed_ray_producer_is_named_in_one_line(tmp_path, words):
    """--ray: a RayProducer whose process dies stops the run with one line naming it (pid, node), exit 1."""
    pytest.importorskip("ray")
    root, out = words["root"], tmp_path / "run"
    args = ["--ray", "--ray-actors", 2, "--model", words["plain_model"], "--out", out, "--dataset",
            root / "plain" / "train.jsonl", "--reward", f"{root}/killer.py:kill", *ASYNC, "--num-generations", 2,
            "--max-completion-length", 4, "--steps", 2, "--num-cpus", 2]
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "07_async.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600 * load_factor(),
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "died" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"RayProducer ray \d slot \d \(pid \d+ on node \w+\) died during produce", lines[0]), lines[0]
    assert "no checkpoint was written yet; start the run again with: python" in lines[0]
    assert lines[0].endswith(f"07_async.py --out {out} --overwrite")


def test_chapter_07_never_exits_0_after_every_trajectory_failed(tmp_path):
    """Issue 34 item 6: a reward that always raises costs each session, and the run ends nonzero, in one line."""
    import subprocess
    import sys

    (tmp_path / "always_raises.py").write_text("def broken(prompts, completions, **kw):\n    raise KeyError('x')\n")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10, 30) for b in range(10, 14)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chapter = Path(__file__).resolve().parents[1] / "chapters" / "07_async.py"
    proc = subprocess.run([sys.executable, str(chapter), "--out", str(tmp_path / "run"), "--steps", "2",
                           "--dataset", "sums.jsonl", "--reward", "always_raises:broken"], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: every one of the "), proc.stderr[-1000:]
