# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The asynchronous trainer's step: a batch from the queue, stage 1's `learn` and `sync_and_record`.

`train_async` (`minirl/runtime/async_run.py`) hands `trainer_step` to stage 1's run loop and
starts the producers; at max_staleness = 0 it is synchronous RL with concurrent sessions.
"""

__all__ = ["batch_of", "trainer_step"]

import dataclasses
import time

import torch

from minirl.asyncrl.queue import Trajectory
from minirl.data import Batch
from minirl.runtime.async_bookkeeping import batch_health
from minirl.runtime.timing import StageTimer
from minirl.train.step import learn, sync_and_record


def batch_of(trajectories: list[Trajectory]):
    """(rollout, rewards) of a batch: the trajectories' rows in ticket order (so that the rows
    never depend on which session ended first), version = the oldest."""
    ordered = sorted(trajectories, key=lambda t: t.ticket)
    oldest = min(t.version for t in ordered)
    rollout = Batch.concat([dataclasses.replace(t.rollout, version=oldest) for t in ordered])
    return rollout, torch.cat([t.rewards for t in ordered])                    # rewards [N]


def trainer_step(state) -> dict:
    """One step of an AsyncState's trainer: the next admissible batch from the queue, notebook
    01's `learn` on it, the weights published as the next version."""
    waited = time.perf_counter()
    try:
        trajectories = state.queue.get_batch(timeout=state.batch_timeout)
    except RuntimeError:
        if state.errors:                             # a producer failed: raise its error
            raise state.errors[0] from None
        raise
    began = time.perf_counter()
    state.timeline.add("trainer", "wait", waited, began)
    roles, timer = state.roles, StageTimer()
    rollout, rewards = batch_of(trajectories)
    health = batch_health(trajectories, rollout, roles.version)     # staleness, env failures
    metrics = learn(roles, rollout, rewards, state.config, timer=timer, correct=state.correct)
    if state.correct.weight_mean is not None:
        metrics["correction/weight_mean"] = state.correct.weight_mean
    record = sync_and_record(roles, state.engine, state.sync, rollout, rewards, metrics, timer)
    state.queue.advance(roles.version)
    state.gate.advance(roles.version)
    state.last = end = time.perf_counter()
    state.timeline.add("trainer", "train", began, end)
    state.samples += len(rewards)
    return (record | health | {"time/wait": began - waited, "wall": state.wall(end),
                               "samples": state.samples} | state.queue.stats(end))
