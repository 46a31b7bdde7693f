"""Stage 7 in one process: the staleness rule, the gate and the queue (and what a checkpoint keeps of
them), the corrections by hand, environments that fail, in-flight weight updates, and short runs of the
asynchronous trainer (one algorithm with stage 1: num_iterations and truncated IS act; exact resume)."""

import math
import os
import threading
import time

import pytest
import torch

from minirl.asyncrl.corrections import apply_correction, capped_token_weight, clipped_token_weight
from minirl.asyncrl.env import ArithmeticToolEnv, run_sessions
from minirl.asyncrl.producer import Producer
from minirl.asyncrl.queue import ExperienceQueue, FutureVersionError, StartGate, Trajectory, admit
from minirl.asyncrl.runner import batch_of
from minirl.asyncrl.timeline import sync_step_idle
from minirl.config import AlgorithmConfig, RLConfig, SamplingConfig
from minirl.data import Experience, Rollout
from minirl.rollout.shared_prefix import SharedPrefixEngine
from minirl.runtime.async_bookkeeping import WeightStore
from minirl.runtime.async_config import AsyncConfig
from minirl.runtime.async_envs import EnvError, Latency, calculator, check_step
from minirl.runtime.async_run import train_async
from minirl.runtime.async_snapshots import evaluate_snapshots, plateau, speedup_to_target, time_to_stay
from minirl.runtime.validate import ConfigError
from minirl.tasks.arithmetic import make_task

TASK = make_task()
ROWS = TASK.rows("train")
FAST = dict(env_latency=0.001, env_latency_sigma=0.5)


def rollout_of(version: int, G: int = 2, C: int = 2) -> Rollout:
    return Rollout(torch.ones(G, 3, dtype=torch.long), torch.ones(G, 3, dtype=torch.long),
                   torch.ones(G, C, dtype=torch.long), torch.ones(G, C, dtype=torch.long), torch.zeros(G, C),
                   ["c"] * G, ["p"] * G, version, num_generations=G, token_versions=torch.full((G, C), version))


def traj(version: int, finished: float = 0.0, ticket: int = -1) -> Trajectory:
    return Trajectory(rollout_of(version), torch.zeros(2), {"prompt": "1+1="}, "t", 0.0, 0.0, finished, ticket=ticket)


def test_admit_rule_and_bad_input():
    assert admit(5, 5, 0) and admit(5, 3, 2) and not admit(5, 2, 2) and not admit(5, 4, 0)
    with pytest.raises(FutureVersionError, match="newer"):
        admit(3, 4, 2)
    with pytest.raises(ConfigError, match="max_staleness"):
        admit(3, 3, -1)


def test_async_config_names_bad_values():
    with pytest.raises(ConfigError, match="max_staleness"):
        AsyncConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="correction"):
        AsyncConfig(correction="ppo")
    with pytest.raises(ConfigError, match="env_latency_sigma"):
        AsyncConfig(env_latency_sigma=-0.1)


def test_queue_capacity_below_one_batch_is_refused():
    with pytest.raises(ConfigError, match="queue_capacity"):
        ExperienceQueue(capacity=3, batch_size=4, max_staleness=1)
    cfg = RLConfig.from_flat(steps=1, prompts_per_step=4, num_generations=2)
    model_free = AsyncConfig(queue_capacity=2)
    with pytest.raises(ConfigError, match="queue_capacity"):
        train_async(cfg, model_free, *_tiny_policy(), ROWS)


def _tiny_policy():
    from tests.conftest import build_tiny_policy  # noqa: PLC0415 (the shared factory, outside a fixture)
    return build_tiny_policy()


def test_queue_admission_drops_stale_refunds_the_gate_and_refuses_future_versions():
    gate = StartGate(batch_size=2, max_staleness=1)
    q = ExperienceQueue(capacity=6, batch_size=2, max_staleness=1, gate=gate)
    assert [gate.acquire() for _ in range(3)] == [[0], [1], [2]]
    assert gate.acquire(5) == [3]            # (0 + 1 + 1) * 2 tickets at version 0
    for v in (0, 0, 0):
        assert q.put(traj(v))
    q.advance(2)                                                          # two updates later: version 0 is too stale
    assert not q.put(traj(0)) and q.dropped == 1 and gate.started == 3   # dropped at put, start refunded
    assert q.put(traj(1)) and q.put(traj(2))
    batch = q.get_batch(timeout=1)                                        # the three of version 0 are dropped now
    assert [t.version for t in batch] == [1, 2] and q.dropped == 4
    with pytest.raises(FutureVersionError):
        q.put(traj(3))
    stats = q.stats()
    assert stats["queue/depth"] == 0 and stats["queue/dropped"] == 4 and stats["queue/admitted"] == 2


def test_queue_blocks_when_full_and_times_out_without_producers():
    q = ExperienceQueue(capacity=2, batch_size=2, max_staleness=0)
    q.put(traj(0, finished=time.perf_counter()))
    q.put(traj(0))
    put_done = threading.Event()
    threading.Thread(target=lambda: (q.put(traj(0)), put_done.set()), daemon=True).start()
    assert not put_done.wait(0.2), "a full queue must block the producer"
    assert len(q.get_batch(timeout=1)) == 2
    assert put_done.wait(1.0)
    with pytest.raises(TimeoutError, match="1 of 2"):
        q.get_batch(timeout=0.1)
    assert len(q) == 1, "a timed-out get puts its partial batch back"


def test_gate_at_eta_zero_is_synchronous():
    gate = StartGate(batch_size=3, max_staleness=0)
    assert gate.acquire(2) == [0, 1] and gate.acquire(2) == [2]
    got = []
    t = threading.Thread(target=lambda: got.append(gate.acquire()), daemon=True)
    t.start()
    t.join(0.2)
    assert not got, "the fourth trajectory waits for version 1"
    gate.advance(1)
    t.join(1.0)
    assert got == [[3]]
    gate.close()
    assert gate.acquire() is None


def test_corrections_by_hand():
    cur = torch.tensor([[-1.0, -2.0, -0.3]])
    beh = torch.tensor([[-1.5, -1.0, float("nan")]])                       # garbage under the mask
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(clipped_token_weight(cur, beh, mask), torch.tensor([[1.2, 0.8, 0.0]]))
    assert torch.allclose(clipped_token_weight(cur, beh, mask, 0.5, 2.0), torch.tensor([[math.exp(0.5), 0.5, 0.0]]))
    assert torch.allclose(capped_token_weight(cur, beh, mask, 1.2), torch.tensor([[0.0, math.exp(-1.0), 0.0]]))
    with pytest.raises(ValueError, match="low"):
        clipped_token_weight(cur, beh, mask, low=1.1)
    cur.requires_grad_(True)
    assert not clipped_token_weight(cur, beh, mask).requires_grad


class FixedActor:
    def __init__(self, logps):
        self.logps = logps

    def logprobs(self, rollout):
        return self.logps


def test_apply_correction_fills_the_fields_policy_loss_reads():
    ro = rollout_of(0)
    ro.logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]])
    current = torch.tensor([[-0.5, -3.0], [-2.0, -0.4]])
    algo = AlgorithmConfig()
    exp = apply_correction(Experience(ro, torch.zeros(2)), "none", FixedActor(current), algo)
    assert exp.old_logps is None and exp.is_weights is None
    pi_old = torch.full((2, 2), -0.7)                       # make_experience's pi_old (num_iterations > 1)
    exp = apply_correction(Experience(ro, torch.zeros(2), old_logps=pi_old), "none", FixedActor(current), algo)
    assert exp.old_logps is pi_old and exp.is_weights is None, "none keeps the pi_old the iterations need"
    exp = apply_correction(Experience(ro, torch.zeros(2)), "tis", FixedActor(current), algo)
    assert torch.equal(exp.old_logps, current)
    tis = torch.tensor([[math.exp(0.5), math.exp(-2.0)], [1.0, math.exp(0.1)]])
    assert torch.allclose(exp.is_weights, tis)
    on = AlgorithmConfig(importance_sampling_correction=True)       # stage 1's switch is the same correction
    exp = apply_correction(Experience(ro, torch.zeros(2)), "none", FixedActor(current), on)
    assert torch.allclose(exp.is_weights, tis), "importance_sampling_correction is honoured, not dropped"
    exp = apply_correction(Experience(ro, torch.zeros(2)), "areal", FixedActor(current), algo)
    assert torch.allclose(exp.is_weights, torch.tensor([[1.2, 0.8], [1.0, math.exp(0.1)]]))
    with pytest.raises(ConfigError, match="correction"):
        apply_correction(Experience(ro, torch.zeros(2)), "vtrace", FixedActor(current), algo)
    with pytest.raises(ConfigError, match="importance_sampling_correction"):
        apply_correction(Experience(ro, torch.zeros(2)), "areal", FixedActor(current), on)


def test_sync_step_idle():
    out = sync_step_idle([1.0, 2.0, 4.0], train_seconds=1.0)
    assert out["trainer"] == pytest.approx(4 / 5)
    assert out["rollout"] == pytest.approx(((5 - 1) + (5 - 2) + (5 - 4)) / 15)


def test_calculator_latency_is_seeded_and_long_tailed():
    import random
    lat = Latency(0.002, 1.5)
    a = [lat.draw(random.Random(7)) for _ in range(3)]
    assert a == [lat.draw(random.Random(7)) for _ in range(3)]
    assert calculator("12+30=", Latency(0.0), random.Random(0)) == 42
    with pytest.raises(ValueError, match="cannot evaluate"):
        calculator("12/3", Latency(0.0), random.Random(0))


class Raises:
    def reset(self, row, rng):
        return row["prompt"]

    def step(self, action):
        raise ConnectionError("tool server refused")


class Hangs(Raises):
    def step(self, action):
        time.sleep(2.0)
        return None, 1.0, True


class JunkObservation(Raises):
    def reset(self, row, rng):
        return {"not": "a string"}


class JunkReward(Raises):
    def step(self, action):
        return None, "high", True


def test_failed_hung_and_malformed_environments_are_scored_zero_and_counted():
    row = {"prompt": "12+30=", "answer": 42}
    good = run_sessions(lambda: ArithmeticToolEnv(Latency(0.0)), row, ["24", "42"], None, [0, 1], timeout=1.0)
    assert [r.reward for r in good] == [1.0, 0.0] and all(r.error is None for r in good)
    start = time.perf_counter()
    for make_env, words in ((Raises, "ConnectionError"), (Hangs, "timeout"), (JunkObservation, "reset returned"),
                            (JunkReward, "finite number")):
        (r,) = run_sessions(make_env, row, ["24"], None, [0], timeout=0.3)
        assert r.reward == 0.0 and words in r.error, (make_env, r)
        assert r.timed_out == (make_env is Hangs)
    load = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))          # a busy machine runs slower
    assert time.perf_counter() - start < 1.5 * load, "a hung session is abandoned at its timeout"
    with pytest.raises(EnvError, match="done"):
        check_step((None, 1.0, "yes"))


def test_multi_turn_environment_asks_again():
    row = {"prompt": "12+30=", "answer": 42}
    answers = iter(["24"])
    (r,) = run_sessions(lambda: ArithmeticToolEnv(Latency(0.0), max_turns=2), row, ["99"], lambda obs: next(answers),
                        [0], timeout=1.0, max_turns=2)
    assert (r.reward, r.turns, r.error) == (0.5, 2, None)


def in_flight_producer(model, tok, store, sampling):
    return Producer("p", SharedPrefixEngine(model, tok), store, None, sampling, in_flight=True)


def test_in_flight_update_mixes_versions_without_dropping_the_sequence(make_tiny_policy):
    model, tok = make_tiny_policy(seed=3)
    other, _ = make_tiny_policy(seed=4)
    sampling = SamplingConfig(num_generations=3, max_completion_length=4, temperature=1.0)
    store = WeightStore()
    store.publish(model.state_dict().items(), 0)
    producer = in_flight_producer(model, tok, store, sampling)
    pull, calls = producer.refresh, [0]

    def refresh(mid_sequence=False):         # call 1: before the engine call; 2: before token 1; 3: before token 2
        calls[0] += 1
        if calls[0] == 3:
            store.publish(other.state_dict().items(), 1)           # version 1 lands after the second token
        pull(mid_sequence)
    producer.refresh = refresh
    ro = producer.sample(["12+30="], torch.Generator().manual_seed(0))
    C = ro.completion_ids.shape[1]
    assert ro.token_versions[:, :2].eq(0).all()
    if C > 2:
        assert ro.token_versions[:, 2:].eq(1).all() and producer.switches == 1
    assert ro.version == 0 and producer.engine.version == 1
    # each token's behaviour log-prob is the one it was sampled with: the first two tokens under version 0
    fresh = WeightStore()
    fresh.publish(model.state_dict().items(), 0)
    ro0 = in_flight_producer(model, tok, fresh, sampling).sample(["12+30="], torch.Generator().manual_seed(0))
    assert torch.equal(ro.completion_ids[:, :2], ro0.completion_ids[:, :2])
    assert torch.allclose(ro.logprobs[:, :2], ro0.logprobs[:, :2])


def test_in_flight_sampling_is_the_shared_prefix_loop_and_matches_the_trainers_logprobs(make_tiny_policy):
    from minirl.config import OptimizerConfig
    from minirl.roles.actor import Actor
    model, tok = make_tiny_policy(seed=5)
    sampling = SamplingConfig(num_generations=4, max_completion_length=4)
    store = WeightStore()
    store.publish(model.state_dict().items(), 0)
    ro = in_flight_producer(model, tok, store, sampling).sample(["7+8=", "12+3="], torch.Generator().manual_seed(1))
    plain = SharedPrefixEngine(model, tok).generate(["7+8=", "12+3="], sampling,
                                                    generator=torch.Generator().manual_seed(1))
    assert torch.equal(ro.completion_ids, plain.completion_ids), "no updates: the engine's own samples"
    assert ro.token_versions.eq(0).all() and ro.version == 0
    actor = Actor(model, AlgorithmConfig(), OptimizerConfig(), sampling)
    m = ro.completion_mask.bool()
    assert torch.allclose(actor.logprobs(ro)[m], ro.logprobs[m], atol=1e-5)
    from minirl.rollout.hf import HFEngine
    with pytest.raises(TypeError, match="SharedPrefixEngine"):
        Producer("p", HFEngine(model, tok), store, None, sampling, in_flight=True)


def small(**kw):
    return RLConfig.from_flat(**{"steps": 4, "prompts_per_step": 4, "num_generations": 4, "eval_every": 0} | kw)


@pytest.mark.parametrize("eta,correction", [(0, "none"), (1, "areal"), (2, "tis")])
def test_runner_short_run_records_versions_queue_and_staleness(make_tiny_policy, eta, correction):
    torch.set_num_threads(1)
    model, tok = make_tiny_policy(seed=2)
    acfg = AsyncConfig(max_staleness=eta, correction=correction, producers=4, snapshot_every=2, **FAST)
    result = train_async(small(), acfg, model, tok, ROWS)
    recs = result.records
    assert [r["version"] for r in recs] == [1, 2, 3, 4] and [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(0 <= r["staleness/max"] <= eta for r in recs)
    assert all(r["generated_version"] <= r["version"] - 1 for r in recs)
    for key in ("time/wait", "time/update", "time/sync", "queue/depth", "queue/age_max", "queue/dropped", "reward",
                "env/failures", "trajectories"):
        assert key in recs[0], key
    if eta == 0:
        assert all(r["staleness/max"] == 0 for r in recs)
    if correction != "none":
        assert "correction/weight_mean" in recs[-1]
    acc = evaluate_snapshots(result, model, lambda m: 0.5)
    assert [a["step"] for a in acc] == [0, 2, 4] and acc[-1]["samples"] == 4 * 4 * 4
    summary = result.summary()
    assert 0 <= summary["trainer_idle_share"] <= 1 and summary["trajectories_per_second"] > 0
    assert time_to_stay(acc, 0.5) == acc[1]["wall"] > 0 and time_to_stay(acc, 0.9) == math.inf


def test_target_is_syncs_plateau_and_a_run_must_stay_above_it():
    """The rule of benchmarks/async_vs_sync.py and notebook 07: the target is the median of sync's last
    evaluations minus 3 points; a run reaches it at the first evaluation from which it stays at or above it
    to the end (a touch followed by a fall does not count); the setting compared is the one named."""
    curve = lambda accs: [{"step": 5 * i, "wall": 10.0 * i, "accuracy": a} for i, a in enumerate(accs)]  # noqa: E731
    sync = curve([0.5, 0.6, 0.69, 0.70, 0.69, 0.73])                      # a lucky last evaluation
    assert plateau(sync, 3) == 0.70 and plateau(sync, 1) == 0.73
    target = plateau(sync, 3) - 0.03                                       # 0.67, not 0.70
    assert time_to_stay(sync, target) == 20.0
    assert time_to_stay(curve([0.5, 0.75, 0.43, 0.6, 0.53]), target) == math.inf, "touched, fell back"
    assert time_to_stay(curve([0.5, 0.75, 0.6, 0.68, 0.7]), target) == 30.0, "back for good at 30 s"
    assert time_to_stay(curve([0.9, 0.7]), target) == 10.0, "step 0 (before training) does not count"
    rule = speedup_to_target(sync, curve([0.5, 0.68, 0.6, 0.7, 0.7, 0.71]))
    assert rule["target"] == pytest.approx(0.67) and (rule["sync_s"], rule["run_s"]) == (20.0, 30.0)
    assert rule["speedup"] == pytest.approx(2 / 3)
    assert speedup_to_target(sync, curve([0.5, 0.75, 0.43, 0.6, 0.53]))["speedup"] == 0.0, "never stayed: 0"
    assert math.isnan(speedup_to_target(curve([0.5, 0.8, 0.8, 0.6]), sync)["speedup"]), "sync fell: not measured"


def test_async_benchmark_names_its_setting_before_the_race():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "async_vs_sync", Path(__file__).resolve().parents[1] / "benchmarks" / "async_vs_sync.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.speedup_to_target is speedup_to_target                    # one rule, the package's
    args = bench.parse_args([])
    assert (args.eta, args.correction, args.steps, args.repeats) == (1, "none", 90, 3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--correction", "best"])


def test_runner_survives_a_broken_environment(make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    acfg = AsyncConfig(max_staleness=1, producers=2, env_timeout=0.2, **FAST)
    acfg.make_env = lambda: Raises
    result = train_async(small(steps=2), acfg, model, tok, ROWS)
    assert all(r["env/failures"] == 16 for r in result.records) and result.records[-1]["reward"] == 0.0
    assert "ConnectionError" in result.records[0]["env/errors"][0]


def test_runner_multi_turn_run(make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    acfg = AsyncConfig(max_staleness=1, producers=2, max_turns=2, **FAST)
    result = train_async(small(steps=2), acfg, model, tok, ROWS)
    assert len(result.records) == 2 and all(r["env/failures"] == 0 for r in result.records)
    assert all(0.0 <= r["reward"] <= 1.0 for r in result.records)


def test_runner_in_flight_run(make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    acfg = AsyncConfig(max_staleness=2, producers=3, in_flight=True, **FAST)
    result = train_async(small(steps=3), acfg, model, tok, ROWS)
    assert len(result.records) == 3 and result.switches >= 0


def test_batch_of_keeps_per_token_versions_and_the_oldest_version():
    rollout, rewards = batch_of([traj(3), traj(1), traj(2)])
    assert rollout.version == 1 and rewards.shape == (6,)
    assert rollout.token_versions[:, 0].tolist() == [3, 3, 1, 1, 2, 2]


def test_gate_never_reuses_a_ticket_after_a_refund():
    gate = StartGate(batch_size=2, max_staleness=0)
    assert gate.acquire(2) == [0, 1]
    gate.refund()                                           # ticket 1 was dropped: one more may start
    assert gate.acquire(2) == [2], "a new number: ticket 1's prompt and seed are not sampled twice"


def test_queue_state_dict_saves_queued_and_hands_in_flight_calls_out_again():
    gate = StartGate(batch_size=4, max_staleness=1)
    q = ExperienceQueue(capacity=8, batch_size=4, max_staleness=1, gate=gate)
    calls = [gate.acquire(2) for _ in range(4)]             # [0, 1] [2, 3] [4, 5] [6, 7]
    assert calls == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for t in (0, 1, 2, 3):
        q.put(traj(0, ticket=t))
    assert [t.ticket for t in q.get_batch(timeout=1)] == [0, 1, 2, 3]
    q.advance(1)
    gate.advance(1)
    q.put(traj(1, ticket=4))
    q.put(traj(1, ticket=5))                                # call [4, 5] complete and queued
    q.put(traj(1, ticket=6))                                # call [6, 7]: 6 queued, 7 still in flight
    assert gate.acquire(2) == [8, 9]                        # in flight: nothing of it queued yet
    saved = q.state_dict()
    assert [t.ticket for t in saved["queued"]] == [4, 5], "queued: saved; 6 goes with its call"
    assert saved["gate"]["again"] == [[6, 7], [8, 9]] and saved["gate"]["next_ticket"] == 10
    assert saved["admitted"] == 4

    gate2 = StartGate(batch_size=4, max_staleness=1)
    q2 = ExperienceQueue(capacity=8, batch_size=4, max_staleness=1, gate=gate2)
    q2.load_state_dict(saved, version=1)
    assert [t.ticket for t in q2._items] == [4, 5] and q2.trainer_version == 1 and q2.admitted == 4
    assert gate2.started == 6, "trained + queued; what was in flight starts again"
    assert gate2.acquire(2) == [6, 7] and gate2.acquire(2) == [8, 9], "in-flight calls, whole, first"
    assert gate2.started == 10 and gate2.limit() == 12
    assert gate2.acquire(2) == [10, 11], "then new tickets, where the run left off"
    with pytest.raises(FutureVersionError):
        q2.put(traj(2, ticket=6))


class Parity:
    """Reward 1 for a completion of even length: a reward that varies within a group even for a random policy
    (so the updates move the weights)."""

    def reset(self, row, rng):
        return row["prompt"]

    def step(self, action):
        return None, float(len(action) % 2 == 0), True


def parity_run(model, tok, steps=3, eta=1, correction="none", **config):
    acfg = AsyncConfig(max_staleness=eta, correction=correction, producers=2, prompts_per_call=2, **FAST)
    acfg.make_env = lambda: Parity
    settings = {"learning_rate": 3e-2, "num_iterations": 4} | config
    return train_async(small(steps=steps, **settings), acfg, model, tok, ROWS)


def later_iterations_move(records) -> bool:
    """With num_iterations = 4 the last iteration's ratio is against pi_old, three updates back: not 1, and
    clipping acts. (Ratio 1 on every iteration is four unclipped policy-gradient steps.)"""
    return (any(abs(r["ratio_mean"] - 1) > 1e-3 for r in records)
            and any(r["clip_ratio/region_mean"] > 0 for r in records))


@pytest.mark.parametrize("correction", ["none", "areal", "tis"])
def test_num_iterations_ratio_is_against_pi_old_under_every_correction(make_tiny_policy, correction):
    torch.set_num_threads(1)
    model, tok = make_tiny_policy(seed=2)
    result = parity_run(model, tok, correction=correction)
    assert later_iterations_move(result.records), [(r["ratio_mean"], r["clip_ratio/region_mean"])
                                                   for r in result.records]


def test_the_old_none_correction_fails_the_iterations_check(make_tiny_policy, monkeypatch):
    """The wrong version (`none` threw pi_old away): every iteration's ratio is 1 and the check above fails."""
    import minirl.runtime.async_run as async_run  # its Correction calls apply_correction

    def old_none(exp, correction, actor, algorithm, areal_weight="clip"):
        exp.old_logps, exp.is_weights = None, None
        return exp
    monkeypatch.setattr(async_run, "apply_correction", old_none)
    model, tok = make_tiny_policy(seed=2)
    records = parity_run(model, tok).records
    assert all(r["ratio_mean"] == 1.0 and r["clip_ratio/region_mean"] == 0.0 for r in records)
    assert not later_iterations_move(records)


def test_importance_sampling_correction_is_honoured_and_refused_with_areal(make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    records = parity_run(model, tok, steps=2, num_iterations=1, importance_sampling_correction=True).records
    assert all("correction/weight_mean" in r for r in records), "stage 1's truncated IS switch acts in stage 7"
    plain = parity_run(*make_tiny_policy(seed=2), steps=2, num_iterations=1).records
    assert all("correction/weight_mean" not in r for r in plain)
    with pytest.raises(ConfigError, match="importance_sampling_correction"):
        parity_run(model, tok, correction="areal", importance_sampling_correction=True)
    with pytest.raises(ConfigError, match="in_flight"):
        train_async(small(rollout_engine="paged"), AsyncConfig(in_flight=True), model, tok, ROWS)


def test_run_directory_metrics_as_they_happen_evaluator_and_snapshots(make_tiny_policy, tmp_path):
    from minirl.train.run import Callback

    class CountLines(Callback):
        def __init__(self):
            self.seen = []

        def on_step(self, state, record):
            self.seen.append(len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
    model, tok = make_tiny_policy(seed=2)
    lines = CountLines()
    acfg = AsyncConfig(max_staleness=1, producers=2, prompts_per_call=2, snapshot_every=2, **FAST)
    result = train_async(small(steps=3, eval_every=2, checkpoint_every=2), acfg, model, tok, ROWS,
                         out_dir=tmp_path / "run", eval_fn=lambda m: 0.25, extra_callbacks=(lines,))
    assert lines.seen == [2, 3, 4], "metrics.jsonl has the step-0 evaluation and each step when it is logged"
    assert [r["step"] for r in result.records] == [1, 2, 3] and "accuracy" in result.records[1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert [s.step for s in result.snapshots] == [0, 2, 3] and all(s.path.exists() for s in result.snapshots)
    assert (tmp_path / "run" / "final" / "config.json").exists()


def resumable(model, tok, out, steps, eta, stop_after=None, resume=False, extra=(), **async_settings):
    from minirl.train.run import RunStopped
    acfg = AsyncConfig(**{"max_staleness": eta, "producers": 3, "prompts_per_call": 2, "snapshot_every": 2} | FAST
                       | async_settings)
    acfg.make_env = lambda: Parity
    config = small(steps=steps, checkpoint_every=2, keep_checkpoints=5, learning_rate=1e-2, num_iterations=2)
    try:
        return train_async(config, acfg, model, tok, ROWS, out_dir=out, stop_after=stop_after, resume=resume,
                           extra_callbacks=extra)
    except RunStopped:
        return None


ALGORITHM_KEYS = ("step", "version", "generated_version", "reward", "reward_std", "loss", "ratio_mean", "grad_norm",
                  "staleness/max", "tokens/completion", "trajectories", "samples")


def test_resume_at_eta_zero_repeats_the_uninterrupted_run_exactly(make_tiny_policy, tmp_path):
    torch.set_num_threads(1)
    whole, tok = make_tiny_policy(seed=2)
    straight = resumable(whole, tok, tmp_path / "a", 5, eta=0)
    crashed, _ = make_tiny_policy(seed=2)
    assert resumable(crashed, tok, tmp_path / "b", 5, eta=0, stop_after=3) is None      # last checkpoint: step 2
    resumed = resumable(crashed, tok, tmp_path / "b", 5, eta=0, resume=True)
    assert [[r[k] for k in ALGORITHM_KEYS] for r in resumed.records] == \
           [[r[k] for k in ALGORITHM_KEYS] for r in straight.records]
    assert all(torch.equal(a, b)
               for a, b in zip(whole.state_dict().values(), crashed.state_dict().values(), strict=True))
    assert [s.step for s in resumed.snapshots] == [0, 2, 4, 5] and resumed.summary()["steps"] == 5


def test_resume_requeues_the_checkpoints_queue_and_refuses_other_async_settings(make_tiny_policy, tmp_path):
    from minirl.train.run import Callback

    class Seen(Callback):
        def on_start(self, state):
            self.queued = [t.ticket for t in state.queue._items]
            self.again = [list(c) for c in state.gate.again]
            self.step, self.version = state.step, state.roles.version
    model, tok = make_tiny_policy(seed=2)
    assert resumable(model, tok, tmp_path / "run", 6, eta=1, stop_after=3) is None
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "training_state.pt", weights_only=False)
    queue = saved["extra"]["queue"]
    with pytest.raises(ConfigError, match="max_staleness"):
        resumable(model, tok, tmp_path / "run", 6, eta=2, resume=True)
    with pytest.raises(ConfigError, match="producers"):
        resumable(model, tok, tmp_path / "run", 6, eta=1, resume=True, producers=1)
    seen = Seen()
    resumed = resumable(model, tok, tmp_path / "run", 6, eta=1, resume=True, extra=(seen,))
    assert (seen.step, seen.version) == (2, 2)
    assert seen.queued == [t.ticket for t in queue["queued"]], "the checkpoint's queued trajectories, re-queued"
    assert seen.again == queue["gate"]["again"], "its in-flight calls, handed out again"
    assert len(queue["queued"]) + sum(map(len, queue["gate"]["again"])) > 0, "eta = 1 runs a batch ahead"
    assert [r["step"] for r in resumed.records] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in resumed.records] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/max"] <= 1 for r in resumed.records)


# ---------------------------------------------------------------- any task: a data set's rewards as the environment

def test_reward_env_scores_one_completion_with_the_columns_and_the_weights():
    from minirl.runtime.async_envs import RewardEnv
    seen = []

    def exact(prompts, completions, answer, **columns):
        seen.append((prompts, completions, answer, sorted(columns)))
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer, strict=True)]

    def length(prompts, completions, **columns):
        return [len(c) for c in completions]
    make_env = lambda: RewardEnv([exact, length], [1.0, 0.1])  # noqa: E731
    row = {"prompt": "Question: 2+2?\nAnswer:", "answer": 4, "level": "easy"}
    results = run_sessions(make_env, row, ["4", "5!"], None, [0, 1], timeout=2.0)
    assert [r.scores for r in results] == [{"exact": 1.0, "length": 1.0}, {"exact": 0.0, "length": 2.0}]
    assert [r.reward for r in results] == [pytest.approx(1.1), pytest.approx(0.2)], "the weighted sum"
    assert seen[0][0] == [row["prompt"]] and seen[0][2] == [4] and seen[0][3] == ["level"], "the row's columns"

    def broken(prompts, completions, **columns):
        raise KeyError("no such column")
    (failed,) = run_sessions(lambda: RewardEnv([broken]), row, ["4"], None, [0], timeout=2.0)
    assert failed.reward == 0.0 and "KeyError" in failed.error and failed.scores is None, "one session, scored 0"


def test_train_async_on_a_task_logs_each_reward_and_the_zero_std_share(make_tiny_policy):
    from functools import partial

    from minirl.runtime.async_envs import RewardEnv
    from minirl.tasks.arithmetic import arithmetic_reward

    def half(prompts, completions, **columns):
        return [0.5] * len(completions)
    model, tok = make_tiny_policy(seed=2)
    config = RLConfig.from_flat(steps=2, prompts_per_step=4, num_generations=4, eval_every=0)
    acfg = AsyncConfig(max_staleness=1, producers=2, prompts_per_call=2)
    result = train_async(config, acfg, model, tok, make_task().rows("train"),
                         make_env=partial(RewardEnv, [arithmetic_reward, half], [1.0, 2.0]))
    for r in result.records:
        assert r["rewards/half"] == 0.5 and 0 <= r["rewards/arithmetic_reward"] <= 1
        assert r["reward"] == pytest.approx(r["rewards/arithmetic_reward"] + 2 * 0.5, abs=1e-6)
        assert 0 <= r["frac_reward_zero_std"] <= 1 and r["env/failures"] == 0
