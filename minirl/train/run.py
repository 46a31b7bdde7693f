"""A run: build the roles, the engine and the sync; then step, and hand each record to callbacks.

`run(state, step_fn, callbacks, steps)` is the whole loop: it calls the step and passes each
record to the callbacks, which do everything else a run needs (evaluate, log JSON lines,
checkpoint, show progress, stop early: `minirl.runtime.callbacks`). `train()` assembles the
stage-1 run from a config and a policy; later stages reuse `run` and the callbacks with their
own step functions. Simplified vs TRL's Trainer: no learning-rate schedule, no launcher.

Hand-written beside its concept: notebook 01 builds the step (`minirl.train.step.rl_step`) and
uses this loop around it. `build_roles` makes the roles a config asks for (a reference when
beta > 0, a critic for PPO); `setup` the state of a fresh stage-1 run; `stage1_step` draws the
step's prompts and calls `rl_step`.
"""

__all__ = ["build_roles", "RunState", "Callback", "RunStopped", "run", "setup", "stage1_step",
           "train"]

import time
from dataclasses import dataclass, field

import torch

from minirl.config import RLConfig
from minirl.models.critic import ValueModel
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.registry import build_engine
from minirl.runtime.inputs import run_inputs
from minirl.runtime.model_loading import disable_dropout
from minirl.sync.base import InProcessSync
from minirl.tasks.task import Task
from minirl.train.step import Roles, rl_step, sample_prompts


def build_roles(config: RLConfig, model) -> Roles:
    """Actor (always), Reference (when beta > 0), Critic (PPO) for `model`, on config.run.device in
    config.policy_dtype (a no-op for the float32 policy on a CPU)."""
    dtype = getattr(torch, config.policy_dtype)
    model.to(device=config.run.device, dtype=dtype).eval()
    if config.run.disable_dropout:
        disable_dropout(model)
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    critic = None
    if config.algorithm.algo == "ppo":
        critic = Critic(ValueModel.from_policy(model).to(dtype), config.algorithm, config.optimizer)
    return Roles(Actor(model, config.algorithm, config.optimizer, config.sampling), reference, critic)


@dataclass
class RunState:
    """Everything a run changes, and what a checkpoint restores."""

    config: RLConfig
    roles: Roles
    engine: object                          # a RolloutEngine
    sync: object                            # a WeightSync
    generator: torch.Generator              # draws the prompts and the sampling seeds
    rows: list[dict]                        # the dataset
    reward_funcs: list
    reward_weights: list[float] | None = None   # one per reward function (None: 1 each)
    step: int = 0
    metrics: list[dict] = field(default_factory=list)
    interrupted: bool = False

    @property
    def trainer_state(self):
        """TRL's `trainer_state` for the reward functions of the next step (`minirl.runtime.reward_extras`)."""
        from minirl.runtime.reward_extras import trainer_state  # noqa: PLC0415 (transformers: when a run scores)

        return trainer_state(self)

    def extra_state(self) -> dict:
        """What a later stage adds to a checkpoint ({} here; notebook 07 saves its queue)."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        """Restore what `extra_state` returned (nothing here)."""


class Callback:
    """Hooks of a run; each does one job. on_end runs last, also after an error (see state.interrupted)."""

    def on_start(self, state: RunState) -> None: ...

    def on_step(self, state: RunState, record: dict) -> None: ...

    def on_end(self, state: RunState) -> None: ...


class RunStopped(Exception):
    """Raised by `minirl.runtime.callbacks.StopAfter`: the run stopped on purpose before its last step."""


def run(state: RunState, step_fn, callbacks: list[Callback], steps: int) -> list[dict]:
    """Call step_fn(state) until `steps` steps are done; each record goes through every callback in order."""
    for cb in callbacks:
        cb.on_start(state)
    try:
        while state.step < steps:
            start = time.perf_counter()
            record = step_fn(state)
            state.step += 1
            record = {"step": state.step, **record, "time/step": time.perf_counter() - start}
            state.metrics.append(record)
            for cb in callbacks:
                cb.on_step(state, record)
    except BaseException:
        state.interrupted = True
        raise
    finally:
        for cb in callbacks:
            cb.on_end(state)
    return state.metrics


def setup(config: RLConfig, model, tokenizer, rows: list[dict], reward_funcs: list,
          reward_weights: list[float] | None = None) -> RunState:
    """The state of a fresh run: roles, an engine holding version 0, an in-process sync, the generator."""
    roles = build_roles(config, model)
    return RunState(config, roles, build_engine(config, model, tokenizer), InProcessSync(),
                    torch.Generator().manual_seed(config.run.seed), rows, reward_funcs, reward_weights)


def stage1_step(state: RunState) -> dict:
    """Stage 1's step: draw this step's prompts, then `rl_step`."""
    rows = sample_prompts(state.rows, state.config.run.prompts_per_step, state.generator)
    return rl_step(state.roles, state.engine, state.sync, rows, state.reward_funcs, state.config, state.generator,
                   reward_weights=state.reward_weights, trainer_state=state.trainer_state)


def train(config: RLConfig, model=None, tokenizer=None, task: Task | None = None, *, out_dir=None,
          resume: bool = False, overwrite: bool = False, progress: bool = True, reward_funcs=None,
          reward_weights=None, dataset=None, eval_fn=None, stop_after: int | None = None,
          extra_callbacks: tuple = (), run_info: dict | None = None) -> list[dict]:
    """The stage-1 run: `config.run.steps` steps of `rl_step`; returns one record per step (and per evaluation).

    model, tokenizer, task (default: the embedded policy and arithmetic task), dataset, reward_funcs,
    reward_weights, eval_fn: as `minirl.runtime.inputs.run_inputs`; the other arguments: as
    `minirl.runtime.callbacks.run_in_dir` (a run directory, resumable; RunStopped after step k).
    """
    from minirl.runtime.callbacks import run_in_dir  # noqa: PLC0415 (it imports this module)

    model, tokenizer, rows, reward_funcs, reward_weights, eval_fn = run_inputs(
        config, model, tokenizer, task, dataset, reward_funcs, reward_weights, eval_fn, progress)
    state = setup(config, model, tokenizer, rows, list(reward_funcs), reward_weights)
    return run_in_dir(state, stage1_step, tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite,
                      eval_fn=eval_fn, progress=progress, label="stage 1", extra_callbacks=extra_callbacks,
                      stop_after=stop_after, run_info=run_info)
