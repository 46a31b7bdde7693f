"""Environment plumbing of stage 7: the simulated tool, the checks of what an environment returns, any task.

Notebook 07 builds the environments that teach (`asyncrl/env.py`: the multi-turn calculator
task, isolated sessions with timeouts); this module holds what they lean on:

- `Latency` and `calculator`: the simulated tool. It evaluates "a+b" ("-" and "*" too) after
  sleeping a latency drawn, seeded, from a lognormal distribution (by default a median of
  10 ms, and one call in a hundred slower than about a third of a second): the long tail that
  makes a synchronous step wait for its slowest trajectory;
- `EnvError`: an environment returned something malformed, or timed out;
- `check_step`: an environment's `step` output checked to be (observation, reward, done),
  each of the right kind, or EnvError naming what is wrong (a session that fails it is scored
  0 and counted, never a stopped run);
- `RewardEnv`: any stage-1 task's reward functions as a one-step environment, so that every
  task runs under the asynchronous runner (chapter 07's --dataset and --reward).
"""

import math
import random
import re
import time
from dataclasses import dataclass

import torch

from minirl.runtime.validate import check_float
from minirl.tasks.arithmetic import OPERATORS
from minirl.tasks.rewards import RewardError, call_reward, combine_rewards, reward_name


class EnvError(RuntimeError):
    """An environment returned something malformed, or timed out."""


@dataclass(frozen=True)
class Latency:
    """A tool call's latency: lognormal, median * exp(sigma * N(0, 1)) seconds, at most max_seconds."""

    median: float = 0.01
    sigma: float = 1.5
    max_seconds: float = 10.0

    def __post_init__(self):
        check_float("env_latency", self.median, low=0.0)
        check_float("env_latency_sigma", self.sigma, low=0.0)
        check_float("max_seconds", self.max_seconds, low=0.0)

    def draw(self, rng: random.Random) -> float:
        if self.median == 0:
            return 0.0
        return min(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.max_seconds)


EXPRESSION = re.compile(r"\s*(\d+)\s*([+\-*])\s*(\d+)\s*=?\s*")


def calculator(expression: str, latency: Latency, rng: random.Random) -> int:
    """The tool: the value of "a+b" ("-" and "*" too), after sleeping a latency drawn with `rng`."""
    time.sleep(latency.draw(rng))
    match = EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"calculator: cannot evaluate {expression!r}; it takes 'a+b', 'a-b' or 'a*b'")
    return OPERATORS[match[2]](int(match[1]), int(match[3]))


def check_step(out) -> tuple[str | None, float, bool]:
    """An environment's step output as (observation, reward, done), or EnvError naming what is wrong."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise EnvError(f"step returned {out!r}; an environment must return (observation, reward, done)")
    observation, reward, done = out
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"step returned reward {reward!r}; it must be a finite number")
    if not isinstance(done, bool):
        raise EnvError(f"step returned done={done!r}; it must be True or False")
    if not done and not isinstance(observation, str):
        raise EnvError(f"step returned observation {observation!r} with done=False; the next turn needs a string")
    return observation, float(reward), done


class RewardEnv:
    """Any task as a single-turn environment: its reward functions score the completion.

    reward_funcs: TRL-style f(prompts, completions, **columns); weights: one per function (None:
    1 each). `step(action)` calls each function on this one completion with the row's other
    columns (lists of one), ends the episode with their weighted sum (stage 1's
    `combine_rewards`) and keeps each function's value in `scores` ({name: value}: the record's
    `rewards/<name>`). Stage 1 calls each function once per batch; here each session scores
    its own completion, so a reward that raises, hangs or returns junk costs one session (scored
    0 and counted as an environment failure), not the run. reward_extras: TRL's extras for this
    session's completion (`minirl.runtime.reward_extras.session_extras`: its completion_ids, the
    trainer state, log_metric, log_extra), passed to every function; `score_group` gives them.
    """

    def __init__(self, reward_funcs, weights=None, reward_extras: dict | None = None):
        self.funcs, self.extras = list(reward_funcs), dict(reward_extras or {})
        self.weights = [1.0] * len(self.funcs) if weights is None else list(weights)
        self.names = [reward_name(f) for f in self.funcs]
        self.row, self.scores = None, {}

    def reset(self, row: dict, rng: random.Random) -> str:
        self.row, self.scores = row, {}
        return row["prompt"]

    def step(self, action: str) -> tuple[None, float, bool]:
        columns = {k: [v] for k, v in self.row.items() if k != "prompt"}
        values = []
        for func in self.funcs:          # as TRL calls it; a bad output names the function and the prompt
            try:
                values += call_reward(func, [self.row["prompt"]], [action], columns, **self.extras)
            except RewardError as err:
                raise EnvError(str(err)) from None
        values = [math.nan if v is None else v for v in values]            # None: does not apply (TRL)
        total, _ = combine_rewards(torch.tensor([values], dtype=torch.float64), self.weights, self.names)
        self.scores = dict(zip(self.names, values, strict=True))
        return None, total.item(), True
