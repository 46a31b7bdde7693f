# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Environments in the AgentRL style: a multi-turn tool task, isolated sessions with timeouts.

The simulated tool, the checks of what an environment returns and any task as an environment
are in `minirl/runtime/async_envs.py`. Simplified vs AgentRL: sessions are threads, not
containers (a hung thread is abandoned, not killed).
"""

__all__ = ["ArithmeticToolEnv", "SessionResult", "run_session", "run_sessions"]

import random
import threading
import time
from dataclasses import dataclass

from minirl.runtime.async_envs import EnvError, Latency, calculator, check_step
from minirl.runtime.validate import check_int
from minirl.tasks.arithmetic import parse_answer


class ArithmeticToolEnv:
    """The arithmetic task as an environment: the policy answers, the calculator tool checks.

    A correct answer ends the episode with reward 1 / turn; a wrong one asks the same question
    again until max_turns, then ends it with reward 0. max_turns = 1 is the single-turn task
    (with a slow verifier).
    """

    def __init__(self, latency: Latency = Latency(), max_turns: int = 1,
                 reverse_answer: bool = True):
        check_int("max_turns", max_turns, low=1)
        self.latency, self.max_turns, self.reverse = latency, max_turns, reverse_answer
        self.prompt, self.turn, self.rng = None, 0, None

    def reset(self, row: dict, rng: random.Random) -> str:
        self.prompt, self.turn, self.rng = row["prompt"], 0, rng
        return self.prompt

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        value = calculator(self.prompt, self.latency, self.rng)     # the tool call: long-tailed
        if parse_answer(action, self.reverse) == value:
            return None, 1.0 / self.turn, True
        if self.turn >= self.max_turns:
            return None, 0.0, True
        return self.prompt, 0.0, False                               # try again


@dataclass
class SessionResult:
    """What one session gave: its reward (0 on failure), turns, seconds, the error's text if any."""

    reward: float
    turns: int
    seconds: float
    error: str | None = None
    timed_out: bool = False
    scores: dict | None = None    # {reward function: value} from an environment that keeps them


def run_session(make_env, row: dict, action: str, policy, seed: int,
                max_turns: int) -> SessionResult:
    """One episode in the calling thread: reset, step with `action`, then with
    policy(observation) per later turn."""
    start = time.perf_counter()
    env = make_env()                                  # a fresh environment: sessions share nothing
    observation = env.reset(row, random.Random(seed))
    if not isinstance(observation, str):
        raise EnvError(f"reset returned {observation!r}; the first observation must be a string")
    reward, turn = 0.0, 0
    for turn in range(1, max_turns + 1):  # noqa: B007 (the turn it stopped at is read after)
        observation, reward, done = check_step(env.step(action))
        if done:
            break
        action = policy(observation)                  # a later turn: the policy answers again
    return SessionResult(reward, turn, time.perf_counter() - start,
                         scores=getattr(env, "scores", None) or None)


def run_sessions(make_env, row: dict, actions: list[str], policy, seeds: list[int],
                 timeout: float, max_turns: int = 1) -> list[SessionResult]:
    """One isolated session per action, all at once, each in its own daemon thread, each given
    `timeout` s. A session that raises or returns junk gives SessionResult(0, ..., error=...);
    one still running at its deadline gives timed_out=True (its thread is abandoned).
    make_env: one factory for all, or a list of one per session."""
    results: list[SessionResult | None] = [None] * len(actions)
    start, makers = time.perf_counter(), make_env if isinstance(make_env, list) else [make_env] * len(actions)

    def body(i: int) -> None:
        try:
            results[i] = run_session(makers[i], row, actions[i], policy, seeds[i], max_turns)
        except Exception as err:  # an environment's failure is data: scored 0 and counted
            results[i] = SessionResult(0.0, 0, time.perf_counter() - start,
                                       f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"env-session-{i}")
               for i in range(len(actions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + timeout - time.perf_counter()))
    final = list(results)                      # a late finisher no longer changes the answer
    hung = f"EnvError: timeout: the session ran past {timeout} s"
    return [r if r is not None else SessionResult(0.0, 0, timeout, hung, timed_out=True)
            for r in final]
