# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""Stage 7's settings: `AsyncConfig`, what stage 7 adds to RLConfig, and the names its checks use.

Light on purpose (no torch, no model code): chapter 07 builds its flags from AsyncConfig and
refuses a bad command line before anything heavy is imported. The corrections' names are
here (`asyncrl/corrections.py` implements them); the environment it makes by default is the
calculator tool of `asyncrl/env.py`, imported when the factory is made.
"""

__all__ = ["CORRECTIONS", "AREAL_WEIGHTS", "ASYNC_SAFE_ON_RESUME", "AsyncConfig"]

from dataclasses import dataclass
from functools import partial

from minirl.runtime.validate import check_choice, check_float, check_int

CORRECTIONS = ("none", "areal", "tis")
AREAL_WEIGHTS = ("clip", "cap")


ASYNC_SAFE_ON_RESUME = ("snapshot_every",)        # the AsyncConfig settings a resume may change


@dataclass
class AsyncConfig:
    """What stage 7 adds to RLConfig: the staleness bound, the correction, producers and environment."""

    choices = {"correction": CORRECTIONS, "areal_weight": AREAL_WEIGHTS}      # for the chapter's flags

    max_staleness: int = 1             # eta: a trajectory may be at most this many versions behind the trainer
    correction: str = "none"           # none (LlamaRL), areal (decoupled objective), tis (truncated IS, notebook 02)
    areal_weight: str = "clip"         # areal's behaviour weight: clip to [0.8, 1.2] (the source) or cap (AReaL's code)
    producers: int = 4                 # producer threads (or slots on the Ray actors)
    prompts_per_call: int = 4          # prompts a producer samples in one engine call (their groups are queued apart)
    queue_capacity: int | None = None  # trajectories the queue holds; None: (max_staleness + 1) * prompts_per_step
    env_latency: float = 0.01          # the calculator tool's median latency, seconds (lognormal)
    env_latency_sigma: float = 1.5     # the lognormal's sigma: the tail's weight (0: every call takes the median)
    env_timeout: float = 5.0           # seconds a session may take before it is scored 0 as hung
    max_turns: int = 1                 # 1: one answer per episode; more: the environment asks again when wrong
    in_flight: bool = False            # producers pick up new weights between decoding steps (shared_prefix engine)
    ray: bool = False                  # producers are Ray actors (needs a Ray cluster: runtime.ray_start.connect)
    ray_actors: int = 2                # Ray actors sharing the producer slots
    snapshot_every: int = 10           # weights kept for the held-out evaluation every N steps (and at the end)

    def __post_init__(self):
        check_int("max_staleness", self.max_staleness, low=0)
        check_choice("correction", self.correction, CORRECTIONS)
        check_choice("areal_weight", self.areal_weight, AREAL_WEIGHTS)
        check_int("producers", self.producers, low=1)
        check_int("prompts_per_call", self.prompts_per_call, low=1)
        if self.queue_capacity is not None:
            check_int("queue_capacity", self.queue_capacity, low=1)
        check_float("env_latency", self.env_latency, low=0.0)             # the checks of env.Latency
        check_float("env_latency_sigma", self.env_latency_sigma, low=0.0)
        check_float("env_timeout", self.env_timeout, low=0.0, low_open=True)
        check_int("max_turns", self.max_turns, low=1)
        check_int("ray_actors", self.ray_actors, low=1)
        check_int("snapshot_every", self.snapshot_every, low=1)

    def capacity(self, batch_size: int) -> int:
        return self.queue_capacity if self.queue_capacity is not None else (self.max_staleness + 1) * batch_size

    def make_env(self):
        """A picklable factory of fresh environments (one per session): the embedded task's calculator tool."""
        from minirl.asyncrl.env import ArithmeticToolEnv, Latency  # noqa: PLC0415 (torch: only when a run starts)

        return partial(ArithmeticToolEnv, Latency(self.env_latency, self.env_latency_sigma), self.max_turns)
