"""Stage 6 on a two-node Ray cluster (one machine): same algorithm in every placement, data parallelism across
nodes (stage 4's roles: the same update, a NaN on one rank skipped by both at once), worker death and exact resume,
bad input before any actor starts, the chapter against an existing cluster.

One cluster for the module (Ray starts slowly), two nodes of 2 CPUs; a device is a quarter-CPU slot.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from minirl.config import RLConfig  # noqa: E402
from minirl.controller.driver import Driver  # noqa: E402
from minirl.controller.placement import make_placement  # noqa: E402
from minirl.controller.resource_pool import PlacementError, local_cluster  # noqa: E402
from minirl.controller.worker_group import WorkerDiedError  # noqa: E402
from minirl.data import Experience  # noqa: E402
from minirl.tasks.arithmetic import make_task  # noqa: E402
from minirl.train.run import train  # noqa: E402
from minirl.utils.io import read_jsonl  # noqa: E402
from minirl.utils.validate import ConfigError  # noqa: E402

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
    deadline = time.time() + timeout
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
        torch.testing.assert_close(value, weights[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    keys = ("loss", "grad_norm", "entropy", "clip_ratio/region_mean") + (("value_loss", "value_grad_norm")
                                                                         if algo == "ppo" else ())
    for got, want in zip(records, expected):
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
            calls = [worker.call.remote("actor", "update", part) for worker, part in zip(actor.workers, per_rank)]
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=60)
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
        assert time.time() - float(stamp.read_text()) < 10, "reported within seconds"
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
    assert time.perf_counter() - start < 5 and nothing_left(timeout=1)


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
