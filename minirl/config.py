"""The configuration of an RL run, by concern: algorithm, sampling, rollout, optimizer, run.

Leaf names follow TRL's `GRPOConfig` where the concept is the same (`num_generations`,
`beta`, `epsilon`, `loss_type`, `max_completion_length`, ...), so a TRL user finds them
where they expect, and every leaf name is unique across the groups, so that a chapter
script can turn each one into a flag (`--learning-rate`) and `RLConfig.replace(beta=0.04)`
knows where it goes. Every group checks its values when it is built: a bad setting fails
before any work is done, with an error naming the field, the value and the fix.

Simplified vs TRL: one optimizer step per generation batch and iteration (its micro-batches
accumulate gradients, as TRL's `gradient_accumulation_steps` do, but are sized by tokens,
`max_tokens_per_microbatch`, rather than by rows), no learning-rate schedule; rewards are
weighted as TRL's `reward_weights`.

Precision, as TRL trains: the trained weights and AdamW's state are float32 on every device
(`dtype` "auto"), and `mixed_precision` (accelerate's name and values: auto, no, bf16, fp16;
auto is bf16 on a CUDA device and no on the CPU) runs each step's forward passes under
autocast, so the tensor cores do the products while every update lands on float32 weights.
Pure bfloat16 (`dtype` "bfloat16": weights, gradients and AdamW's state) is taken only when
asked, with a warning: at RL learning rates most of its updates round away (one AdamW step at lr
1e-6 changed 1.4 % of the embedded policy's parameters in bfloat16, all of them in float32).
`rollout_dtype` is the rollout copy's ("auto": bfloat16 on CUDA, float32 elsewhere).
`policy_dtype`, `engine_dtype` and `autocast_dtype` give the resolved names. Log-probs and
losses are computed in float32 whatever the precision.
"""

__all__ = ["ALGOS", "SCALE_REWARDS", "IS_MODES", "ROLLOUT_DTYPES", "POLICY_DTYPES", "MIXED_PRECISIONS",
           "REWARD_ERRORS", "auto_dtype", "AlgorithmConfig", "SamplingConfig", "RolloutConfig",
           "OptimizerConfig", "RunConfig", "RLConfig"]

import dataclasses
from dataclasses import dataclass, field

from minirl.loss_types import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, loss_type_entry
from minirl.runtime.validate import ConfigError, check_choice, check_float, check_int

ALGOS = ("grpo", "ppo")
SCALE_REWARDS = ("group", "batch", "none")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")   # what an engine's copy can be
POLICY_DTYPES = ("float32", "bfloat16")                                # what the policy can train in
REWARD_ERRORS = ("raise", "zero")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")                     # accelerate's mixed_precision values


def auto_dtype(name: str, device: str) -> str:
    """A dtype setting with "auto" resolved: bfloat16 on a CUDA device, float32 elsewhere; other names unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if str(device).startswith("cuda") else "float32"


@dataclass
class AlgorithmConfig:
    """What the update computes from a batch (TRL's GRPOConfig names)."""

    algo: str = "grpo"                 # grpo: group-normalized advantages, no critic; ppo: actor + critic with GAE
    beta: float = 0.0                  # KL coefficient to the frozen reference (GRPO: in the loss; PPO: in the reward)
    epsilon: float = 0.2               # PPO clip range: ratios are clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # upper clip range (DAPO's clip-higher); none: the same as epsilon
    loss_type: str = "dapo"            # the loss's registry entry: how it clips and averages (section 4)
    scale_rewards: str = "group"       # GRPO advantages divided by the group's std, the batch's, or none (Dr. GRPO)
    importance_sampling_level: str = "token"  # token: PPO/GRPO ratios; sequence: one ratio per completion (GSPO)
    num_iterations: int = 1            # optimizer steps on each generation batch (TRL's mu)
    use_bias_correction_kl: bool = False  # multiply the KL term by the ratio pi/pi_old (TRL 1.16's default)
    importance_sampling_correction: bool = False  # weight tokens by pi_old / pi_rollout, truncated (notebook 02)
    importance_sampling_mode: str = "token_truncate"  # per token or per sequence; truncate at the cap or mask
    importance_sampling_cap: float = 2.0  # the cap of truncated importance sampling
    cliprange_value: float = 0.2       # PPO: how far the critic's value may move per update
    gamma: float = 1.0                 # PPO: discount per token
    lam: float = 0.95                  # PPO: GAE's lambda
    reward_errors: str = "raise"       # a reward function that raises: raise stops the run, zero scores the sample 0

    choices = {"algo": ALGOS, "loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS,
               "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_mode": IS_MODES,
               "reward_errors": REWARD_ERRORS}

    def __post_init__(self):
        for name, allowed in self.choices.items():
            check_choice(name, getattr(self, name), allowed)
        loss_type_entry(self.loss_type)                  # an entry that lacks a part is refused here too
        check_float("beta", self.beta, low=0.0, why="a KL penalty; 0 turns it off")
        check_float("epsilon", self.epsilon, low=0.0)
        if self.epsilon_high is not None:
            check_float("epsilon_high", self.epsilon_high, low=0.0)
        check_int("num_iterations", self.num_iterations, low=1)
        check_float("importance_sampling_cap", self.importance_sampling_cap, low=0.0, low_open=True)
        check_float("cliprange_value", self.cliprange_value, low=0.0)
        check_float("gamma", self.gamma, low=0.0, high=1.0)
        check_float("lam", self.lam, low=0.0, high=1.0)


@dataclass
class SamplingConfig:
    """How completions are drawn: what every rollout engine is asked for."""

    num_generations: int = 8           # G completions per prompt (GRPO's group)
    max_completion_length: int = 4     # new tokens per completion at most (3 answer digits + EOS)
    temperature: float = 1.0           # sample from softmax(logits / temperature); no top-k, no top-p

    def __post_init__(self):
        check_int("num_generations", self.num_generations, low=1)
        check_int("max_completion_length", self.max_completion_length, low=1)
        check_float("temperature", self.temperature, low=0.0, low_open=True, why="sampling needs a temperature > 0")


@dataclass
class RolloutConfig:
    """Which engine samples, on its own copy of the policy, in which precision."""

    rollout_engine: str = "shared_prefix"  # a name of minirl.rollout.registry.ENGINES: hf, shared_prefix, vllm, paged
    rollout_dtype: str = "auto"        # the rollout copy's precision (notebook 02); auto: bfloat16 on CUDA, else fp32

    choices = {"rollout_dtype": ("auto", *ROLLOUT_DTYPES)}   # rollout_engine: checked by the engine registry

    def __post_init__(self):
        for name, allowed in self.choices.items():
            check_choice(name, getattr(self, name), allowed)


@dataclass
class OptimizerConfig:
    """AdamW for the actor (and the critic), with gradient clipping."""

    learning_rate: float = 3e-4        # the actor's AdamW learning rate
    weight_decay: float = 0.0          # AdamW weight decay (actor and critic)
    max_grad_norm: float = 1.0         # gradients are clipped to this global norm
    value_learning_rate: float = 1e-3  # PPO: the critic's learning rate
    max_tokens_per_microbatch: int = 512  # update in micro-batches of similar length, <= N completion tokens each

    def __post_init__(self):
        check_float("learning_rate", self.learning_rate, low=0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        check_float("value_learning_rate", self.value_learning_rate, low=0.0, low_open=True)
        check_int("max_tokens_per_microbatch", self.max_tokens_per_microbatch, low=0,
                  why="0 turns micro-batching off (one micro-batch padded to the longest completion)")


@dataclass
class RunConfig:
    """How long, on what, how often to evaluate and checkpoint."""

    steps: int = 1000                  # generation batches (= optimizer steps when num_iterations is 1)
    prompts_per_step: int = 16         # B prompts per batch; a batch has B * num_generations completions
    seed: int = 0                      # draws the prompts and the sampling seeds
    eval_every: int = 100              # held-out accuracy at step 0, every N steps and at the end; 0: never
    checkpoint_every: int = 100        # with an output directory: a checkpoint every N steps; 0: only the final model
    keep_checkpoints: int = 2          # the newest N checkpoints are kept
    device: str = "cpu"                # cpu, cuda, cuda:1, ...
    dtype: str = "auto"                # the trained weights' precision; auto: float32 (bfloat16: pure bf16, lossy)
    mixed_precision: str = "auto"      # autocast of each step (accelerate's); auto: bf16 on CUDA, no on the CPU
    disable_dropout: bool = True       # TRL's: dropout off during RL (the packed update's shared prompt pass needs it)
    log_completions: int = 0           # prompt, completion, rewards rows logged per step (first 3, every eval); 0: off

    choices = {"dtype": ("auto", *POLICY_DTYPES), "mixed_precision": MIXED_PRECISIONS}

    def __post_init__(self):
        check_choice("dtype", self.dtype, self.choices["dtype"])
        check_choice("mixed_precision", self.mixed_precision, self.choices["mixed_precision"])
        check_int("steps", self.steps, low=1)
        check_int("prompts_per_step", self.prompts_per_step, low=1)
        check_int("seed", self.seed, low=0)
        check_int("eval_every", self.eval_every, low=0, why="0 turns evaluation off")
        check_int("checkpoint_every", self.checkpoint_every, low=0, why="0 keeps only the final model")
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)
        check_int("log_completions", self.log_completions, low=0, why="0 logs no completions")


@dataclass
class RLConfig:
    """One RL run: five groups of settings, each checked when built, plus the checks that span groups."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.algorithm.algo == "grpo" and self.sampling.num_generations < 2:
            raise ConfigError("num_generations", self.sampling.num_generations,
                              "GRPO compares completions within a group of at least 2; use >= 2 (or algo='ppo')")

    @property
    def policy_dtype(self) -> str:
        """The dtype the policy trains in: run.dtype, "auto" resolved (float32 on every device, as TRL)."""
        return "float32" if self.run.dtype == "auto" else self.run.dtype

    @property
    def resolved_mixed_precision(self) -> str:
        """run.mixed_precision with "auto" resolved for run.device: "bf16" on CUDA, "no" elsewhere (or as set)."""
        mode = self.run.mixed_precision
        if mode == "auto":
            mode = "bf16" if str(self.run.device).startswith("cuda") else "no"
        return mode

    @property
    def autocast_dtype(self) -> str | None:
        """The dtype each step's forward passes autocast to ("bfloat16", "float16"), or None (no autocast):
        the resolved mixed precision's (bf16 on CUDA, none elsewhere, with "auto")."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.resolved_mixed_precision)

    @property
    def engine_dtype(self) -> str:
        """The dtype of the rollout engine's copy: rollout.rollout_dtype, "auto" resolved for run.device."""
        return auto_dtype(self.rollout.rollout_dtype, self.run.device)

    def groups(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def flat(self) -> dict:
        """Every leaf setting by its (unique) name: {"algo": "grpo", "beta": 0.0, ...}."""
        return {k: v for group in self.groups().values() for k, v in dataclasses.asdict(group).items()}

    def replace(self, **leaves) -> "RLConfig":
        """A copy with leaf settings changed by name: `config.replace(beta=0.04, steps=50)`."""
        unknown = set(leaves) - set(self.flat())
        if unknown:
            raise ConfigError(sorted(unknown)[0], leaves[sorted(unknown)[0]],
                              f"not a setting of RLConfig; the settings are {', '.join(sorted(self.flat()))}")
        groups = {name: dataclasses.replace(group, **{k: v for k, v in leaves.items() if hasattr(group, k)})
                  for name, group in self.groups().items()}
        return RLConfig(**groups)

    @classmethod
    def from_flat(cls, **leaves) -> "RLConfig":
        """`RLConfig.from_flat(algo="ppo", steps=50)`: the defaults with these leaf settings."""
        return cls().replace(**leaves)

    @classmethod
    def from_dict(cls, groups: dict) -> "RLConfig":
        """Inverse of `dataclasses.asdict(config)` (what a checkpoint stores)."""
        types = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        return cls(**{name: types[name](**values) for name, values in groups.items()})
