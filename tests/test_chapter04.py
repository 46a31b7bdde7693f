"""chapters/04_fsdp_lora.py under torchrun: summary, Hugging Face export, a rank killed and the run resumed
exactly from its sharded checkpoint (past a newer checkpoint that does not load), Ctrl-C in one line; any task
(--dataset, --reward, --reward-weights, --config) on a tiny BPE model; bad flags and resumes refused in one line
before anything is loaded."""

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from refusals import default_sigint, load_factor
from safetensors.torch import load_file

from minirl.config import RLConfig
from minirl.parallel.config import ParallelConfig
from minirl.runtime.io import atomic_write_json
from minirl.runtime.launch import torchrun

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "chapters" / "04_fsdp_lora.py"
QUICK = ["--steps", 4, "--eval-every", 2, "--checkpoint-every", 2, "--prompts-per-step", 4, "--num-generations", 4,
         "--zero", 3, "--lora-rank", 4, "--learning-rate", 0.01, "--no-progress",
         "--log-completions", 0]      # the tests read the ranks' lines: no completions table between them
TORCHRUN_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ")     # torchrun's own log lines


def chapter():
    spec = importlib.util.spec_from_file_location("chapter04", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(*args, timeout=420):
    try:
        return torchrun(SCRIPT, 2, [*map(str, args)], timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"chapter 04 hung (killed after {err.timeout} s):\n{(err.output or '')[-3000:]}")


def ranks_lines(output: str) -> list[str]:
    """What the ranks printed: the output without torchrun's own log lines, failure summary and traceback."""
    lines, own = [], True
    for line in output.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            own = False                         # torchrun's traceback and box end the output; a rank prints none
        if own and line.strip() and not TORCHRUN_LOG.match(line):
            lines.append(line)
    return lines



@pytest.mark.distributed
def test_a_killed_rank_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    job = launch("--out", whole, *QUICK)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert len(summary["peak_bytes"]) == 2 and all(p > 0 for p in summary["peak_bytes"])
    assert summary["sync_seconds"] > 0 and summary["sync_bytes"] > 0 and 0 < summary["sync_share"] < 1
    modes = [(r["mode"], r["transfer"]) for r in summary["sync_table"]]
    assert modes == [(m, t) for m in ("full", "merged", "adapter") for t in ("per tensor", "per layer",
                                                                             "256 MiB buckets")], modes
    table = {(r["mode"], r["transfer"]): r for r in summary["sync_table"]}
    for transfer in ("per tensor", "per layer", "256 MiB buckets"):
        assert table[("adapter", transfer)]["bytes"] < 0.2 * table[("merged", transfer)]["bytes"]
        assert table[("full", transfer)]["bytes"] == table[("merged", transfer)]["bytes"]
    assert summary["sync_every"] == 1 and summary["staleness_max"] == 0 and summary["pushes"] == 4
    assert "source flags > 5 %" in job.stdout and "rank 1: trainer state" in job.stdout
    assert summary["task"]["rewards"] == ["arithmetic_reward"] and summary["settings"]["lora_rank"] == 4

    from transformers import AutoModelForCausalLM

    from minirl.models.policy import greedy_accuracy, load_default_policy
    from minirl.runtime.policy_cache import load_tokenizer
    from minirl.tasks.arithmetic import make_task
    exported = AutoModelForCausalLM.from_pretrained(whole / "final")          # LoRA merged into the base
    base, _, _ = load_default_policy(progress=False)
    assert set(exported.state_dict()) == set(base.state_dict())
    assert any(not torch.equal(exported.state_dict()[k], v) for k, v in base.state_dict().items()), "it trained"
    accuracy = greedy_accuracy(exported, load_tokenizer(whole / "final"), make_task())
    assert accuracy == pytest.approx(summary["accuracy_after"]), "the export is the policy the engine evaluated"

    job = launch("--out", broken, *QUICK, "--kill-rank", "1:3")
    assert job.returncode != 0 and "rank 1: killed after step 3" in job.stdout
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["step-000002"]
    said = ranks_lines(job.stdout)
    assert said[0] == "rank 1: killed after step 3 (--kill-rank)" and len(said) == 2, said
    assert re.fullmatch(rf"rank 1 \(pid \d+ on \S+\) died: the last intact checkpoint is {broken}/checkpoints/"
                        rf"step-000002; continue with: torchrun --nproc_per_node 2 \S+04_fsdp_lora.py --out "
                        rf"{broken} --resume", said[1]), said
    assert "Connection reset" not in job.stdout and "[rank0]" not in job.stdout, "the survivor prints no traceback"
    job = launch("--out", broken, "--resume", "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed != uninterrupted"
    steps = [json.loads(line)["step"] for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4], "each step logged once, the step before the crash replayed"

    # the newest checkpoint (step 4) does not load on rank 1: named, and the run resumes from step 2, exactly
    (broken / "checkpoints" / "step-000004" / "rank-1.pt").write_bytes(os.urandom(4000))
    job = launch("--out", broken, "--resume", "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    warning = [line for line in job.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and f"{broken}/checkpoints/step-000004/rank-1.pt does not load" in warning[0], warning
    assert warning[0].endswith("falling back to the one before it")
    b = load_file(broken / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed from the checkpoint before != uninterrupted"
    steps = [json.loads(line)["step"] for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


@pytest.mark.distributed
def test_sync_every_resumes_exactly(tmp_path):
    """--sync-every 2 with checkpoints every 3 steps: the step-3 checkpoint forces a push (3 is odd), so the
    resumed engine holds what the uninterrupted one held, and both runs end with the same weights."""
    flags = ["--steps", 6, "--eval-every", 0, "--checkpoint-every", 3, "--prompts-per-step", 4, "--num-generations",
             4, "--zero", 3, "--learning-rate", 0.001, "--sync-every", 2, "--no-colocate", "--no-progress",
             "--log-completions", 0]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    job = launch("--out", whole, *flags)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync/pushed"] for r in records] == [0, 1, 1, 1, 0, 1], "every 2nd step, the checkpoint, the last"
    assert [r["staleness"] for r in records] == [0, 1, 0, 0, 0, 1]
    assert summary["staleness_max"] == 1 and summary["pushes"] == 4 and 0 < summary["sync_share"] < 1
    assert "batches up to 1 updates behind" in job.stdout
    job = launch("--out", broken, *flags, "--kill-rank", "0:4")
    assert job.returncode != 0 and "rank 0: killed after step 4" in job.stdout
    said = ranks_lines(job.stdout)
    assert len(said) == 2 and re.match(r"rank 0 \(pid \d+ on \S+\) died: ", said[1]), said   # rank 1 says it
    job = launch("--out", broken, "--resume", "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed != uninterrupted"


def interrupt(command: list[str], out: Path) -> tuple[int, str]:
    """Start chapter 04 with `command` (a launcher and the script), SIGINT the launcher (what Ctrl-C does) once
    its first checkpoint is written; (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*command, "--out", str(out), "--checkpoint-every", "2", "--steps", "100000",
                             "--eval-every", "0", "--prompts-per-step", "4", "--num-generations", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 300 * load_factor()
    while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120 * load_factor())
    return proc.returncode, stderr


@pytest.mark.distributed
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    """SIGINT to torchrun: the ranks print one line between them, naming the last intact checkpoint and the resume
    command, and no traceback (torchrun adds its own lines and exit status); every checkpoint left is intact."""
    out = tmp_path / "run"
    _, stderr = interrupt([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT)], out)
    said = ranks_lines(stderr)
    assert len(said) == 1, stderr[-3000:]
    assert re.fullmatch(rf"interrupted: the last intact checkpoint is {out}/checkpoints/step-\d{{6}}; continue with: "
                        rf"torchrun --nproc_per_node 2 \S+04_fsdp_lora.py --out {out} --resume", said[0]), said
    assert "KeyboardInterrupt" not in stderr.split("Traceback (most recent call last):")[0]
    assert "[rank" not in stderr and "Connection" not in stderr, stderr[-3000:]
    from minirl.runtime.sharded_checkpoint import checkpoints_in, sharded_problem
    named = Path(said[0].split("checkpoint is ")[1].split(";")[0])
    assert named == checkpoints_in(out / "checkpoints")[0], "the newest checkpoint is named"
    assert all(sharded_problem(p) is None for p in checkpoints_in(out / "checkpoints")), "every one is intact"


@pytest.mark.distributed
def test_launched_by_the_chapter_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """--nproc-per-node 2: this process is torchrun's launcher, quiet; SIGINT to it gives the ranks' one line on
    stderr, nothing else, and exit status 130."""
    out = tmp_path / "run"
    code, stderr = interrupt([sys.executable, str(SCRIPT), "--nproc-per-node", "2"], out)
    lines = stderr.splitlines()
    assert code == 130 and len(lines) == 1, (code, stderr[-3000:])
    assert re.fullmatch(rf"interrupted: the last intact checkpoint is {out}/checkpoints/step-\d{{6}}; continue with: "
                        rf"python \S+04_fsdp_lora.py --nproc-per-node 2 --out {out} --resume", lines[0]), lines


@pytest.mark.distributed
def test_a_bad_flag_stops_every_rank_before_loading_and_one_says_so(tmp_path):
    job = launch("--out", tmp_path / "bad", "--prompts-per-step", 3, timeout=180)
    assert job.returncode != 0
    message = "argument --prompts-per-step: 3: 3 prompts do not divide over 2 ranks"
    assert job.stdout.count(message) == 1, job.stdout[-3000:]
    assert ranks_lines(job.stdout)[-1].endswith("e.g. 2"), ranks_lines(job.stdout)
    assert not (tmp_path / "bad").exists(), "nothing was written"


@pytest.mark.parametrize("flags, message", [
    (["--prompts-per-step", "6"], "6 prompts do not divide over 4 ranks"),
    (["--backend", "nccl"], "NCCL communicates between CUDA GPUs"),
    (["--rollout-engine", "vllm"], "argument --rollout-engine: 'vllm': vLLM is not installed"),
    (["--algo", "ppo"], "stage 4 trains GRPO"),
    (["--zero", "5"], "invalid choice: 5"),
    (["--lora-rank", "0", "--sync-mode", "merged"], "merging or shipping an adapter needs LoRA"),
    (["--zero", "1", "--cpu-offload"], "use --zero 2 or 3"),
    (["--mixed-precision", "none"], "argument --mixed-precision: invalid choice: 'none'"),   # accelerate's "no"
    (["--sync-every", "0"], "argument --sync-every: 0: must be >= 1"),
    (["--sync-every", "4"], "argument --sync-every: 4: a colocated engine discards its weights"),
    (["--rollout-engine", "tgi"], "argument --rollout-engine: invalid choice: 'tgi'"),
    (["--rollout", "vllm"], "ambiguous option: --rollout could match --rollout-engine"),   # one engine flag now
    (["--out", "/sys/minirl-run"], "argument --out: /sys/minirl-run: cannot write in /sys"),
    (["--device", "cuda"], "argument --device: 'cuda': this machine has no CUDA device"),
    (["--dataset", str(REPO / "data" / "word_problems" / "train.jsonl")],
     "argument --reward: a data set needs at least one reward"),
    (["--reward", "math", "--reward-weights", "1", "2"], "argument --reward-weights: 1.0 2.0: 2 weights for 1 reward"),
])
def test_bad_flags_are_refused_with_their_name(tmp_path, monkeypatch, capsys, flags, message):
    if ("nccl" in flags or "cuda" in flags) and torch.cuda.is_available():
        pytest.skip("CUDA is available: NCCL and --device cuda are valid here")
    if "vllm" in flags and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    if "/sys/minirl-run" in flags and not Path("/sys").is_dir():
        pytest.skip("no /sys here")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exit_:
        chapter().parse_args(["--out", str(tmp_path / "x"), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert not (tmp_path / "x").exists()


def test_a_usage_error_comes_before_torch_loads():
    """Issue 22, item 5: the parser runs before the heavy imports (a typo must not wait for torch)."""
    for argv in (["--lerning-rate", "1"], ["--resume", "--out", "/nonexistent/run"]):
        code = ("import runpy, sys\n"
                f"sys.argv = [{str(SCRIPT)!r}, *{argv!r}]\n"
                "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'transformers') "
                "if m in sys.modules))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.strip() == "exit 2 []", proc.stdout + proc.stderr[-2000:]
    assert "holds no run to resume" in proc.stderr


# --- resuming: the run's own world size, an intact checkpoint, the run's own settings; early, and right ---------

def fake_run(out: Path, world: int = 2, steps: tuple = (2, 4)) -> Path:
    """A run directory as a 2-rank run leaves it (run.json, checkpoints whose files are intact), without weights."""
    from torch.distributed.checkpoint.metadata import Metadata

    atomic_write_json(out / "run.json", {"config": dataclasses.asdict(RLConfig()), "world_size": world,
                                         "pconfig": dataclasses.asdict(ParallelConfig()), "model": None})
    for step in steps:
        path = out / "checkpoints" / f"step-{step:06d}"
        path.mkdir(parents=True)
        torch.save({"world_size": world, "step": step}, path / "training_state.pt")
        for r in range(world):
            torch.save({}, path / f"rank-{r}.pt")
        with open(path / ".metadata", "wb") as f:
            import pickle
            pickle.dump(Metadata(state_dict_metadata={}, storage_data={}), f)
    return out


@pytest.mark.parametrize("world", [1, 3, 4])
def test_resume_on_another_world_size_is_refused_first_and_alike(tmp_path, monkeypatch, capsys, world):
    """nproc 1, 3, 4 on a 2-rank run: one refusal, the same for each, before any other check (never "use 15
    prompts", never "no intact checkpoint ... --overwrite" about a valid run)."""
    out = fake_run(tmp_path / "run")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_:
        chapter().parse_args(["--out", str(out), "--resume", "--prompts-per-step", "15"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"--resume: the run in {out} trained on 2 ranks" in err and f"this job has {world}" in err, err
    said = err.replace(str(out), "OUT")   # pytest's folder may hold "15" (pytest-158)
    assert "resume it with torchrun --nproc_per_node 2" in said and "overwrite" not in said and "15" not in said


def test_resume_refuses_a_run_without_an_intact_checkpoint_naming_the_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = fake_run(tmp_path / "run", steps=())
    with pytest.raises(SystemExit):
        chapter().parse_args(["--out", str(out), "--resume"])
    assert "holds no checkpoint yet (the run stopped before its first one)" in capsys.readouterr().err
    out = fake_run(tmp_path / "broken")
    (out / "checkpoints" / "step-000004" / "training_state.pt").write_bytes(b"garbage")
    (out / "checkpoints" / "step-000002" / "rank-1.pt").unlink()
    with pytest.raises(SystemExit):
        chapter().parse_args(["--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert f"{out}/checkpoints/step-000004/training_state.pt does not load (UnpicklingError" in err, err
    assert f"{out}/checkpoints/step-000002/rank-1.pt is missing" in err and "put the files back" in err


def test_resume_refuses_changed_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = fake_run(tmp_path / "run")
    for flags in (["--learning-rate", "0.1"], ["--zero", "2"], ["--reward", "math"]):
        with pytest.raises(SystemExit):
            chapter().parse_args(["--out", str(out), "--resume", *flags])
    args, config, pconfig, task, settings = chapter().parse_args(["--out", str(out), "--resume", "--steps", "9"])
    assert config.run.steps == 9 and config.optimizer.learning_rate == RLConfig().optimizer.learning_rate
    assert pconfig == ParallelConfig() and task.name == "arithmetic"
    assert settings["steps"] == 9 and settings["learning_rate"] == RLConfig().optimizer.learning_rate


def test_resume_refuses_a_changed_data_set_unless_allowed(tmp_path, monkeypatch, capsys):
    """run.json's content hash of --dataset: an edited file is refused in one line naming it, before any model
    loads; --allow-changed-data goes on and says what changed (run.json records it once the run resumes)."""
    from minirl.runtime.training_cli import content_hash
    from minirl.tasks.word_problems import write

    monkeypatch.setenv("WORLD_SIZE", "2")
    write(tmp_path / "words", n_train=8, n_test=2)
    data = tmp_path / "words" / "train.jsonl"
    out = fake_run(tmp_path / "run")
    record = json.loads((out / "run.json").read_text())
    record |= {"task": {"dataset": str(data), "eval_dataset": None, "reward": ["math"], "reward_weights": None},
               "data_files": [{"flag": "--dataset", "path": str(data), "sha256": content_hash(data)}]}
    atomic_write_json(out / "run.json", record)
    data.write_text(data.read_text().replace("#### ", "#### 9", 1))
    with pytest.raises(SystemExit) as exit_:
        chapter().parse_args(["--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and f"error: --resume: --dataset {data} changed since the run started" in err, err
    args, *_ = chapter().parse_args(["--out", str(out), "--resume", "--allow-changed-data"])
    assert args.run_data["data_files"][0]["sha256"] == content_hash(data)
    assert args.run_data["changed_data"] == [{**record["data_files"][0], "sha256_now": content_hash(data)}]


# --- the files: what a checkpoint check names, and a disk that fills ------------------------------------------

@pytest.fixture(scope="module")
def group():
    """A process group of one (gloo through a file store), destroyed when the module ends."""
    import torch.distributed as dist

    from minirl.parallel.launch import init_distributed
    init_distributed()
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_state(group, make_tiny_policy):
    from minirl.parallel.launch import DistContext
    from minirl.parallel.spmd import setup_spmd
    from minirl.tasks.task import arithmetic_task

    model, tokenizer = make_tiny_policy(seed=3, num_layers=1)
    task = arithmetic_task()
    return setup_spmd(RLConfig.from_flat(num_generations=2, prompts_per_step=2), ParallelConfig(), model, tokenizer,
                      task.train, task.reward_funcs, DistContext(0, 1, 0, torch.device("cpu"), "gloo"))


def test_a_checkpoint_check_names_the_broken_file(one_rank_state, tmp_path):
    from minirl.runtime.sharded_checkpoint import newest_intact, save_sharded, sharded_problem

    state = one_rank_state
    for step in (2, 4):
        state.step = step
        save_sharded(tmp_path, state)
    newest = tmp_path / "step-000004"
    assert sharded_problem(newest) is None and newest_intact(tmp_path) == (newest, [])
    shard = next(newest.glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    found, problems = newest_intact(tmp_path)
    assert found == tmp_path / "step-000002"
    assert problems == [f"{shard} is truncated ({size // 2} of {size} bytes)"]
    shutil.copy(tmp_path / "step-000002" / shard.name, shard)
    (newest / "training_state.pt").write_bytes(b"\x80\x04garbage")
    assert sharded_problem(newest).startswith(f"{newest}/training_state.pt does not load (")
    (newest / ".metadata").unlink()
    (newest / "training_state.pt").write_bytes((tmp_path / "step-000002" / "training_state.pt").read_bytes())
    assert sharded_problem(newest).startswith(f"{newest}/.metadata does not load (")


def test_a_full_disk_stops_the_save_in_one_line_and_promotes_nothing(one_rank_state, tmp_path, monkeypatch):
    import errno

    import minirl.runtime.sharded_checkpoint as checkpoint
    from minirl.runtime.stops import StopSignals, why_stopped

    state, real_save = one_rank_state, torch.save

    def full(obj, path, *args, **kwargs):
        if str(path).endswith("rank-0.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(checkpoint.torch, "save", full)
    state.step = 6
    with pytest.raises(OSError) as raised:
        checkpoint.save_sharded(tmp_path / "checkpoints", state)
    assert not (tmp_path / "checkpoints" / "step-000006").exists(), "nothing promoted"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "and nothing half-written left behind"
    stop = why_stopped(raised.value, StopSignals(), [("host", os.getpid())], 0, tmp_path)
    assert stop.code == 1 and stop.resumable
    assert stop.what.startswith(f"error: cannot write {tmp_path}/checkpoints/step-000006/rank-0.pt (No space "
                                "left on device): free some space, or pass another --out"), stop.what


# --- your model, your task (issue 19): --dataset, --eval-dataset, --reward, --reward-weights, --config ----------------

SPY = '''
import json, os
def spy(prompts, completions, answer, **columns):
    """Records what TRL's signature hands a reward, on which rank; scores 1.0 for anything."""
    with open(os.path.join(os.path.dirname(__file__), "spy.jsonl"), "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), "prompts": prompts[:1], "completions": completions[:1],
                            "answer": answer[:1], "columns": sorted(columns), "n": len(completions)}) + "\\n")
    return [1.0] * len(completions)
'''


@pytest.mark.distributed
def test_a_bpe_chat_model_trains_on_word_problems_with_weighted_rewards_and_a_config_file(tmp_path):
    """Issue 19 on chapter 04 (2 ranks): a random Qwen2 with a byte-level BPE tokenizer and a chat template, chat
    prompts from a generated data set, math + format + a user reward weighted 1 / 0.5 / 0.25, settings in YAML."""
    from tiny_bpe import save_tiny_bpe_model

    from minirl.tasks.word_problems import write

    write(tmp_path / "chat", n_train=40, n_test=6, chat=True)
    (tmp_path / "spy.py").write_text(SPY)
    model = save_tiny_bpe_model(tmp_path / "instruct")
    (tmp_path / "words.yaml").write_text(f"""
dataset: {tmp_path / "chat" / "train.jsonl"}
eval_dataset: {tmp_path / "chat" / "test.jsonl"}
reward: [math, format, {tmp_path / "spy.py"}:spy]
reward_weights: [1, 0.5, 0.25]
max-completion-length: 12
num_generations: 2
lora_rank: 8
steps: 9
""")
    out = tmp_path / "run"
    job = launch("--config", tmp_path / "words.yaml", "--model", model, "--out", out, "--steps", 3,
                 "--prompts-per-step", 4, "--eval-every", 3, "--checkpoint-every", 0, "--learning-rate", 1e-3,
                 "--no-progress")
    assert job.returncode == 0, job.stdout[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in records if "reward" in m]
    assert len(steps) == 3, "--steps on the command line overrides the file's 9"
    names = ("math_reward", "math_format_reward", "spy")
    for m in steps:
        assert all(f"rewards/{n}" in m for n in names), sorted(m)
        assert m["rewards/spy"] == 1.0, "rewards/<name> is the function's unweighted mean, as TRL logs it"
        assert m["reward"] == pytest.approx(sum(k * m[f"rewards/{n}"]
                                               for k, n in zip([1, 0.5, 0.25], names, strict=True)),
                                            abs=1e-6), "the reward trained on is the weighted sum"
        assert 0 <= m["frac_reward_zero_std"] <= 1
    calls = [json.loads(line) for line in (tmp_path / "spy.jsonl").read_text().splitlines()]
    train = [c for c in calls if c["n"] == 4]                 # 4 prompts x 2 generations over 2 ranks
    assert sorted(c["rank"] for c in train) == [0, 0, 0, 1, 1, 1], "each rank scores its share, every step"
    assert {c["n"] for c in calls} == {4, 6}, "and rank 0 alone scores the 6 held-out rows (steps 0 and 3)"
    first = train[0]
    assert first["columns"] == ["completion_ids", "log_extra", "log_metric", "trainer_state"], "and TRL's extras"
    assert first["answer"][0].split("\n")[-1].startswith("#### ")
    assert first["prompts"][0][0]["role"] == "system", "a conversational prompt reaches the rewards as messages"
    assert first["completions"][0][0]["role"] == "assistant"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"]["rewards"] == list(names) and summary["task"]["reward_weights"] == [1.0, 0.5, 0.25]
    assert summary["task"]["eval_metric"] == "accuracy (math_reward)" and summary["task"]["eval_rows"] == 6
    assert summary["settings"]["steps"] == 3 and summary["settings"]["max_completion_length"] == 12
    assert summary["settings"]["lora_rank"] == 8 and summary["parallel"]["lora_rank"] == 8
    assert summary["config_file"] == str(tmp_path / "words.yaml") and 0 <= summary["accuracy_after"] <= 1
    zero_std = [m["frac_reward_zero_std"] for m in steps]
    warned = job.stdout.count("warning: no learning signal in the first 3 steps")
    assert warned == (1 if zero_std == [1.0, 1.0, 1.0] else 0), (zero_std, job.stdout[-2000:])
    assert summary["defaults"] == "trl" and summary["settings"]["seed"] == 42, "--dataset: TRL's defaults (issue 31)"
    assert all(f"eval/rewards/{n}/mean" in summary for n in names), sorted(summary)
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {(r["step"], r["phase"]) for r in logged} == {(0, "eval"), (1, "train"), (2, "train"), (3, "train"),
                                                         (3, "eval")}, "rank 0's rows: the first steps, each eval"
    assert all(set(r["rewards"]) == set(names) for r in logged)


# --- accelerate launch and the peft adapter (issue 31, item 7) -------------------------------------------------------

def accelerate_launch(*args, env=None, timeout=300):
    """`accelerate launch ARGS` with this Python (its module: the same as the `accelerate` command)."""
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.mark.distributed
def test_accelerate_launch_with_the_shipped_cpu_config_trains_and_saves_the_peft_adapter(tmp_path):
    """configs/accelerate_cpu_2.yaml runs 2 CPU ranks; the LoRA run's final/adapter/ is peft's, and peft's model on
    the base computes the merged export's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minirl.models.policy import load_default_policy

    out = tmp_path / "run"
    job = accelerate_launch("--config_file", REPO / "configs" / "accelerate_cpu_2.yaml", SCRIPT, "--out", out,
                            "--steps", 1, "--eval-every", 0, "--checkpoint-every", 0, "--prompts-per-step", 2,
                            "--num-generations", 2, "--lora-rank", 4, "--learning-rate", 0.05, "--no-progress")
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 1
    assert summary["final_adapter"] == str(out / "final" / "adapter")
    saved = {p.name for p in (out / "final" / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved, saved
    base, tokenizer, _ = load_default_policy(progress=False)
    ids = torch.tensor([tokenizer.encode("3+4=")])
    with torch.no_grad():
        before = base.eval()(ids).logits
        adapted = PeftModel.from_pretrained(base, out / "final" / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()(ids).logits
    assert not torch.allclose(before, merged, atol=1e-4), "the step moved the adapter"
    torch.testing.assert_close(adapted, merged, atol=1e-4, rtol=1e-4)


def test_accelerate_launch_without_a_config_on_cpus_is_refused_in_one_line(tmp_path):
    """accelerate's CPU launcher starts one process (no RANK) for --num_processes 2: named, with the commands that
    work, before anything loads (it used to die in the rendezvous with a 'rank died ... resume' line)."""
    job = accelerate_launch("--num_processes", 2, "--num_machines", 1, "--mixed_precision", "no", "--dynamo_backend",
                            "no", SCRIPT, "--out", tmp_path / "run", env={"HF_HOME": str(tmp_path / "hf")}, timeout=120)
    errors = [line for line in job.stderr.splitlines() if "error:" in line]
    assert job.returncode != 0 and len(errors) == 1, job.stderr[-3000:]
    assert errors[0].endswith("error: accelerate launch started one process with no RANK or WORLD_SIZE (on CPUs "
                              "without a config its launcher starts one and leaves the others to mpirun): start the "
                              "ranks with accelerate launch --config_file configs/accelerate_cpu_2.yaml (torchrun's "
                              "launcher, 2 CPU ranks) or torchrun --nproc_per_node N, or run one process with "
                              "accelerate launch --num_processes 1"), errors
    assert "resume" not in job.stderr and not (tmp_path / "run").exists()


def test_master_addr_without_rank_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    with pytest.raises(SystemExit) as exit_:
        chapter().parse_args(["--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: MASTER_ADDR is set but RANK is not: this process is no rank of a job; start the job with torchrun "
        "--nproc_per_node N, or unset MASTER_ADDR to run one process")
