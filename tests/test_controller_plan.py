"""Stage 6 without a Ray cluster: plans, placements, dispatch, buckets, stage order, colocated sleep, bad input."""

import contextlib
import time

import pytest
import torch

from minirl.config import RLConfig, SamplingConfig
from minirl.controller.driver import SOURCE_ORDER, driver_cycles
from minirl.controller.placement import make_placement
from minirl.controller.resource_pool import PlacementError, ResourcePool, plan_placement
from minirl.controller.worker_group import DP_COMPUTE, DP_UPDATE, concat, rank_zero, split_by_rank
from minirl.data import Rollout
from minirl.memory.measure import storage_bytes
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.engine.engine import PagedEngine
from minirl.rollout.shared_prefix import SharedPrefixEngine
from minirl.runtime.placement_checks import check_placement, needed_roles, parse_pools
from minirl.runtime.push_checks import EngineNotReady
from minirl.runtime.ray_start import connect
from minirl.runtime.source_rows import source_stage_shares
from minirl.runtime.validate import ConfigError
from minirl.sync.broadcast import TensorMeta, plan_buckets, tensor_metadata

TWO_NODES = [{"CPU": 2.0, "GPU": 0.0}, {"CPU": 2.0, "GPU": 0.0}]


# ---------------------------------------------------------------- pools and plans

def test_plan_first_fit_spans_nodes_and_packs_fractional_cpus():
    pools = {"train": ResourcePool([1, 1], cpus_per_device=1.0), "rollout": ResourcePool([4], cpus_per_device=0.25)}
    assert plan_placement(pools, TWO_NODES) == {"train": [0, 1], "rollout": [0]}   # 1 + 4 x 0.25 = 2 CPUs on node0
    gpus = [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}]
    plan = plan_placement({"a": ResourcePool([8], "gpu", 8), "b": ResourcePool([4], "gpu", 8),
                           "c": ResourcePool([4], "gpu", 8)}, gpus)
    assert plan == {"a": [0], "b": [1], "c": [1]}


@pytest.mark.parametrize("pools, match", [
    ({"train": ResourcePool([1, 1, 1])}, r"pool 'train'.*no node has that left.*2 node\(s\)"),  # > the cluster
    ({"train": ResourcePool([2], cpus_per_device=1.0), "rollout": ResourcePool([2], cpus_per_device=1.0),
      "reward": ResourcePool([1], cpus_per_device=1.0)}, r"pool 'reward'.*CPU 1.*node0 has CPU 0"),  # overcommits
    ({"rollout": ResourcePool([1], "gpu")}, r"pool 'rollout'.*GPU 1.*node0 has CPU 2 GPU 0"),        # no GPU here
])
def test_plan_rejects_what_the_cluster_cannot_hold(pools, match):
    with pytest.raises(PlacementError, match=match):
        plan_placement(pools, TWO_NODES)


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices_per_node=[]), "devices_per_node"), (dict(devices_per_node=[2, 0]), "devices_per_node"),
    (dict(devices_per_node=[1], device="tpu"), "device='tpu'"),
    (dict(devices_per_node=[1], cpus_per_device=0), "cpus_per_device=0"),
])
def test_resource_pool_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ResourcePool(**kwargs)


def test_unreachable_address_fails_within_seconds():
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=r"address='127.0.0.1:9'.*ray start --head"):
        connect("127.0.0.1:9", timeout=2.0)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------- placements

def small(**kw):
    return RLConfig.from_flat(**{"steps": 2, "prompts_per_step": 4, "num_generations": 4, "eval_every": 0} | kw)


def test_placements_map_every_role_and_size_pools():
    colocated = make_placement("colocated", {"actor": [2]})
    assert set(colocated.pools) == {"shared"} and colocated.pools["shared"].devices_per_node == [2]
    disagg = make_placement("disaggregated", parse_pools("actor=1+1,rollout=2"), device="gpu")
    assert disagg.roles["critic"] == "train" and disagg.roles["reward"] == "rollout"
    assert disagg.pools["train"].devices_per_node == [1, 1] and disagg.pools["rollout"].device == "gpu"
    per_role = make_placement("per-role", device="gpu")
    assert per_role.pools["reward"].device == "cpu", "a verifier needs no GPU"
    assert check_placement(per_role, small(algo="ppo", beta=0.1)) == {r: [r] for r in
                                                                     ("actor", "rollout", "reward", "reference",
                                                                      "critic")}
    assert needed_roles(small()) == ["actor", "rollout", "reward"]


def test_placement_bad_input_names_role_pool_and_numbers():
    with pytest.raises(ConfigError, match=r"role 'critic' .*algo='ppo'.* has no pool"):
        placement = make_placement("per-role")
        del placement.roles["critic"]
        check_placement(placement, small(algo="ppo"))
    with pytest.raises(ConfigError, match=r"6 prompts per step .* 4 workers of pool 'train' \(actor\).*multiple of 4"):
        check_placement(make_placement("disaggregated", {"actor": [2, 2]}), small(prompts_per_step=6))
    with pytest.raises(ConfigError, match=r"pools.*'critc'.*not a role"):
        make_placement("per-role", parse_pools("critc=2"))
    with pytest.raises(ConfigError, match=r"share the pool 'shared'"):
        make_placement("colocated", parse_pools("actor=2,rollout=1"))
    with pytest.raises(ConfigError, match=r"'actor=two' is not role=N"):
        parse_pools("actor=two")
    with pytest.raises(ConfigError, match=r"placement='ring'"):
        make_placement("ring")


# ---------------------------------------------------------------- dispatch

def rollout_of(n_prompts: int, G: int = 2):
    N = n_prompts * G
    return Rollout(torch.arange(N * 3).view(N, 3), torch.ones(N, 3, dtype=torch.long),
                   torch.arange(N * 2).view(N, 2), torch.ones(N, 2, dtype=torch.long), torch.zeros(N, 2),
                   [str(i) for i in range(N)], [f"p{i // G}" for i in range(N)], 0, num_generations=G)


def test_dp_compute_round_trips_a_batch_and_modes_pick_ranks():
    ro = rollout_of(4)
    per_rank = DP_COMPUTE.dispatch(2, ro, "extra")
    assert [len(args[0]) for args in per_rank] == [4, 4] and per_rank[0][1] == "extra"
    back = concat([args[0] for args in per_rank])
    assert torch.equal(back.completion_ids, ro.completion_ids) and back.prompts == ro.prompts
    assert rank_zero(3, "x") == [("x",), None, None]
    assert concat([[1, 2], [3]]) == [1, 2, 3]
    with pytest.raises(ValueError, match="3"):
        split_by_rank(2, rollout_of(3))


def test_dp_update_returns_rank_zeros_record():
    """A data-parallel update returns the same record on every rank (stage 4's reduce_metrics, on the ranks)."""
    per_rank = DP_UPDATE.dispatch(2, rollout_of(4))
    assert [len(args[0]) for args in per_rank] == [4, 4]
    assert DP_UPDATE.collect([{"loss": 1.0}, {"loss": 1.0}]) == {"loss": 1.0}


# ---------------------------------------------------------------- buckets

def test_buckets_hold_one_dtype_and_respect_the_limit():
    meta = [TensorMeta("a", (10,), torch.float32), TensorMeta("b", (10,), torch.float32),
            TensorMeta("c", (100,), torch.float32), TensorMeta("d", (4,), torch.bfloat16),
            TensorMeta("e", (4,), torch.float32)]
    names = [[m.name for m in bucket] for bucket in plan_buckets(meta, 80)]
    assert names == [["a", "b"], ["c"], ["d"], ["e"]], "40 + 40 fit 80 bytes; 400 goes alone; dtypes never mix"
    assert [[m.name for m in b] for b in plan_buckets(meta, 1 << 20)] == [["a", "b", "c"], ["d"], ["e"]]
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets(meta, 0)
    assert tensor_metadata([("w", torch.zeros(2, 3))]) == [TensorMeta("w", (2, 3), torch.float32)]


# ---------------------------------------------------------------- the source's order

def test_driver_cycles_shift_the_sync_and_stage_shares_sum_to_one():
    records = [{"step": 0, "accuracy": 0.5},
               {"step": 1, "time/generate": 1.0, "time/score": 0.1, "time/reference": 0.2, "time/advantages": 0.0,
                "time/update": 2.0, "time/sync": 0.3, "time/step": 3.7},
               {"step": 2, "time/generate": 1.5, "time/score": 0.1, "time/reference": 0.2, "time/advantages": 0.0,
                "time/update": 2.0, "time/sync": 0.4, "time/step": 4.3}]
    cycles = driver_cycles(records)
    assert [list(c) for c in cycles] == [list(SOURCE_ORDER[:-1])] * 2
    assert [c["sync"] for c in cycles] == [0.0, 0.3] and cycles[1]["generate"] == 1.5
    shares = source_stage_shares(records)
    assert list(shares)[0] == "sync" and sum(shares.values()) == pytest.approx(1.0)
    assert shares["update"] == pytest.approx(4.0 / 8.0)


# ---------------------------------------------------------------- colocated sleep

@pytest.mark.parametrize("engine_class", [SharedPrefixEngine, PagedEngine])
def test_colocated_engine_of_a_worker_sleeps_and_the_next_sync_restores_it(make_tiny_policy, engine_class):
    """What a colocated Ray worker builds: stage 4's ColocatedEngine, pushes through the engine's own load_weights
    (stream=False: the paged engine's names differ from its module's, and it must empty its prefix cache)."""
    model, tok = make_tiny_policy(seed=2, num_layers=1)
    events = []

    @contextlib.contextmanager
    def record(what):                                          # what a worker's timeline gets
        events.append(what)
        yield

    engine = ColocatedEngine(engine_class(model, tok), stream=False, record=record)
    sampling = SamplingConfig(num_generations=2)
    awake = storage_bytes(t for _, t in engine.named_weights())
    engine.generate(["1+2="], sampling, generator=torch.Generator().manual_seed(0))
    assert engine.asleep and engine.stats["released_bytes"] > 0 and events == ["sleep"]
    assert storage_bytes(t for _, t in engine.named_weights()) == 0, "asleep: no weights held"
    with pytest.raises(EngineNotReady, match="asleep"):
        engine.generate(["1+2="], sampling)
    newer, _ = make_tiny_policy(seed=3, num_layers=1)          # other weights: a stale prefix cache would show
    engine.load_weights(newer.state_dict().items(), version=1)
    assert not engine.asleep and engine.version == 1 and events == ["sleep", "wake_up"]
    assert storage_bytes(t for _, t in engine.named_weights()) == awake
    fresh = engine_class(newer, tok).generate(["1+2="], sampling, generator=torch.Generator().manual_seed(0))
    woke = engine.generate(["1+2="], sampling, generator=torch.Generator().manual_seed(0))
    assert torch.equal(woke.completion_ids, fresh.completion_ids) and torch.allclose(woke.logprobs, fresh.logprobs)
    with pytest.raises(ValueError, match=r"adapter_only=True, stream=False"):
        ColocatedEngine(engine_class(model, tok), adapter_only=True, stream=False)


# ---------------------------------------------------------------- what stops a run, in one line (issue 22)

def test_a_pool_of_zero_devices_is_refused_by_its_flag():
    with pytest.raises(ConfigError, match=r"role 'actor' is given 0 devices") as err:
        parse_pools("actor=0,rollout=1")
    assert err.value.name == "pools", "named as the --pools flag, not an internal setting"


def test_a_failed_start_is_cleaned_up_and_tried_again_with_backoff():
    from minirl.runtime.ray_start import started
    tries, stops = [], []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("Timed out while waiting for the dashboard agent to register\nmore Ray lines")
        return "up"
    import os
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    assert started(flaky, lambda: stops.append(1), "starting X", attempts=4, backoff=0.0) == "up"
    assert len(tries) == 3 and len(stops) == 2, "each failure undone before the next try"
    assert os.getpriority(os.PRIO_PROCESS, 0) == niceness, "the raised priority lasts for the start only"

    def broken():
        raise RuntimeError("Timed out while waiting for the dashboard agent to register\nmore Ray lines")
    with pytest.raises(ConnectionError) as err:
        started(broken, lambda: None, "starting a local Ray cluster of 2 CPUs", attempts=2, backoff=0.0)
    message = str(err.value)
    assert "\n" not in message and "failed 2 times" in message and "dashboard agent" in message, message
    assert "more Ray lines" not in message and "ray start --head" in message


def test_start_waits_are_raised_only_where_unset(monkeypatch):
    from minirl.runtime.ray_start import START_ENV, raise_start_waits
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "5000")
    monkeypatch.delenv("RAY_worker_register_timeout_seconds", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    raise_start_waits()
    import os
    assert os.environ["RAY_agent_register_timeout_ms"] == "5000", "the user's own setting stays"
    assert os.environ["RAY_worker_register_timeout_seconds"] == START_ENV["RAY_worker_register_timeout_seconds"]
    assert os.environ["RAY_worker_niceness"] == "0", "Ray's workers get a fair share of a busy machine"


def test_a_dead_or_oom_killed_worker_becomes_one_named_error():
    import ray

    from minirl.runtime.ray_calls import DEATHS, WorkerDiedError, died
    oom = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the "
                                          "node (IP: 10.0.0.1) was 61 GB / 64 GB")
    err = died("actor worker train[rank 1] on node2", "actor.update", oom)
    assert isinstance(err, WorkerDiedError) and isinstance(oom, DEATHS)
    assert err.what.startswith("actor worker train[rank 1] on node2 died during actor.update (killed by Ray's "
                               "memory monitor"), err.what
    assert "resume it from its last checkpoint" in str(err) and "\n" not in str(err)
    crashed = died("reward worker rollout[rank 0] on node0", "reward.score",
                   ray.exceptions.WorkerCrashedError())
    assert "reward worker rollout[rank 0] on node0 died during reward.score (" in crashed.what
