# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""The asynchronous trainer's step: a batch from the queue, stage 1's `learn` and `sync_and_record`.

`minirl/runtime/async_run.py` runs it under stage 1's run loop (`train_async`).
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
    trajectories = state.take_batch()              # the wait here is the trainer's idle time
    began = time.perf_counter()
    roles, timer = state.roles, StageTimer()
    rollout, rewards = batch_of(trajectories)
    health = batch_health(trajectories, rollout, roles.version)     # staleness, env failures
    metrics = learn(roles, rollout, rewards, state.config, timer=timer, correct=state.correct)
    record = sync_and_record(roles, state.engine, state.sync, rollout, rewards, metrics, timer)
    state.queue.advance(roles.version)             # admission and the gate move to the new version
    state.gate.advance(roles.version)
    return state.finish_step(record | health, waited, began)   # time/wait, queue stats, timeline
