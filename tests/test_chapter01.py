"""chapters/01_single_process.py end to end: summary, plot, checkpoints, --model, PPO, exact resume,
and a run directory that cannot be lost or mixed (issue: hardening, items 1-5, 9-10)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import default_sigint, last_line, load_factor, run_script, wait_for
from safetensors.torch import load_file

from minirl.runtime.rundir import open_run_dir

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "chapters" / "01_single_process.py"
TIMING = ("time/", "seconds")
QUICK = ["--eval-every", 0, "--prompts-per-step", 4, "--num-generations", 2]


def run(*args, check=True, progress=False):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    flags = ["--threads", "1"] + ([] if progress else ["--no-progress"])
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


def read_metrics(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


def test_default_policy_writes_summary_plot_checkpoint_and_final_model(tmp_path):
    out = tmp_path / "run"
    proc = run("--out", out, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 2)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "seconds", "config", "final_model"):
        assert key in summary, key
    assert summary["steps"] == 4 and 0 <= summary["accuracy_after"] <= 1
    assert (summary["device"], summary["dtype"], summary["rollout_dtype"]) == ("cpu", "float32", "float32"), \
        "auto is float32 on the CPU"
    assert 0.3 < summary["accuracy_before"] < 0.7, "the warm start is about half right"
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert "held-out greedy accuracy" in proc.stdout and "reward_curve.png" in proc.stdout
    ckpt = out / "checkpoints" / "step-000004"
    assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists()
    assert (ckpt / "tokenizer.json").exists() and (ckpt / "training_state.pt").exists()
    assert not list((out / "checkpoints").glob(".tmp-*")), "no temporary checkpoint left behind"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpt)   # an ordinary HF checkpoint
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_any_hf_model_path_and_ppo(tmp_path, tiny_model_dir):
    out = tmp_path / "ppo"
    run("--out", out, "--model", tiny_model_dir, "--algo", "ppo", "--steps", 3, "--prompts-per-step", 4,
        "--num-generations", 2, "--checkpoint-every", 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algo"] == "ppo" and summary["steps"] == 3
    assert summary["model"] == str(tiny_model_dir)
    assert "value_loss" in read_metrics(out)[-1]


@pytest.mark.slow
def test_resume_after_crash_is_bit_identical(tmp_path, tiny_model_dir):
    common = ["--model", tiny_model_dir, "--steps", 6, "--prompts-per-step", 4, "--num-generations", 4,
              "--checkpoint-every", 2, "--eval-every", 3, "--beta", 0.05]
    run("--out", tmp_path / "full", *common)
    crashed = run("--out", tmp_path / "crash", *common, "--stop-after", 4, check=False)
    assert crashed.returncode == 1, crashed.stderr[-2000:]
    assert "--resume" in crashed.stdout
    assert (tmp_path / "crash" / "checkpoints" / "step-000004").exists()
    assert not (tmp_path / "crash" / "summary.json").exists()
    run("--out", tmp_path / "crash", "--resume")           # the run's own settings come from run.json
    assert read_metrics(tmp_path / "crash") == read_metrics(tmp_path / "full")
    full = load_file(tmp_path / "full" / "checkpoints" / "step-000006" / "model.safetensors")
    resumed = load_file(tmp_path / "crash" / "checkpoints" / "step-000006" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), f"{k} differs after resume"
    a = torch.load(tmp_path / "full" / "checkpoints" / "step-000006" / "training_state.pt", weights_only=False)
    b = torch.load(tmp_path / "crash" / "checkpoints" / "step-000006" / "training_state.pt", weights_only=False)
    assert a["version"] == b["version"] == 6
    assert torch.equal(a["generator"], b["generator"])
    s_full = json.loads((tmp_path / "full" / "summary.json").read_text())
    s_res = json.loads((tmp_path / "crash" / "summary.json").read_text())
    assert s_full["accuracy_after"] == s_res["accuracy_after"] and s_res["resumed"] is True
    assert s_res["config"] == s_full["config"], "the summary records the settings that ran"


def test_a_run_directory_belongs_to_one_run(tmp_path, tiny_model_dir):
    """Item 1: a second run refuses a directory that holds another; --overwrite replaces it cleanly."""
    out = tmp_path / "r"
    base = ["--model", tiny_model_dir, "--out", out, *QUICK, "--checkpoint-every", 1]
    run(*base, "--steps", 10)
    second = run(*base, "--steps", 4, "--seed", 1, "--stop-after", 3, check=False)
    assert second.returncode == 2 and "already holds a run" in second.stderr and "--overwrite" in second.stderr
    assert len(read_metrics(out)) == 10, "the first run's records are untouched"
    run(*base, "--steps", 4, "--seed", 1, "--overwrite")
    assert [p.name for p in sorted((out / "checkpoints").glob("step-*"))] == ["step-000003", "step-000004"]
    assert len(read_metrics(out)) == 4 and json.loads((out / "run.json").read_text())["config"]["run"]["seed"] == 1


def test_no_progress_bars_in_a_log(tmp_path):
    """Output that is no terminal (a pipe here, a log file alike) gets no progress bars: neither the run's nor
    transformers' "Loading weights" and "Writing model shards"."""
    proc = run("--out", tmp_path / "run", *QUICK, "--steps", 2, "--checkpoint-every", 1, progress=True)
    for bar in ("Loading weights", "Writing model shards", "grpo (stage 1)", "it/s"):
        assert bar not in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_a_locked_directory_is_refused(tmp_path, tiny_model_dir):
    out = tmp_path / "locked"
    with open_run_dir(out, {"config": {}}):
        proc = run("--model", tiny_model_dir, "--out", out, *QUICK, "--steps", 1, "--overwrite", check=False)
    assert proc.returncode == 2 and "another run is writing into this directory" in proc.stderr
    assert last_line(proc).startswith(f"error: --out {out}: ") and last_line(proc).endswith("choose another --out"), \
        "the refusal names the flag, not the loop's out_dir"


def test_resume_checks_the_settings(tmp_path, tiny_model_dir):
    """Item 2: changed algorithm settings are refused by name; more steps are fine; nothing to resume is an error."""
    out = tmp_path / "r"
    base = ["--model", tiny_model_dir, "--out", out, *QUICK, "--checkpoint-every", 2]
    run(*base, "--steps", 2, "--learning-rate", 1e-3)
    refused = run("--out", out, "--resume", "--learning-rate", 3e-4, "--seed", 1, check=False)
    assert refused.returncode == 2
    assert "--learning-rate 0.001 -> 0.0003" in refused.stderr and "--seed 0 -> 1" in refused.stderr
    refused = run("--out", out, "--resume", "--algo", "ppo", check=False)
    assert refused.returncode == 2 and "--algo 'grpo' -> 'ppo'" in refused.stderr and "Traceback" not in refused.stderr
    run("--out", out, "--resume", "--steps", 4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["config"]["optimizer"]["learning_rate"] == 1e-3
    nothing = run("--out", tmp_path / "empty", "--resume", check=False)
    assert nothing.returncode == 2 and "holds no run to resume" in nothing.stderr


def test_final_model_is_saved_whatever_the_checkpoint_interval(tmp_path, tiny_model_dir):
    """Item 3: --steps 5 with --checkpoint-every 100 still leaves the final policy and a checkpoint to resume."""
    out = tmp_path / "r"
    run("--model", tiny_model_dir, "--out", out, *QUICK, "--steps", 5, "--checkpoint-every", 100)
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    saved = load_file(out / "checkpoints" / "step-000005" / "model.safetensors")
    assert all(torch.equal(final.state_dict()[k], v) for k, v in saved.items())


def test_a_broken_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_model_dir):
    """Item 4: a truncated newest checkpoint is named, skipped, and half-written temporaries are removed."""
    out = tmp_path / "r"
    base = ["--model", tiny_model_dir, "--out", out, *QUICK, "--checkpoint-every", 2]
    run(*base, "--steps", 4)
    newest = out / "checkpoints" / "step-000004"
    (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:100])
    stale = out / "checkpoints" / ".tmp-step-000006-abc"
    stale.mkdir()
    proc = run("--out", out, "--resume", "--steps", 6)
    assert "step-000004" in proc.stderr and "model.safetensors" in proc.stderr and "falling back" in proc.stderr
    assert not stale.exists()
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == [1, 2, 3, 4, 5, 6], "steps 3-4 were redone from the step-2 checkpoint, once"


def test_ctrl_c_stops_with_one_line(tmp_path, tiny_model_dir):
    """Item 5: SIGINT prints where the last checkpoint is and how to resume, no traceback, exit 130."""
    out = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--no-progress", "--threads", "1", "--model",
                             str(tiny_model_dir), "--out", str(out), *map(str, QUICK), "--steps", "100000",
                             "--checkpoint-every", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint, env=env)
    wait_for(lambda: list((out / "checkpoints").glob("step-*")), proc, 120, "a first checkpoint")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60 * load_factor())
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "the last checkpoint is" in stderr and "--resume" in stderr


@pytest.fixture(scope="module")
def chapter():
    """The chapter script as a module, to call its main() in this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("chapter01", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--max-completion-length", "0"], "argument --max-completion-length: 0: must be >= 1"),
    (["--learning-rate", "inf"], "argument --learning-rate: inf: must be finite"),
    (["--beta", "-1"], "argument --beta: -1.0: must be >= 0.0"),
    (["--prompts-per-step", "0"], "argument --prompts-per-step: 0: must be >= 1"),
    (["--num-generations", "1"], "argument --num-generations: 1: GRPO compares"),
    (["--eval-every", "-1"], "argument --eval-every: -1: must be >= 0"),
    (["--stop-after", "0"], "argument --stop-after: 0: must be >= 1"),
    (["--loss-type", "x"], "argument --loss-type: invalid choice"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--resume", "--overwrite"], "contradict each other"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16' (choose from 'auto', 'float32', 'bfloat16')"),
    (["--rollout-dtype", "int8"], "argument --rollout-dtype: invalid choice: 'int8'"),
    (["--rollout-engine", "tgi"],
     "argument --rollout-engine: invalid choice: 'tgi' (choose from 'hf', 'shared_prefix', 'vllm', 'paged')"),
    (["--device", "tpu"], "argument --device: 'tpu': not a device: use cpu, cuda, cuda:1, ..."),
])
def test_bad_flags_fail_in_one_line_before_loading(tmp_path, chapter, monkeypatch, capsys, args, message):
    """Items 9-10: one argparse-style line naming the flag, the value and the range; exit 2; nothing loaded."""
    monkeypatch.setattr("minirl.runtime.model_loading.load_policy",        # main imports it after the flags are checked
                        lambda *a, **k: pytest.fail("loaded a model for a bad command line"))
    with pytest.raises(SystemExit) as exit_:
        chapter.main(["--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not (tmp_path / "x").exists(), "nothing is created for a bad command line"


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


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Word problems (text and chat); tiny Qwen2s with a byte-level BPE tokenizer, with and without a chat template."""
    from tiny_bpe import save_tiny_bpe_model

    from minirl.tasks.word_problems import write

    root = tmp_path_factory.mktemp("words")
    write(root / "plain", n_train=40, n_test=6)
    write(root / "chat", n_train=40, n_test=6, chat=True)
    (root / "spy.py").write_text(SPY)
    return {"root": root, "chat_model": save_tiny_bpe_model(root / "instruct"),
            "plain_model": save_tiny_bpe_model(root / "base", chat_template=False)}


def test_a_chat_model_trains_on_word_problems_with_weighted_rewards_and_a_config_file(tmp_path, words):
    """The issue's recipe on chapter 01: a BPE Qwen2, chat prompts, math + format + a user reward, settings in YAML."""
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
    proc = run("--config", tmp_path / "words.yaml", "--model", words["chat_model"], "--out", out, "--steps", 3,
               "--prompts-per-step", 4, "--eval-every", 3, "--checkpoint-every", 0)
    assert "held-out greedy accuracy" in proc.stdout
    records = [m for m in read_metrics(out) if "reward" in m]
    assert len(records) == 3, "--steps on the command line overrides the file's 9"
    for m in records:
        names = ("math_reward", "math_format_reward", "spy")
        assert all(f"rewards/{n}" in m for n in names), sorted(m)
        assert m["rewards/spy"] == 1.0, "rewards/<name> is the function's unweighted mean, as TRL logs it"
        assert m["reward"] == pytest.approx(sum(k * m[f"rewards/{n}"]
                                               for k, n in zip([1, 0.5, 0.25], names, strict=True)),
                                            abs=1e-6), "the reward trained on is the weighted sum"
        assert 0 <= m["frac_reward_zero_std"] <= 1
    calls = [json.loads(line) for line in (root / "spy.jsonl").read_text().splitlines()]
    train_calls = [c for c in calls if c["n"] == 8]                # 4 prompts x 2 generations
    assert len(train_calls) == 3 and {c["n"] for c in calls} == {8, 6}, "3 steps, and the 6 held-out rows (twice)"
    first = train_calls[0]
    assert first["columns"] == ["completion_ids", "log_extra", "log_metric", "trainer_state"], "and TRL's extras"
    assert first["answer"][0].split("\n")[-1].startswith("#### ")
    assert first["prompts"][0][0]["role"] == "system", "a conversational prompt reaches the rewards as messages"
    assert first["completions"][0][0]["role"] == "assistant"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"]["rewards"] == ["math_reward", "math_format_reward", "spy"]
    assert summary["task"]["reward_weights"] == [1.0, 0.5, 0.25] and summary["task"]["eval_rows"] == 6
    assert summary["task"]["eval_metric"] == "accuracy (math_reward)"
    assert summary["settings"]["learning_rate"] == 1e-3 and summary["settings"]["steps"] == 3
    assert summary["settings"]["max_completion_length"] == 12 and summary["config"]["sampling"]["num_generations"] == 2
    assert summary["config_file"] == str(tmp_path / "words.yaml")
    assert 0 <= summary["accuracy_after"] <= 1


def test_a_text_dataset_on_a_base_model_resumes_with_its_task(tmp_path, words):
    """--resume restores --dataset and --reward from run.json; another --reward is refused by name."""
    root, out = words["root"], tmp_path / "run"
    task = ["--dataset", root / "plain" / "train.jsonl", "--reward", "math", "--reward", "format",
            "--reward-weights", 1, 0.5]
    run("--model", words["plain_model"], "--out", out, *task, *QUICK, "--max-completion-length", 8, "--steps", 2,
        "--checkpoint-every", 1, "--eval-every", 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_before"] is None, "no --eval-dataset: no held-out evaluation"
    assert [m for m in read_metrics(out) if "accuracy" in m] == []
    refused = run("--out", out, "--resume", "--reward", "math", check=False)
    assert refused.returncode == 2 and "--reward ['math', 'format'] -> ['math']" in refused.stderr, refused.stderr
    run("--out", out, "--resume", "--steps", 3)
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == 3 and resumed["task"] == summary["task"] and resumed["resumed"] is True
    assert "rewards/math_format_reward" in read_metrics(out)[-1]


def test_a_resume_refuses_changed_data_unless_allowed(tmp_path, words):
    """run.json records the content hash of the data set and of a reward file; a resume after either changed is
    refused in one line naming the flag and the file; --allow-changed-data goes on, and run.json records what."""
    data, reward, out = tmp_path / "train.jsonl", tmp_path / "my_reward.py", tmp_path / "run"
    original = (words["root"] / "plain" / "train.jsonl").read_text()
    data.write_text(original)
    reward.write_text("def short(prompts, completions, **columns):\n"
                      "    return [1.0 / (1 + len(c)) for c in completions]\n")
    run("--model", words["plain_model"], "--out", out, "--dataset", data, "--reward", "math", "--reward",
        f"{reward}:short", *QUICK, "--max-completion-length", 8, "--steps", 2, "--checkpoint-every", 1)
    recorded = json.loads((out / "run.json").read_text())["data_files"]
    assert [(e["flag"], e["path"]) for e in recorded] == [("--dataset", str(data)), ("--reward", str(reward))]

    data.write_text(original.replace("#### ", "#### 1", 1))          # one answer edited in place
    refused = run("--out", out, "--resume", "--steps", 3, check=False)
    assert refused.returncode == 2, refused.stderr
    assert last_line(refused).startswith(f"01_single_process.py: error: --resume: --dataset {data} changed since the "
                                         "run started (run.json has its sha256 "), last_line(refused)
    assert last_line(refused).endswith("put it back as it was, or pass --allow-changed-data to go on with it as it "
                                       "is now"), last_line(refused)
    data.write_text(original)
    reward.write_text(reward.read_text().replace("1.0 /", "2.0 /"))
    refused = run("--out", out, "--resume", "--steps", 3, check=False)
    assert refused.returncode == 2 and f"error: --resume: --reward {reward} changed since" in last_line(refused)
    assert len(read_metrics(out)) == 2, "nothing trained on the changed reward"

    run("--out", out, "--resume", "--steps", 3, "--allow-changed-data")
    record = json.loads((out / "run.json").read_text())
    assert [(e["flag"], e["path"]) for e in record["changed_data"]] == [("--reward", str(reward))]
    assert record["changed_data"][0]["sha256_now"] == record["data_files"][1]["sha256"] != \
        record["changed_data"][0]["sha256"], "run.json keeps both hashes, and the new one is the run's now"
    assert record["settings"]["allow_changed_data"] is True and len(read_metrics(out)) == 3


@pytest.mark.parametrize("case, message", [
    ("noprompt", "argument --dataset: {p}: has no 'prompt' column (its columns: question, answer)"),
    ("empty", "argument --dataset: {p}: is empty (0 rows)"),
    ("broken_module", "argument --reward: {root}/broken.py:f: module '{root}/broken.py' does not import "
                      "(ModuleNotFoundError: No module named 'no_such_package_xyz')"),
    ("missing_function", "argument --reward: {root}/spy.py:nope: module '{root}/spy.py' has no 'nope'; "
                         "its functions: spy"),
    ("weights", "argument --reward-weights: 1.0: 1 weight for 2 rewards (math, format)"),
    ("yaml_key", "argument --config: {root}/bad.yaml: 'rewards' is no setting; did you mean reward"),
    ("chat_without_template", "argument --dataset: {p}: its prompts are chat messages, but the model's tokenizer has "
                              "no chat template"),
    ("no_reward", "argument --reward: a data set needs at least one reward"),
])
def test_bad_task_inputs_fail_in_one_line_before_the_model_loads(tmp_path, chapter, monkeypatch, capsys, words, case,
                                                                 message):
    root = words["root"]
    (root / "broken.py").write_text("import no_such_package_xyz\n")
    (root / "bad.yaml").write_text("rewards: [math]\n")
    (root / "noprompt.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    (root / "empty.jsonl").write_text("")
    plain, chat = root / "plain" / "train.jsonl", root / "chat" / "train.jsonl"
    args, path = {
        "noprompt": (["--dataset", root / "noprompt.jsonl", "--reward", "math"], root / "noprompt.jsonl"),
        "empty": (["--dataset", root / "empty.jsonl", "--reward", "math"], root / "empty.jsonl"),
        "broken_module": (["--dataset", plain, "--reward", f"{root}/broken.py:f"], plain),
        "missing_function": (["--dataset", plain, "--reward", f"{root}/spy.py:nope"], plain),
        "weights": (["--dataset", plain, "--reward", "math", "--reward", "format", "--reward-weights", "1"], plain),
        "yaml_key": (["--config", root / "bad.yaml"], None),
        "chat_without_template": (["--model", words["plain_model"], "--dataset", chat, "--reward", "math"], chat),
        "no_reward": (["--dataset", plain], plain),
    }[case]
    monkeypatch.setattr("minirl.runtime.model_loading.load_policy",        # main imports it after the flags are checked
                        lambda *a, **k: pytest.fail("loaded a model for a bad command line"))
    with pytest.raises(SystemExit) as exit_:
        chapter.main(["--out", str(tmp_path / "x"), *map(str, args)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(p=path, root=root) in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not (tmp_path / "x").exists(), "nothing is created for a bad command line"


def test_a_mistyped_flag_fails_before_torch_loads(tmp_path):
    """Issue 22: the flags are parsed before torch and transformers load; a typo is one line, exit 2."""
    proc, imported = run_script(SCRIPT, "--out", tmp_path / "x", "--stpes", "3")
    assert proc.returncode == 2 and last_line(proc).endswith("error: unrecognized arguments: --stpes 3")
    assert not {"torch", "transformers"} & imported, sorted({"torch", "transformers"} & imported)
    assert not (tmp_path / "x").exists()
    proc, imported = run_script(SCRIPT, "--help")
    assert proc.returncode == 0 and "--dtype" in proc.stdout and "torch" not in imported, "--help is fast too"


@pytest.mark.parametrize("script", ["01_single_process.py", "06_ray.py", "07_async.py"])
def test_vllm_where_it_cannot_run_is_one_line_before_torch_loads(tmp_path, script):
    """Issue 28: every training chapter takes the engine registry's names; vLLM without vLLM (or CUDA) is refused with
    the flags, in one line naming the flag, the value, why and the fix, exit 2, before torch or a model loads."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vLLM and CUDA are here: --rollout-engine vllm is valid")
    proc, imported = run_script(REPO / "chapters" / script, "--out", tmp_path / "x", "--rollout-engine", "vllm")
    why = ("vLLM is not installed; on a CUDA machine run pip install -r requirements-gpu.txt, "
           if importlib.util.find_spec("vllm") is None else "vLLM's engine runs on CUDA GPUs and this run's --device "
                                                            "is cpu; pass --device cuda on a GPU machine, ")
    assert proc.returncode == 2 and last_line(proc) == (
        f"{script}: error: argument --rollout-engine: 'vllm': {why}or use --rollout-engine shared_prefix"), proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "error:" in line]) == 1
    assert not {"torch", "transformers", "ray"} & imported, sorted({"torch", "transformers", "ray"} & imported)
    assert not (tmp_path / "x").exists()


def test_cispo_runs_on_chapter_01(tmp_path):
    """--loss-type cispo (TRL 1.16's CISPO, one entry of the loss registry) trains like any other loss type."""
    out = tmp_path / "cispo"
    run("--out", out, "--steps", 2, "--loss-type", "cispo", "--epsilon-high", 5.0, "--checkpoint-every", 0, *QUICK)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["settings"]["loss_type"] == "cispo"
    records = read_metrics(out)
    assert len(records) == 2 and all(r["loss"] == r["loss"] and "clip_ratio/high_mean" in r for r in records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_before_anything_loads(tmp_path):
    proc, imported = run_script(SCRIPT, "--out", tmp_path / "x", "--device", "cuda")
    assert proc.returncode == 2 and last_line(proc) == (
        "01_single_process.py: error: argument --device: 'cuda': this machine has no CUDA device "
        "(torch.cuda.is_available() is False): run with --device cpu")
    assert "transformers" not in imported, "refused before the models' modules load"


@pytest.mark.slow
def test_the_embedded_task_learns_through_the_task_interface(tmp_path):
    """Chapter 01 at its defaults (the embedded task as a Task: its rows, its reward, its held-out split) lifts
    held-out greedy accuracy, closing at least 40 % of the gap to a perfect score. The warm start reaches a
    different accuracy on each CPU (0.47 on one, 0.61 on another), so the gain is measured against what was left:
    0.61 -> 0.84 closes 59 %, 0.47 -> 0.76 closes 55 %; a run that does not learn closes about none."""
    out = tmp_path / "learn"
    run("--out", out, "--checkpoint-every", 0)
    summary = json.loads((out / "summary.json").read_text())
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    assert summary["steps"] == 1000 and summary["task"]["name"] == "arithmetic"
    closed = gain / (1 - summary["accuracy_before"])
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    assert closed >= 0.40, f"closed {closed:.0%} of the gap: held-out accuracy {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "RANK": "0"},                      # torchrun / accelerate's
                                 {"MASTER_ADDR": "127.0.0.1", "ACCELERATE_MIXED_PRECISION": "no"}])   # CPU launcher
def test_several_processes_are_refused_in_one_line(chapter, tmp_path, monkeypatch, capsys, env):
    """Issue 31: `accelerate launch --num_processes 2` (or torchrun) on chapter 01 says what to run instead."""
    monkeypatch.delenv("RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        chapter.parse_args(["--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and "error: chapter 01 runs one process; use chapter 04 for N ranks (accelerate " \
        "launch --config_file configs/accelerate_cpu_2.yaml chapters/04_fsdp_lora.py, or torchrun" in err[-1], err


@pytest.mark.parametrize("accelerate, flags, expected", [
    ("bf16", [], "bf16"), ("fp16", [], "fp16"), ("no", [], "auto"), ("bf16", ["--mixed-precision", "no"], "no")])
def test_accelerate_launch_mixed_precision_fills_auto_only(chapter, tmp_path, monkeypatch, accelerate, flags,
                                                           expected):
    """accelerate launch --mixed_precision bf16|fp16 is chapter 01's when its own is auto; a typed flag wins."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", accelerate)
    args, config, *_ = chapter.parse_args(["--out", str(tmp_path / "run"), *flags])
    assert args.mixed_precision == expected and config.run.mixed_precision == expected


def test_accelerate_launch_fp8_is_refused_in_one_line(chapter, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(SystemExit) as exit_:
        chapter.parse_args(["--out", str(tmp_path / "run")])
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        "error: accelerate launch --mixed_precision fp8: chapter 01 autocasts to bf16 or fp16 (or not at all); "
        "launch with --mixed_precision bf16, fp16 or no")
