# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Environments in the AgentRL style: multi-turn sessions, a slow calculator tool, isolation, timeouts.

An environment has `reset(row, rng) -> observation` and `step(action) -> (observation,
reward, done)`. `run_sessions` runs one session per completion, each in its own daemon
thread with a fresh environment and a deadline: a session that raises, hangs or returns
something malformed becomes a `SessionResult` with reward 0 and the error's text, so a bad
environment is counted and scored, never a stopped run.

Simplified vs AgentRL: sessions are threads in the producer's process, not containers
(a hung thread is abandoned, not killed); the tool is simulated latency around exact
arithmetic; later turns are sampled by the policy but not trained on.
"""

__all__ = ["EnvError", "Latency", "EXPRESSION", "calculator", "ArithmeticToolEnv", "RewardEnv",
           "SessionResult", "check_step", "run_session", "run_sessions"]

import math
import random
import re
import threading
import time
from dataclasses import dataclass

import torch

from minirl.runtime.validate import check_float, check_int
from minirl.tasks.arithmetic import OPERATORS, parse_answer
from minirl.tasks.rewards import combine_rewards, reward_name


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


class ArithmeticToolEnv:
    """The arithmetic task as an environment: the policy answers, the calculator tool checks.

    A correct answer ends the episode with reward 1 / turn; a wrong one asks the same question
    again until max_turns, then ends it with reward 0. max_turns = 1 is the single-turn task
    (with a slow verifier).
    """

    def __init__(self, latency: Latency = Latency(), max_turns: int = 1, reverse_answer: bool = True):
        check_int("max_turns", max_turns, low=1)
        self.latency, self.max_turns, self.reverse = latency, max_turns, reverse_answer
        self.prompt, self.turn, self.rng = None, 0, None

    def reset(self, row: dict, rng: random.Random) -> str:
        self.prompt, self.turn, self.rng = row["prompt"], 0, rng
        return self.prompt

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        value = calculator(self.prompt, self.latency, self.rng)          # the tool call (slow, long-tailed)
        if parse_answer(action, self.reverse) == value:
            return None, 1.0 / self.turn, True
        if self.turn >= self.max_turns:
            return None, 0.0, True
        return self.prompt, 0.0, False                                    # try again


class RewardEnv:
    """Any task as a single-turn environment: its reward functions score the completion.

    reward_funcs: TRL-style f(prompts, completions, **columns); weights: one per function (None:
    1 each). `step(action)` calls each function on this one completion with the row's other
    columns (lists of one), ends the episode with their weighted sum (stage 1's
    `combine_rewards`) and keeps each function's value in `scores` ({name: value}: the record's
    `rewards/<name>`). Stage 1 calls each function once per batch; here each session scores
    its own completion, so a reward that raises, hangs or returns junk costs one session (scored
    0 and counted as an environment failure), not the run.
    """

    def __init__(self, reward_funcs, weights=None):
        self.funcs = list(reward_funcs)
        self.weights = [1.0] * len(self.funcs) if weights is None else list(weights)
        self.names = [reward_name(f) for f in self.funcs]
        self.row, self.scores = None, {}

    def reset(self, row: dict, rng: random.Random) -> str:
        self.row, self.scores = row, {}
        return row["prompt"]

    def step(self, action: str) -> tuple[None, float, bool]:
        columns = {k: [v] for k, v in self.row.items() if k != "prompt"}
        values = []
        for func, name in zip(self.funcs, self.names, strict=True):
            out = list(func(prompts=[self.row["prompt"]], completions=[action], **columns))
            if len(out) != 1 or isinstance(out[0], (str, bytes)):
                raise EnvError(f"reward function {name} returned {out!r} for one completion; return one float")
            values.append(float(out[0]))
        total, _ = combine_rewards(torch.tensor([values], dtype=torch.float64), self.weights, self.names)
        self.scores = dict(zip(self.names, values, strict=True))
        return None, total.item(), True


@dataclass
class SessionResult:
    """What one session gave: its reward (0 on failure), turns, seconds, and the error's text if it failed."""

    reward: float
    turns: int
    seconds: float
    error: str | None = None
    timed_out: bool = False
    scores: dict | None = None         # {reward function: value} from an environment that keeps them (RewardEnv)


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


def run_session(make_env, row: dict, action: str, policy, seed: int, max_turns: int) -> SessionResult:
    """One episode in the calling thread: reset, then step with `action`, then with policy(observation) per turn."""
    start = time.perf_counter()
    env = make_env()                                       # a fresh environment: sessions share nothing
    observation = env.reset(row, random.Random(seed))
    if not isinstance(observation, str):
        raise EnvError(f"reset returned {observation!r}; the first observation must be a string (the prompt)")
    reward, turn = 0.0, 0
    for turn in range(1, max_turns + 1):  # noqa: B007 (the turn it stopped at is read after the loop)
        observation, reward, done = check_step(env.step(action))
        if done:
            break
        action = policy(observation)                       # a later turn: the policy answers again
    return SessionResult(reward, turn, time.perf_counter() - start, scores=getattr(env, "scores", None) or None)


def run_sessions(make_env, row: dict, actions: list[str], policy, seeds: list[int], timeout: float,
                 max_turns: int = 1) -> list[SessionResult]:
    """One isolated session per action, all at once, each in its own daemon thread, each given `timeout` s.

    A session that raises or returns junk gives SessionResult(0, ..., error=...); one still
    running at its deadline gives error "timeout" and timed_out=True (its thread is abandoned).
    """
    results: list[SessionResult | None] = [None] * len(actions)
    start = time.perf_counter()

    def body(i: int) -> None:
        try:
            results[i] = run_session(make_env, row, actions[i], policy, seeds[i], max_turns)
        except Exception as err:  # an environment's failure is data: scored 0 and counted
            results[i] = SessionResult(0.0, 0, time.perf_counter() - start, f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"env-session-{i}")
               for i in range(len(actions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + timeout - time.perf_counter()))
    final = list(results)                                  # a late finisher no longer changes the answer
    return [r if r is not None else
            SessionResult(0.0, 0, timeout, f"EnvError: timeout: the session ran past {timeout} s", timed_out=True)
            for r in final]
