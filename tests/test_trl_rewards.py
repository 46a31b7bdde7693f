"""Rewards as TRL calls them in every training chapter (issue 31 item 4): completion_ids, trainer_state,
log_metric, log_extra, None, async def, the module.function spec; chapter 01 and 07 runs, the plumbing's parts.

Chapter 06 (the reward workers) is tested in test_controller.py, on that module's Ray cluster."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minirl.config import RLConfig
from minirl.runtime.reward_extras import (
    RewardExtras,
    TrainerClock,
    joined_rewards,
    remote_rows,
    worker_rewards,
)
from minirl.runtime.spmd_support import rank_records
from minirl.tasks.rewards import check_reward_columns

REPO = Path(__file__).resolve().parents[1]

# One reward of each kind TRL's users write; each checks what it is given (a failed assert stops the run).
TRL_REWARDS = '''
import asyncio

def by_ids(prompts, completions, completion_ids, **kwargs):
    """TRL's completion_ids: one list of ints per completion, no padding (the record checks the lengths)."""
    assert len(completion_ids) == len(completions), (len(completion_ids), len(completions))
    assert all(type(i) is int for ids in completion_ids for i in ids), completion_ids
    return [-len(ids) / 10 for ids in completion_ids]

def by_step(completions, trainer_state, log_metric, **kwargs):
    """Reads TRL's trainer_state, logs it with log_metric."""
    log_metric("curriculum/step", trainer_state.global_step)
    log_metric("curriculum/max_steps", trainer_state.max_steps)
    log_metric("curriculum/epoch", trainer_state.epoch)
    return [0.0] * len(completions)

def some_none(completions, **kwargs):
    """None: does not apply (every other completion)."""
    return [None if i % 2 else 1.0 for i in range(len(completions))]

async def judge(completions, log_extra, **kwargs):
    """An async judge that adds a column to the completions table."""
    await asyncio.sleep(0)
    log_extra("judge_note", ["ok"] * len(completions))
    return [0.5] * len(completions)
'''
SPECS = ["trl_rewards.by_ids", "trl_rewards:by_step", "trl_rewards.some_none", "trl_rewards.judge", "arithmetic"]


def run(script: str, tmp_path: Path, *args) -> list[dict]:
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    rewards = [x for spec in SPECS for x in ("--reward", spec)]
    proc = subprocess.run([sys.executable, str(REPO / "chapters" / script), "--out", str(tmp_path / "run"),
                           "--steps", "2", "--prompts-per-step", "4", *rewards, *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def check_records(steps: list[dict], rows: int) -> None:
    assert [r["curriculum/step"] for r in steps] == [0.0, 1.0], "trainer_state.global_step: the steps done"
    for r in steps:
        assert r["curriculum/max_steps"] == 2.0 and r["curriculum/epoch"] == pytest.approx(r["curriculum/step"] * 4
                                                                                            / rows)
        assert r["rewards/by_ids"] == pytest.approx(-r["completion_length"] / 10, abs=1e-5), "the ids' lengths"
        assert r["rewards/some_none"] == 1.0, "None is left out of that reward's mean"
        assert r["rewards/judge"] == 0.5 and r["reward_errors" if "reward_errors" in r else "env/failures"] == 0


def test_chapter_01_calls_every_kind_of_trl_reward(tmp_path):
    steps = [r for r in run("01_single_process.py", tmp_path, "--eval-every", "0", "--no-progress")
             if "reward" in r]
    check_records(steps, 9000)                       # the embedded task's training rows
    assert all(r["log_metric_counts"] == dict.fromkeys(("curriculum/step", "curriculum/max_steps",
                                                        "curriculum/epoch"), 1) for r in steps)


def test_chapter_04s_ranks_call_every_kind_of_trl_reward_and_average_what_they_log(tmp_path):
    steps = [r for r in run("04_fsdp_lora.py", tmp_path, "--nproc-per-node", "2", "--eval-every", "0")
             if "reward" in r]
    check_records(steps, 9000)
    assert all(r["log_metric_counts"]["curriculum/step"] == 2 for r in steps), "one value per rank, averaged"


def test_chapter_07_calls_every_kind_of_trl_reward_in_its_sessions(tmp_path):
    from minirl.tasks.task import arithmetic_task

    rows = arithmetic_task().train[:32]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = run("07_async.py", tmp_path, "--dataset", tmp_path / "rows.jsonl", "--producers", "2",
                "--max-staleness", "0", "--print-every", "1")
    check_records(steps, len(rows))
    assert all(r["log_metric_counts"]["curriculum/step"] == r["trajectories"] for r in steps), "one per session"


# ---- the parts ------------------------------------------------------------------------------------------------


def test_the_trainer_state_is_trls():
    from transformers import TrainerState

    clock = TrainerClock.of(RLConfig.from_flat(steps=10, prompts_per_step=4, num_generations=2, eval_every=5,
                                               checkpoint_every=0), num_rows=20)
    state = clock.state(3)
    assert isinstance(state, TrainerState)
    assert (state.global_step, state.max_steps, state.epoch, state.num_train_epochs) == (3, 10, 0.6, 2)
    assert (state.eval_steps, state.train_batch_size, state.is_world_process_zero) == (5, 8, True)


def test_extras_of_a_batch_and_what_they_log():
    rollout = SimpleNamespace(completion_ids=torch.tensor([[5, 6, 2, 0], [7, 2, 0, 0]]),
                              completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    extras = RewardExtras(rollout, trainer_state="state")
    assert extras["completion_ids"] == [[5, 6, 2], [7, 2]] and extras["trainer_state"] == "state"
    assert extras.metrics() == {}
    extras["log_metric"]("a", 1)
    extras["log_metric"]("a", 2.0)
    extras["log_extra"]("note", ["x", "y"])
    assert extras.metrics() == {"a": 1.5, "log_metric_counts": {"a": 2}}
    assert extras.log.columns == {"note": ["x", "y"]}
    with pytest.raises(ValueError, match="log_metric\\('a', 'high'\\): the value must be a number"):
        extras["log_metric"]("a", "high")


def test_reward_workers_get_their_rows_and_hand_back_their_logs_in_order():
    """Stage 6's round trip, without Ray: each part's rows and ids, the async function awaited on the worker,
    what it logged handed to the driver's log_metric / log_extra in row order (a part without a column: None)."""
    async def scored(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, answer):
        log_metric("n", len(completions))
        if answer[0] == 1:
            log_extra("seen", answer)
        return [float(len(ids) + trainer_state.global_step) for ids in completion_ids]

    metrics, columns = [], []
    sent = {"answer": [1, 2, 3], "completion_ids": [[1], [1, 2], [1, 2, 3]], "trainer_state": SimpleNamespace(
        global_step=10), "log_metric": lambda n, v: metrics.append((n, v)),
        "log_extra": lambda c, v: columns.append((c, v))}
    parts = [worker_rewards(scored, ["p"] * (b - a), ["c"] * (b - a), remote_rows(sent, a, b))
             for a, b in ((0, 1), (1, 3))]
    assert "log_metric" not in remote_rows(sent, 0, 1) and remote_rows(sent, 1, 3)["completion_ids"] == [[1, 2],
                                                                                                         [1, 2, 3]]
    assert joined_rewards(parts, sent) == [11.0, 12.0, 13.0]
    assert metrics == [("n", 1), ("n", 2)] and columns == [("seen", [1, None, None])]


def test_ranks_average_logged_metrics_over_every_value_and_skip_a_rank_without_rewards():
    records = [{"rewards/f": 1.0, "m": 2.0, "log_metric_counts": {"m": 1}, "reward_errors": 0},
               {"rewards/f": math.nan, "m": 5.0, "other": 1.0, "log_metric_counts": {"m": 3, "other": 1},
                "reward_errors": 1}]
    group = SimpleNamespace(gather_objects=lambda local: [
        {k: v for k, v in r.items() if k.startswith(("time/", "rewards/")) or k in r.get("log_metric_counts", {})
         or k in ("reward_errors", "log_metric_counts")} for r in records])
    out = rank_records(records[0], group)
    assert out["rewards/f"] == 1.0 and out["m"] == pytest.approx((2 + 15) / 4) and out["other"] == 1.0
    assert out["log_metric_counts"] == {"m": 4, "other": 1} and out["reward_errors"] == 1


def test_a_reward_that_requires_an_extra_is_not_a_missing_column():
    def soft_overlong(completion_ids, trainer_state, **kwargs):
        return [0.0] * len(completion_ids)

    check_reward_columns([soft_overlong], [{"prompt": "1+1=", "answer": 2}])


def test_a_failing_sample_scores_zero_and_the_others_keep_their_own_ids():
    """reward_errors="zero" scores one sample at a time after a failure: each gets its own completion_ids."""
    from minirl.train.step import score

    rollout = SimpleNamespace(prompts=["1+1="] * 2, completions=["2", "22"], num_generations=2,
                              completion_ids=torch.tensor([[5, 2, 0], [5, 5, 2]]),
                              completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))

    def by_ids(completions, completion_ids, log_metric, **kwargs):
        assert len(completion_ids) == len(completions)
        if any(len(ids) == 3 for ids in completion_ids):
            raise ValueError("too long")
        log_metric("scored", len(completion_ids))
        return [float(len(ids)) for ids in completion_ids]

    total, metrics = score([by_ids], rollout, [{"prompt": "1+1=", "answer": 2}], "zero")
    assert total.tolist() == [2.0, 0.0] and metrics["reward_errors"] == 1
    assert metrics["scored"] == 1.0 and metrics["log_metric_counts"] == {"scored": 1}
