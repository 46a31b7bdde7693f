"""Stage 9 on what stages 4 and 6 write: records shaped as their real runs write them (rank 0's timers with
`time_by_rank`, run.json's world_size and pconfig; a Ray driver's records with chapter 06's timeline.json and
summary.json placement), and what the reader says it cannot split."""

import dataclasses
import json

import pytest
from test_profiling import CONFIG, TINY, make_run, step_record
from transformers import Qwen2Config

from minirl.profiling.decompose import decompose
from minirl.profiling.mfu import run_mfu, step_flops
from minirl.runtime.diagnosis_report import decomposition_table, diagnose, run_dir_mfu
from minirl.runtime.mfu_inputs import FlopShape, flat_config
from minirl.runtime.ray_timeline import TIMELINE_FILE, split_calls

PCONFIG = {"zero": 3, "lora_rank": 0, "gradient_checkpointing": False, "colocate": True}   # stage 4's run.json


def stage4_record(step: int, **change) -> dict:
    """Rank 0's record of a 2-rank stage-4 step (keys as spmd_step writes them), with every rank's timers."""
    record = step_record(step, **change) | {"time/sleep": 0.0004, "time/wake": 0.0003}
    ranks = [{k: v for k, v in record.items() if k.startswith("time/") and k != "time/step"} for _ in range(2)]
    ranks[1]["time/update"] *= 1.02
    return record | {"time_by_rank": ranks, "memory/peak_bytes": [11853000, 11851976]}


def stage4_run(path, pconfig=PCONFIG):
    return make_run(path, [stage4_record(s) for s in (1, 2, 3)], run_info={"pconfig": pconfig, "world_size": 2})


def test_a_stage4_run_is_a_marked_partial_report(tmp_path):
    run = stage4_run(tmp_path / "r04")
    d = decompose(run)
    assert d.shares["communication"] == 0 and d.shares["waiting"] == 0
    assert any(n.startswith("2 data-parallel ranks:") and "not timed apart" in n for n in d.partial), d.partial
    assert abs(sum(d.shares.values()) - 1) < 1e-9
    diagnosis = diagnose(run, peak_tflops=0.001, quiet=True)
    comm = next(f for f in diagnosis.findings if f.rule.name == "heavy_communication")
    assert comm.value is None and "several ranks" in comm.detail, "untimed collectives are not a 0 % share"
    assert any("2 data-parallel ranks" in n for n in diagnosis.summary()["partial"])


def test_a_stage4_run_with_timed_collectives_is_not_partial(tmp_path):
    records = [stage4_record(s, **{"time/update/all_reduce": 0.1}) for s in (1, 2)]
    run = make_run(tmp_path / "r", records, run_info={"pconfig": PCONFIG, "world_size": 2})
    d = decompose(run)
    assert d.shares["communication"] > 0 and not any("ranks:" in n for n in d.partial)
    findings = diagnose(run, peak_tflops=0.001, quiet=True).findings
    comm = next(f for f in findings if f.rule.name == "heavy_communication")
    assert comm.value == pytest.approx(d.shares["communication"])


def test_stage4_mfu_reads_pconfig_and_the_world_size(tmp_path):
    shape = FlopShape.from_config(Qwen2Config(**TINY))
    config = flat_config(dataclasses.asdict(CONFIG))
    full = step_flops(step_record(1), config, shape)
    lora = step_flops(step_record(1), config | {"lora_rank": 8}, shape)
    assert lora["trainer"] == pytest.approx(full["trainer"] * 2 / 3), "LoRA: no weight gradients for frozen weights"
    checkpointed = step_flops(step_record(1), config | {"lora_rank": 8, "gradient_checkpointing": True}, shape)
    assert checkpointed["trainer_hardware"] == pytest.approx(lora["trainer"] * 3 / 2)

    plain = stage4_run(tmp_path / "full")
    adapted = stage4_run(tmp_path / "lora", PCONFIG | {"lora_rank": 4, "gradient_checkpointing": True})
    reports = [run_dir_mfu(r, json.loads((r / "run.json").read_text()), decompose(r), 1.0) for r in (plain, adapted)]
    assert reports[1].trainer == pytest.approx(reports[0].trainer * 2 / 3)
    assert reports[1].trainer_hardware == pytest.approx(reports[0].trainer), "recomputation: one more forward"
    single = run_mfu(decompose(plain).records, config, FlopShape.from_run_dir(plain), 1e12, 1e12)
    assert reports[0].trainer == pytest.approx(single.trainer / 2), "two ranks: twice the peak"


# ---------------------------------------------------------------- stage 6: the driver's records, the workers' timeline

T0 = 1_700_000_000.0                    # wall-clock seconds, as time.time() gives them


def near(x):
    return pytest.approx(x, abs=1e-5)    # microseconds: float64 resolution near T0


def ray_run(path, *, placement="disaggregated", steps=3, timeline_steps=None, timeline=True, say_steps=True):
    """A stage-6 run: the driver's records and the workers' calls (rollout 0.3 s of the driver's 0.4 s generate,
    update 0.45 of 0.5, score 0.001 of 0.01, sync 0.015 of 0.02; a colocated engine's sleep timed inside generate)."""
    records = [step_record(s) for s in range(1, steps + 1)]
    rollout, train, start = [], [], T0
    covered = records[steps - (timeline_steps or steps):]
    for record in covered:
        t = start + 0.05
        rollout += [("rollout.generate", t, t + 0.3), ("rollout.sleep", t + 0.29, t + 0.3),
                    ("reward.score", t + 0.405, t + 0.406)]
        train += [("actor.update", t + 0.42, t + 0.87)]
        rollout += [("sync.recv", t + 0.88, t + 0.895)]
        train += [("sync.send", t + 0.881, t + 0.893)]
        start += record["time/step"]
    train.append(("actor.named_weights", start + 0.01, start + 0.02))        # a checkpoint, after the last step
    run = make_run(path, records, run_info={"placement": placement, "pools": None},
                   summary={"placement": {"actor": ["node0/cpu0"], "rollout": ["node0/cpu1"],
                                          "reward": ["node0/cpu1"]}})
    if timeline:
        saved = {"clock": "time.time", "workers": {"rollout[0]": rollout, "train[0]": train}}
        (path / TIMELINE_FILE).write_text(json.dumps(saved | ({"steps": [r["step"] for r in covered]} if say_steps
                                                              else {})))
    return run


def test_a_ray_run_splits_the_driver_time_outside_the_workers(tmp_path):
    d = decompose(ray_run(tmp_path / "r06"))
    step = d.step_seconds[0]
    assert d.per_step[0]["generate/rpc"] == near(0.1), "driver 0.4 s, rollout worker 0.3 s (sleep inside)"
    assert d.per_step[0]["update/rpc"] == near(0.05)
    assert d.per_step[0]["score/rpc"] == near(0.009)
    assert d.per_step[0]["sync/rpc"] == near(0.005), "the busiest side of the sync: the receiver"
    assert d.per_step[0]["generate"] == near(0.3)
    assert d.shares["communication"] == near((0.1 + 0.05 + 0.009 + 0.005) / step)
    assert abs(sum(d.shares.values()) - 1) < 1e-9 and d.partial == []
    assert d.workers["rollout[0]"] == near((0.3 + 0.001 + 0.015) / step)
    assert d.workers["train[0]"] == near((0.45 + 0.012) / step), "a checkpoint's call is no stage's"
    assert "workers busy" in decomposition_table(d)
    diagnosis = diagnose(tmp_path / "r06", peak_tflops=0.001, quiet=True)
    comm = next(f for f in diagnosis.findings if f.rule.name == "heavy_communication")
    assert comm.value is None and "Ray calls" in comm.detail, "Ray calls are not the source's collectives"
    assert diagnosis.summary()["workers_busy"] == d.workers


@pytest.mark.parametrize("say_steps", [True, False])
def test_a_resumed_ray_run_splits_the_steps_its_timeline_covers(tmp_path, say_steps):
    d = decompose(ray_run(tmp_path / "r", steps=3, timeline_steps=2, say_steps=say_steps))
    assert "generate/rpc" not in d.per_step[0] and d.per_step[2]["generate/rpc"] == near(0.1)
    assert any("covers 2 of 3 steps" in n for n in d.partial)


def test_a_timeline_left_by_an_earlier_process_is_read_at_its_own_steps(tmp_path):
    run = ray_run(tmp_path / "r", steps=2)                  # steps 1-2 ran and wrote the timeline ...
    more = [step_record(3, generate=0.9), step_record(4, generate=0.9)]   # ... then a resume stopped after step 4
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in more))
    d = decompose(run)
    assert [("generate/rpc" in s) for s in d.per_step] == [True, True, False, False]
    assert d.per_step[0]["generate/rpc"] == near(0.1) and any("covers 2 of 4 steps" in n for n in d.partial)


def test_a_ray_timeline_that_does_not_match_is_said(tmp_path):
    run = ray_run(tmp_path / "r", steps=2)
    (run / "metrics.jsonl").write_text(json.dumps(step_record(1)) + "\n")     # 2 generate calls, 1 record
    d = decompose(run)
    assert d.shares["communication"] == 0 and any("do not match" in n for n in d.partial)
    (run / TIMELINE_FILE).write_text("{not json")
    assert any("does not load" in n for n in decompose(run).partial)
    records = [step_record(1)]
    assert split_calls(records, {"w": []}, []) == (records, {})


def test_a_ray_run_without_timeline_is_partial(tmp_path):
    d = decompose(ray_run(tmp_path / "r", timeline=False))
    assert d.shares["communication"] == 0
    assert any("without timeline.json" in n and "not separated" in n for n in d.partial)


def test_roles_called_one_after_another_add_up_and_a_trainer_pool_is_ranks(tmp_path):
    run = ray_run(tmp_path / "r", steps=1)
    timeline = json.loads((run / TIMELINE_FILE).read_text())
    t = T0 + 0.05
    timeline["workers"] |= {"ref[0]": [("reference.logprobs", t + 0.402, t + 0.403)],     # per-role: sequential
                            "critic[0]": [("critic.values", t + 0.4031, t + 0.4035)]}
    timeline["workers"]["train[0]"].append(("actor.logprobs", t + 0.4036, t + 0.4039))
    (run / TIMELINE_FILE).write_text(json.dumps(timeline))
    d = decompose(run)
    assert d.per_step[0]["reference/rpc"] == near(0.002 - 0.001 - 0.0004 - 0.0003), "three workers' calls add up"
    assert not any("ranks" in n for n in d.partial)
    summary = json.loads((run / "summary.json").read_text())
    summary["placement"]["actor"] = ["node0/cpu0", "node0/cpu2"]                        # --pools actor=2
    (run / "summary.json").write_text(json.dumps(summary))
    assert any(n.startswith("2 data-parallel ranks:") and "rank 0's" not in n for n in decompose(run).partial)


def test_stage6_mfu_counts_each_pool_s_devices(tmp_path):
    run = ray_run(tmp_path / "r")
    summary = json.loads((run / "summary.json").read_text())
    summary["placement"] |= {"actor": ["node0/cpu0", "node0/cpu1"], "rollout": ["node0/cpu2"]}
    info = json.loads((run / "run.json").read_text())
    one = run_dir_mfu(run, info, decompose(run), 1.0)
    two = run_dir_mfu(run, info, decompose(run), 1.0, summary=summary)
    assert two.trainer == pytest.approx(one.trainer / 2) and two.rollout == pytest.approx(one.rollout)
