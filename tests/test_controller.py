"""Stage 6 on a two-node Ray cluster (one machine): same algorithm in every placement, data parallelism across
nodes (stage 4's roles: the same update, a NaN on one rank skipped by both at once), worker death and exact resume,
bad input before any actor starts, the chapter against an existing cluster.

One cluster for the module (Ray starts slowly), two nodes of 2 CPUs; a device is a quarter-CPU slot.
"""

import dataclasses
import json
import math
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

ray = pytest.importorskip("ray")

from minirl.config import RLConfig  # noqa: E402
from minirl.controller.driver import Driver  # noqa: E402
from minirl.controller.placement import make_placement  # noqa: E402
from minirl.controller.resource_pool import PlacementError  # noqa: E402
from minirl.data import Experience  # noqa: E402
from minirl.runtime.io import read_jsonl  # noqa: E402
from minirl.runtime.ray_calls import WorkerDiedError  # noqa: E402
from minirl.runtime.ray_start import local_cluster  # noqa: E402
from minirl.runtime.validate import ConfigError  # noqa: E402
from minirl.tasks.arithmetic import make_task  # noqa: E402
from minirl.train.run import train  # noqa: E402

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parent.parent
TASK = make_task()
ROWS = TASK.rows("train")


@pytest.fixture(scope="module")
def cluster():
    torch.set_num_threads(1)
    nodes = local_cluster(num_nodes=2, cpus_per_node=2)
    try:
        ray.init(address=nodes.address, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def small(**kw):
    return RLConfig.from_flat(**{"steps": 3, "prompts_per_step": 4, "num_generations": 4, "eval_every": 0} | kw)


def without_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "seconds"))} for r in records]


def stage1(config, make_tiny_policy, **kw):
    """The single-process reference: (records, final weights)."""
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    records = train(config, model, tok, progress=False, reward_funcs=[TASK.reward], **kw)
    return records, {k: v.clone() for k, v in model.state_dict().items()}



def nothing_left(timeout=15.0):
    """No named worker alive and every CPU of the cluster free again (actors and reservations gone)."""
    deadline = time.time() + timeout * load_factor()
    while time.time() < deadline:
        if not ray.util.list_named_actors() and ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]:
            return True
        time.sleep(0.2)
    return False


def test_disaggregated_reproduces_stage1_and_both_syncs_deliver_the_weights(cluster, make_tiny_policy):
    config = small(beta=0.05)                            # a reference too, on the train pool
    expected, weights = stage1(config, make_tiny_policy)
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with Driver(config, make_placement("disaggregated"), model, tok, [TASK.reward]) as driver:
        records = driver.train(ROWS, progress=False)
        where, timeline = driver.where(), driver.timeline()
        for name, sync in driver.syncs.items():
            report = sync.push(driver.roles.actor.named_weights(), driver.engine, 7)
            engine = dict(driver.group_of("rollout").run("named_weights", [("rollout",)])[0])
            assert report.version == driver.engine.version == 7 and report.bytes > 0, name
            assert all(torch.equal(engine[k], v) for k, v in weights.items()), f"{name}: the engine holds the actor's"
    assert without_timing(records) == without_timing(expected), "same seed, same batch: the same metrics"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items()), "the driver's copy is final"
    assert where["actor"] == where["reference"] != where["rollout"] == where["reward"]
    train_calls = [what for what, _, _ in timeline["train[0]"]]
    assert train_calls.count("actor.update") == 3 and "reference.logprobs" in train_calls
    assert [what for what, _, _ in timeline["rollout[0]"]][:3] == ["rollout.generate", "reward.score", "sync.recv"]
    generate_end = timeline["rollout[0]"][0][2]
    update_start = next(start for what, start, _ in timeline["train[0]"] if what == "actor.update")
    assert generate_end <= update_start, "the step's order holds across processes"


def test_colocated_ppo_reproduces_stage1_and_the_engine_sleeps_during_the_update(cluster, make_tiny_policy):
    config = small(algo="ppo", beta=0.05, steps=2)        # all five roles in one worker
    expected, _ = stage1(config, make_tiny_policy)
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with Driver(config, make_placement("colocated"), model, tok, [TASK.reward]) as driver:
        records = driver.train(ROWS, progress=False)
        calls = [what for what, _, _ in driver.timeline()["shared[0]"]]
    assert without_timing(records) == without_timing(expected)
    step = calls[:calls.index("sync.local") + 1]
    assert step.index("rollout.generate") < step.index("rollout.sleep") < step.index("actor.update"), step
    assert calls.index("rollout.wake_up") > calls.index("actor.update"), "woken by the sync that follows"


def trl_rewards():
    """Reward functions of each kind TRL's users write (issue 31 item 4), made here so that Ray pickles them by
    value: completion_ids, trainer_state and log_metric, None where one does not apply, async def."""
    import asyncio

    def by_ids(prompts, completions, completion_ids, **kwargs):
        assert all(type(i) is int for ids in completion_ids for i in ids) and len(completion_ids) == len(completions)
        return [-len(ids) / 10 for ids in completion_ids]

    def by_step(completions, trainer_state, log_metric, **kwargs):
        log_metric("curriculum/step", trainer_state.global_step)
        return [0.0] * len(completions)

    def some_none(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    async def judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)
    return [by_ids, by_step, some_none, judge, TASK.reward]


def test_reward_workers_call_trls_rewards_as_stage_1_does(cluster, make_tiny_policy):
    """The reward worker gets each extra TRL passes (the async judge is awaited there) and its log_metric values
    reach the driver's record: the records are stage 1's."""
    config = small(steps=2)
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    expected = train(config, model, tok, progress=False, reward_funcs=trl_rewards())
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with Driver(config, make_placement("disaggregated"), model, tok, trl_rewards()) as driver:
        records = driver.train(ROWS, progress=False)
    assert without_timing(records) == without_timing(expected)
    assert [r["curriculum/step"] for r in records] == [0.0, 1.0] and all(r["rewards/some_none"] == 1.0
                                                                          for r in records)
    assert all(r["rewards/by_ids"] == pytest.approx(-r["completion_length"] / 10) for r in records)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_data_parallel_ranks_across_two_nodes_update_as_one(cluster, make_tiny_policy, algo):
    """The actor (and PPO's critic) on a pool of two ranks, one per node: stage 1's update, up to float sums."""
    config = small(steps=2, algo=algo)
    expected, weights = stage1(config, make_tiny_policy)
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    placement = make_placement("disaggregated", {"actor": [1, 1]})          # a pool that spans both nodes
    with Driver(config, placement, model, tok, [TASK.reward]) as driver:
        records = driver.train(ROWS, progress=False)
        where = driver.where()
    assert [d.split("/")[0] for d in where["actor"]] == ["node0", "node1"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    keys = ("loss", "grad_norm", "entropy", "clip_ratio/region_mean") + (("value_loss", "value_grad_norm")
                                                                         if algo == "ppo" else ())
    for got, want in zip(records, expected, strict=True):
        assert got["reward"] == want["reward"], "one rollout worker: the same samples"
        assert got["skipped"] == 0 and "loss_weight" in got, "the data-parallel actor's record"
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_a_nan_on_one_actor_rank_makes_both_skip_at_once(cluster, make_tiny_policy):
    """Stage 4's NaN rule on a Ray pool of two actor ranks: a non-finite batch, or a non-finite forward, on one
    rank makes both skip the step with the same record, long before the world's 120 s timeout (a rank that
    skipped alone would leave the other in DDP's all-reduce until then); afterwards the pair trains on."""
    config = small()
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with Driver(config, make_placement("disaggregated", {"actor": [2]}), model, tok, [TASK.reward]) as driver:
        actor = driver.group_of("actor")
        rollout = driver.engine.generate([r["prompt"] for r in ROWS[:4]], config.sampling, 0,
                                         torch.Generator().manual_seed(0))
        advantages = torch.randn(len(rollout), generator=torch.Generator().manual_seed(1))
        parts = Experience(rollout, torch.zeros(len(rollout)), advantages=advantages).split(2)

        def update(per_rank, what="a finite batch"):
            """Both ranks' records; fails (instead of hanging) if a rank still waits after 60 s."""
            calls = [worker.call.remote("actor", "update", part)
                     for worker, part in zip(actor.workers, per_rank, strict=True)]
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=60 * load_factor())
            assert len(done) == len(calls), f"{what}: a rank still waits in a collective after 60 s"
            return ray.get(calls)

        def weights():
            return [dict(named) for named in actor.run("named_weights", [("actor",)] * 2)]

        before, state = weights(), driver.roles.actor.state_dict()
        nan_batch = dataclasses.replace(parts[1], advantages=parts[1].advantages.clone())
        nan_batch.advantages[0] = math.nan
        nan_weights = dict(before[1], **{"model.norm.weight": torch.full_like(before[1]["model.norm.weight"],
                                                                              math.nan)})
        for planted, per_rank in (("a NaN advantage on rank 1", [parts[0], nan_batch]),
                                  ("NaN weights on rank 1 (its forward is NaN)", parts)):
            if planted.startswith("NaN weights"):
                actor.run("restore", [None, ("actor", nan_weights, state)])
            records = update(per_rank, planted)
            assert [r["skipped"] for r in records] == [1, 1] and math.isnan(records[0]["loss"]), planted
            assert str(records[0]) == str(records[1]), f"{planted}: one record on both ranks"
            assert all(torch.equal(v, before[0][k]) for k, v in weights()[0].items()), f"{planted}: rank 0 moved"
        actor.run("restore", [None, ("actor", before[1], state)])
        records = update(parts)
        after = weights()
    assert [r["skipped"] for r in records] == [0, 0] and math.isfinite(records[0]["loss"])
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0]), "the ranks still update together"
    assert any(not torch.equal(after[0][k], before[0][k]) for k in after[0]), "and the update moved the weights"


def killer_reward(kill_at: int, stamp: str):
    """The task's reward, except that its `kill_at`-th call kills the worker it runs in (mid-step)."""
    calls = []

    def reward(prompts, completions, answer, **columns):
        calls.append(1)
        if len(calls) == kill_at:
            Path(stamp).write_text(str(time.time()))
            ray.kill(ray.get_runtime_context().current_actor)
        return TASK.reward(prompts, completions, answer)
    return reward


def test_dead_worker_is_named_within_seconds_and_the_run_resumes_exactly(cluster, make_tiny_policy, tmp_path):
    config = small(steps=4, checkpoint_every=2)
    expected, _ = stage1(config, make_tiny_policy)
    out, stamp = tmp_path / "run", tmp_path / "killed_at"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])      # the killer runs in the worker
    try:
        model, tok = make_tiny_policy(seed=3, num_layers=1)
        with pytest.raises(WorkerDiedError, match=r"actor\+rollout\+reward worker shared\[rank 0\].*step 3") as err:
            with Driver(config, make_placement("colocated"), model, tok, [killer_reward(3, str(stamp))]) as driver:
                driver.train(ROWS, out_dir=out, progress=False)
        assert time.time() - float(stamp.read_text()) < 10 * load_factor(), "reported within seconds"
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert "resume" in str(err.value) and nothing_left(), "no worker left running"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2], "step 3 never finished"
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with Driver(config, make_placement("colocated"), model, tok, [TASK.reward]) as driver:
        driver.train(ROWS, out_dir=out, resume=True, progress=False)
    assert without_timing(read_jsonl(out / "metrics.jsonl")) == without_timing(expected), \
        "nothing lost, nothing done twice"


@pytest.mark.parametrize("placement, config, error, match", [
    (make_placement("per-role", {"actor": [1, 1, 1]}), small(prompts_per_step=3), PlacementError,
     r"pool 'actor' .*\[1, 1, 1\].*2 node\(s\).*per-role: actor \[1, 1, 1\] cpu \(actor\)"),
    (make_placement("per-role", {"actor": [2], "rollout": [2]}, cpus_per_device=1.0), small(), PlacementError,
     r"pool 'reward'.*CPU 1.*node0 has CPU 0.*node1 has CPU 0"),
    (make_placement("disaggregated", {"actor": [1, 1]}), small(prompts_per_step=3), ConfigError,
     r"3 prompts per step .* 2 workers of pool 'train' \(actor\)"),
])
def test_bad_input_fails_before_any_actor_starts(cluster, make_tiny_policy, placement, config, error, match):
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        Driver(config, placement, model, tok, [TASK.reward])
    assert time.perf_counter() - start < 5 * load_factor() and nothing_left(timeout=1)


def test_role_without_a_pool(cluster, make_tiny_policy):
    placement = make_placement("per-role")
    del placement.roles["reference"]
    model, tok = make_tiny_policy(seed=3, num_layers=1)
    with pytest.raises(ConfigError, match=r"role 'reference' .*beta=0.1.* has no pool"):
        Driver(small(beta=0.1), placement, model, tok, [TASK.reward])
    assert nothing_left(timeout=1)


def test_chapter_joins_the_cluster_and_writes_its_summary(cluster, tmp_path, tiny_model_dir):
    out = tmp_path / "per-role"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "06_ray.py"), "--address", cluster.address,
                           "--model", str(tiny_model_dir),
                           "--placement", "per-role", "--out", str(out), "--steps", "2", "--eval-every", "2",
                           "--prompts-per-step", "4", "--num-generations", "4", "--compare-syncs", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "stage_shares", "sync_seconds", "placement", "steps"):
        assert key in summary, key
    assert summary["steps"] == 2 and 0 <= summary["accuracy_after"] <= 1 and summary["model"] == str(tiny_model_dir)
    assert set(summary["stage_shares"]) == {"sync", "generate", "score", "reference", "advantages", "update", "other"}
    assert all(0 <= v <= 1 for v in summary["stage_shares"].values())
    assert sum(summary["stage_shares"].values()) == pytest.approx(1.0)
    assert len({tuple(devices) for devices in summary["placement"].values()}) == 3, "per-role: three devices"
    assert set(summary["sync_compare"]) == {"collective", "object_store"} and summary["sync_seconds"] > 0
    assert proc.stdout.count("generate") >= 2 and "joined the Ray cluster" in proc.stdout
    assert (out / "timeline.png").stat().st_size > 1000 and (out / "placement.png").stat().st_size > 1000


def test_chapter_with_bf16_mixed_precision_keeps_every_update(cluster, tmp_path):
    """--mixed-precision bf16 (issue 30), colocated: the workers run each call under bf16 autocast on float32
    weights, so one step at lr 1e-6 changes (nearly) every weight of the saved policy; summary.json says bf16."""
    from test_dtypes import _changed_share

    out = tmp_path / "bf16"
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / "06_ray.py"), "--address", cluster.address,
                           "--placement", "colocated", "--out", str(out), "--steps", "1", "--learning-rate", "1e-6",
                           "--eval-every", "0", "--checkpoint-every", "0", "--mixed-precision", "bf16"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["settings"]["mixed_precision"] == "bf16"
    kept = _changed_share(out, torch.float32)
    assert kept > 0.9, f"float32 weights + the workers' bf16 autocast changed {kept:.1%}"


# --- chapter 06 on a data set, and what stops it (issues 19 and 22) ------------------------------------------------

SPY = '''
import json, os
def spy(prompts, completions, answer, **columns):
    """Records what TRL's signature hands a reward (in the reward worker); scores 1.0 for anything."""
    with open(os.path.join(os.path.dirname(__file__), "spy.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts[:2], "answer": answer[:2], "columns": sorted(columns),
                            "n": len(completions), "pid": os.getpid()}) + "\\n")
    return [1.0] * len(completions)
'''
KILLER = '''
import os
from pathlib import Path
def kill_once(prompts, completions, **columns):
    """The first call in a Ray worker after the stamp's step kills that worker (and leaves the stamp)."""
    import ray
    stamp = Path(__file__).with_name("killed")
    calls = Path(__file__).with_name("calls")
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None and not stamp.exists():
        with calls.open("a") as f:
            f.write("x")
        if len(calls.read_text()) == 2:             # the second step's scoring
            stamp.write_text("1")
            os._exit(1)
    return [0.5] * len(completions)
'''


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Word problems as text, a tiny Qwen2 with a byte-level BPE tokenizer, a spying and a killing reward."""
    from tiny_bpe import save_tiny_bpe_model

    from minirl.tasks.word_problems import write

    root = tmp_path_factory.mktemp("words")
    write(root / "plain", n_train=40, n_test=6)
    (root / "spy.py").write_text(SPY)
    (root / "killer.py").write_text(KILLER)
    return {"root": root, "model": save_tiny_bpe_model(root / "base", chat_template=False)}


def chapter(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "chapters" / script), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout * load_factor())


def steps_of(out):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "seconds"))}
            for r in read_jsonl(out / "metrics.jsonl")]


def test_chapter_on_a_data_set_gives_chapter_01s_records_and_falls_back_from_a_broken_checkpoint(
        cluster, tmp_path, words):
    """--dataset/--reward/--reward-weights/--config on stage 6: the reward workers call the task's functions with
    the columns; the records are stage 1's for the same task, bit for bit (one rollout worker). A garbage
    training_state.pt in the newest checkpoint: named, skipped, the run resumes from the one before."""
    root = words["root"]
    (tmp_path / "words.yaml").write_text(f"""
dataset: {root / "plain" / "train.jsonl"}
eval_dataset: {root / "plain" / "test.jsonl"}
reward: [math, format, {root / "spy.py"}:spy]
reward_weights: [1, 0.5, 0.25]
max_completion_length: 6
num_generations: 2
prompts_per_step: 4
learning_rate: 1.0e-3
steps: 9
""")
    common = ["--config", tmp_path / "words.yaml", "--model", words["model"], "--steps", 2, "--eval-every", 2,
              "--checkpoint-every", 1, "--threads", 1]
    out6, out1 = tmp_path / "06", tmp_path / "01"
    proc = chapter("06_ray.py", "--address", cluster.address, "--out", out6, *common)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "held-out greedy accuracy" in proc.stdout
    ref = chapter("01_single_process.py", "--no-progress", "--out", out1, *common)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = steps_of(out6), steps_of(out1)
    assert got == want, "stage 6 on a data set computes what stage 1 computes"
    names = ("math_reward", "math_format_reward", "spy")
    for m in (r for r in got if "reward" in r):
        assert all(f"rewards/{n}" in m for n in names) and m["rewards/spy"] == 1.0, sorted(m)
        assert m["reward"] == pytest.approx(sum(k * m[f"rewards/{n}"]
                                               for k, n in zip([1, 0.5, 0.25], names, strict=True)),
                                            abs=1e-6) and 0 <= m["frac_reward_zero_std"] <= 1
    calls = [json.loads(line) for line in (root / "spy.jsonl").read_text().splitlines()]
    worker_calls = [c for c in calls if c["n"] == 8 and c["pid"] != os.getpid()]   # 4 prompts x 2, both chapters
    assert len({c["pid"] for c in worker_calls}) == 2
    assert worker_calls[0]["columns"] == ["completion_ids", "log_extra", "log_metric", "trainer_state"], "TRL's"
    assert worker_calls[0]["answer"][0].split("\n")[-1].startswith("#### "), "the row's columns reach the reward"
    summary = json.loads((out6 / "summary.json").read_text())
    assert summary["task"]["rewards"] == list(names) and summary["task"]["reward_weights"] == [1.0, 0.5, 0.25]
    assert summary["task"]["eval_metric"] == "accuracy (math_reward)" and summary["settings"]["steps"] == 2
    assert summary["config_file"] == str(tmp_path / "words.yaml") and summary["settings"]["learning_rate"] == 1e-3
    logged = [json.loads(line) for line in (out6 / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in logged] == [(s, p) for s, p in [(0, "eval"), (1, "train"), (2, "train"),
                                                                            (2, "eval")] for _ in range(4)]
    assert all(set(r["rewards"]) == set(names) for r in logged), "the driver's rows, scored by the reward workers"
    assert summary["defaults"] == "trl" and f"eval/rewards/{names[0]}/mean" in summary

    newest = out6 / "checkpoints" / "step-000002"
    (newest / "training_state.pt").write_bytes(b"not a checkpoint")
    proc = chapter("06_ray.py", "--address", cluster.address, "--out", out6, "--resume", "--steps", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step-000002" in proc.stderr and "training_state.pt does not load" in proc.stderr, proc.stderr[-3000:]
    assert "falling back" in proc.stderr
    assert [r["step"] for r in steps_of(out6)] == [0, 1, 2, 3], "step 2 redone from step 1's checkpoint, once"
    assert json.loads((out6 / "summary.json").read_text())["task"]["rewards"] == list(names), "the run's own task"


def test_chapter_ctrl_c_and_a_dead_worker_each_stop_in_one_line(cluster, tmp_path, words, tiny_model_dir):
    """SIGINT: exit 130 and one line (the last intact checkpoint, the resume command). A reward worker killed in
    step 2: exit 1 and one line naming its roles, rank and node; --resume then finishes the run."""
    out = tmp_path / "int"
    proc = subprocess.Popen([sys.executable, str(REPO / "chapters" / "06_ray.py"), "--address", cluster.address,
                             "--model", str(tiny_model_dir), "--out", str(out), "--steps", "100000", "--eval-every",
                             "0", "--checkpoint-every", "1", "--prompts-per-step", "4", "--num-generations", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 300 * load_factor()
    while not list((out / "checkpoints").glob("step-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120 * load_factor())
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted: the last intact checkpoint is ") and f"--out {out} --resume" in last, last
    assert nothing_left(), "the run's workers are gone"

    root, out = words["root"], tmp_path / "dead"
    task = ["--dataset", root / "plain" / "train.jsonl", "--reward", f"{root}/killer.py:kill_once"]
    flags = ["--model", words["model"], "--prompts-per-step", 4, "--num-generations", 2, "--max-completion-length",
             4, "--eval-every", 0, "--checkpoint-every", 1]
    proc = chapter("06_ray.py", "--address", cluster.address, "--out", out, *task, *flags, "--steps", 3)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "died" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"actor\+rollout\+reward worker shared\[rank 0\] on node\d died during", lines[0]), lines[0]
    assert "the last intact checkpoint is" in lines[0] and "step-000001" in lines[0], lines[0]
    assert lines[0].endswith(f"--out {out} --resume") and nothing_left()
    proc = chapter("06_ray.py", "--address", cluster.address, "--out", out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in steps_of(out)] == [1, 2, 3]


def test_chapter_resumes_a_disaggregated_run_where_it_ran_and_refuses_changed_data(cluster, tmp_path, words):
    """A disaggregated run (its own pools, the object-store sync, an existing cluster) stopped after step 1 prints
    `--out OUT --resume` alone; that command continues it as it was (run.json's --placement, --pools, --sync,
    --address), and is refused first, in one line, while its data set is edited."""
    data, out = tmp_path / "train.jsonl", tmp_path / "disaggregated"
    original = (words["root"] / "plain" / "train.jsonl").read_text()
    data.write_text(original)
    proc = chapter("06_ray.py", "--address", cluster.address, "--placement", "disaggregated", "--pools",
                   "actor=1,rollout=1", "--sync", "object_store", "--model", words["model"], "--dataset", data,
                   "--reward", "math", "--prompts-per-step", 4, "--num-generations", 2, "--max-completion-length", 4,
                   "--eval-every", 0, "--checkpoint-every", 1, "--steps", 2, "--stop-after", 1, "--out", out)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    command = proc.stdout.strip().splitlines()[-1].partition("; continue with: ")[2]
    assert command == f"python {REPO / 'chapters' / '06_ray.py'} --out {out} --resume", proc.stdout[-2000:]

    data.write_text(original.replace("#### ", "#### 9", 1))
    refused = chapter("06_ray.py", *command.split()[2:])
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and f"error: --resume: --dataset {data} changed since the run started" in last, last
    data.write_text(original)
    proc = chapter("06_ray.py", *command.split()[2:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "joined the Ray cluster" in proc.stdout and "placement disaggregated: " in proc.stdout, proc.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["placement_kind"], summary["pools"], summary["sync"]) == ("disaggregated", "actor=1,rollout=1",
                                                                             "object_store"), summary
    assert summary["settings"]["address"] == cluster.address and [r["step"] for r in steps_of(out)] == [1, 2]
