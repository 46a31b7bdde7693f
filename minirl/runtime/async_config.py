"""Stage 7's settings and their checks: `AsyncConfig`, what stage 7 adds to RLConfig.

Light on purpose (no torch, no model code): chapter 07 builds its flags from AsyncConfig and
refuses a bad command line before anything heavy is imported. Here too: the corrections'
names (`asyncrl/corrections.py` implements them), `check_correction` (which correction a run
applies; AReaL's weight together with stage 1's truncated-IS switch is refused by name),
`check_async` (the checks across RLConfig and AsyncConfig, before anything is built) and
`check_resume_async` (a resume with settings that change what the run computes is refused;
only those in ASYNC_SAFE_ON_RESUME may change). The environment AsyncConfig makes by default
is the calculator tool of `asyncrl/env.py`, imported when the factory is made.
"""

import dataclasses
from dataclasses import dataclass
from functools import partial

from minirl.runtime.validate import ConfigError, check_choice, check_float, check_int

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
        from minirl.asyncrl.env import ArithmeticToolEnv  # noqa: PLC0415 (torch: only when a run starts)
        from minirl.runtime.async_envs import Latency  # noqa: PLC0415

        return partial(ArithmeticToolEnv, Latency(self.env_latency, self.env_latency_sigma), self.max_turns)


def check_correction(correction: str, algorithm) -> str:
    """The correction a run applies: `correction`, or "tis" when it is "none" and the algorithm (an
    AlgorithmConfig) turns truncated IS on. Raises ConfigError naming importance_sampling_correction for
    "areal" with it on."""
    check_choice("correction", correction, CORRECTIONS)
    if correction == "areal" and algorithm.importance_sampling_correction:
        raise ConfigError("importance_sampling_correction", True,
                          "--correction areal weights each token by AReaL's behaviour weight where truncated IS "
                          "would go; drop --importance-sampling-correction, or pass --correction tis")
    return "tis" if algorithm.importance_sampling_correction else correction


def check_async(config, acfg: AsyncConfig) -> None:
    """The checks across an RLConfig and an AsyncConfig, before anything is built: ConfigError naming the setting."""
    check_correction(acfg.correction, config.algorithm)
    if acfg.capacity(config.run.prompts_per_step) < config.run.prompts_per_step:
        raise ConfigError("queue_capacity", acfg.queue_capacity, "the queue must hold at least one batch of "
                          f"--prompts-per-step {config.run.prompts_per_step} trajectories; raise it, or leave it "
                          "unset")
    if acfg.in_flight and acfg.ray:
        raise ConfigError("in_flight", True, "in-flight updates run in local producer threads only; "
                          "drop --in-flight with --ray")
    if acfg.in_flight and config.rollout.rollout_engine != "shared_prefix":
        raise ConfigError("in_flight", True, "in-flight updates run the shared-prefix engine's decoding loop; "
                          f"pass --rollout-engine shared_prefix (not {config.rollout.rollout_engine})")


def check_resume_async(saved: dict | None, acfg: AsyncConfig) -> None:
    """Refuse to resume with AsyncConfig settings that change what the run computes (ConfigError naming the first)."""
    now = dataclasses.asdict(acfg)
    if saved is None:
        raise ConfigError("resume", True, "the run directory holds no asynchronous run (its run.json has no "
                          "'async' settings); resume it with the script that started it")
    changed = [k for k in now if k not in ASYNC_SAFE_ON_RESUME and saved.get(k) != now[k]]
    if changed:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise ConfigError(changed[0], now[changed[0]], f"the run was started with other settings ({diffs}); resume "
                          f"with the run's own settings (only {', '.join(ASYNC_SAFE_ON_RESUME)} may change), or "
                          "start a new run")


def check_queue_sizes(batch_size: int, max_staleness: int, capacity: int | None = None) -> None:
    """The sizes of a start gate or an experience queue: ConfigError naming the setting unless batch_size >= 1,
    max_staleness >= 0 and (when given) capacity >= batch_size (else the trainer could never take a batch)."""
    check_int("batch_size", batch_size, low=1)
    check_int("max_staleness", max_staleness, low=0)
    if capacity is not None:
        check_int("queue_capacity", capacity)
        if capacity < batch_size:
            raise ConfigError("queue_capacity", capacity, f"the queue must hold at least one batch of {batch_size} "
                              "trajectories (prompts_per_step)")
