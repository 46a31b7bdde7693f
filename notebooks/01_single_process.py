# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · The single-process loop that really learns
#
# **By the end of this notebook you can** write every piece of a GRPO or PPO step yourself
# (per-token log-probs, group-normalized advantages, GAE with a critic, the clipped
# objective, the four ways TRL aggregates a loss, the KL to a reference model) and run the
# whole loop, generate → reward → update → synchronize, in one Python process until the
# tiny policy of notebook 00 gains tens of points of held-out accuracy.
#
# The source's first claim is the order of the loop, and that every framework it surveys,
# from TRL to veRL, runs the same four steps; they differ in *where* each step runs. TRL
# runs all four in one process, on one device (or a few, through Accelerate). That is the
# stage we build here. It is also the reference every later stage must reproduce, so we build
# it around four seams that later stages fill differently without touching the step itself:
#
# | seam | here (stage 1) | later |
# |---|---|---|
# | the **roles** `Actor`, `Reference`, `Critic` | plain modules in this process | FSDP-wrapped on every rank (04), Ray workers (06) |
# | the **rollout engine** (a protocol) | HF `generate`, or a shared-prefix sampler | vLLM (04), a paged engine (05) |
# | the **weight sync** | an in-process copy, with a version | gathered from shards (04), broadcast across actors (06) |
# | the **batch** `Rollout` / `Experience` | one process | split by rank, concatenated back (04, 06), queued (07) |
#
# | step | who answers | what it produces |
# |---|---|---|
# | 1. generate | `engine.generate` | completions, the engine's own log-probs, the policy version |
# | 2. reward | `score` | one reward per completion |
# | (experience) | `make_experience`: `actor.logprobs`, `reference.logprobs`, `critic.values` | what the update needs, computed before it |
# | (advantages) | `compute_advantages` | group-normalized (GRPO) or GAE (PPO) |
# | 3. update | `actor.update`, `critic.update` | optimizer steps |
# | 4. synchronize | `sync.push` | the engine holds version v + 1 |

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import codecs
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from minirl.models.policy import load_default_policy
from minirl.runtime.model_loading import check_prompts
from minirl.runtime.notebook import add_to_class  # a later cell's method, into its class
from minirl.tasks.arithmetic import make_task

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()   # the repository
RUNS = ROOT / "runs"                                                          # every run lands here
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny policy's matrices are too small to gain from more threads
model, tokenizer, policy_path = load_default_policy()
task = make_task()

# %% [markdown]
# ## 0. The whole loop first
#
# Before opening any piece, the finished stage running on the package: `train` from
# `minirl.train.run` with the default GRPO configuration on the embedded task, from the warm
# start of notebook 00 (a fresh copy: the `model` above stays as it is), for 300 steps (smoke
# mode: 20), with held-out greedy accuracy measured before, during and after. Section 8 runs
# the full 1000 steps; sections 1 to 7 build every piece this one call runs, from the log-probs
# up to the loop.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.train.run import train  # noqa: E402

FIRST_STEPS = 20 if SMOKE else 300
first = train(RLConfig.from_flat(steps=FIRST_STEPS, eval_every=FIRST_STEPS // 3))   # a progress bar per step
first_evals = [(m["step"], m["accuracy"]) for m in first if "accuracy" in m]
print("held-out greedy accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in first_evals))
first_gain = first_evals[-1][1] - first_evals[0][1]
print(f"{first_evals[0][1]:.3f} -> {first_evals[-1][1]:.3f} ({100 * first_gain:+.1f} points) in {FIRST_STEPS} steps, "
      f"{sum(m.get('time/step', 0) for m in first):.0f} s of training: "
      + ("smoke mode, too short to judge" if SMOKE else "learned" if first_gain > 0 else "did NOT learn"))

# %% [markdown]
# ## 1. Per-token log-probabilities
#
# Every policy-gradient loss for language models is built from one quantity: the
# log-probability the policy gives each sampled completion token, log π(y_t | x, y_<t).
# A forward pass over the prompt and the completion gives logits [B, T, V]; the logit at
# position t predicts token t+1, so the completion's log-probs come from the C positions
# *before* each completion token. Sampling at temperature τ means the policy is
# softmax(logits / τ), so the log-probs must be computed from logits / τ too (TRL does the
# same; forget it and the ratio π/π_old is wrong from the first step).
#
# First, masked means and sums: completions have different lengths, and the positions after
# the end-of-sequence token must count for nothing.

# %%
# | export minirl/algo/logprobs.py
"""Per-token log-probabilities and entropies of completions, and masked reductions.

Everything an RL loss needs from a forward pass: `completion_logprobs` runs the model over
left-padded prompt + completion and returns log π(y_t | x, y_<t) for each completion token,
at the sampling temperature, in float32. With `num_generations=G` it computes the prompt
shared by each group of G consecutive rows once (`shared_prefix_logits`): same values up to
float rounding, same gradients, less work. TRL runs every row's prompt.

For a long-tailed batch `MicroBatchedLogprobs` scores the rows in micro-batches of similar
completion length (`micro_batches`), each padded only to its own longest completion, with
every group's prompt still computed once (`PromptCache`): the update then costs about the
real tokens, not rows x the longest completion.

Simplified vs TRL's `_get_per_token_logps_and_entropies`: micro-batches are sized by tokens
and grouped by length rather than fixed row counts; no vision inputs; logits are cast to
float32 before the temperature is applied (TRL divides first, in the model's dtype), which
only matters for bf16 models and is the more accurate order.
"""
import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1. values, mask: [B, T] (same shape)."""
    if values.shape != mask.shape:
        raise ValueError(f"masked_sum: values {tuple(values.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape [B, T]")
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over the positions where `mask` is 1.

    values, mask: [B, T]; mask is 0 on prompt and padding tokens. dim=None averages over
    every unmasked token of the batch, dim=-1 gives one mean per row [B]. An all-masked row
    (an empty completion) averages to 0 instead of NaN: its denominator is clamped to 1.
    """
    mask = mask.to(values.dtype)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token counted from the first real token: [B, T] long.

    With left padding a prompt's first token sits at column 3, say, but must get position 0,
    as it does in `generate`. Padding positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# %% [markdown]
# Now the log-probability of the chosen token. Taking `log_softmax` over the whole vocabulary
# and then picking one entry works, but materializes a second [B, T, V] tensor; with a
# 150 000-token vocabulary that is the largest tensor of the step. Since
# log softmax(z)_i = z_i − logsumexp(z), we can gather z_i first and subtract one logsumexp
# per position. This is exercise 1.1.

# %%
# | export minirl/algo/logprobs.py
def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log softmax(logits)[..., index] without building the full log-softmax tensor.

    logits: [B, T, V] float; index: [B, T] long token ids in [0, V).
    Returns [B, T] with out[b, t] = logits[b, t, index[b, t]] - logsumexp(logits[b, t, :]),
    in the dtype of `logits`. Every value is <= 0, and exp(out) summed over all V choices
    of index at one position would be 1.
    """
    # BEGIN SOLUTION
    chosen = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return chosen - torch.logsumexp(logits, dim=-1)
    # END SOLUTION


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) at each position: [B, T, V] -> [B, T], in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def completion_logits(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                      temperature: float = 1.0, num_generations: int = 1) -> Tensor:
    """The next-token distributions the last `num_completion_tokens` tokens were drawn from.

    input_ids, attention_mask: [B, P+C], a left-padded prompt followed by the completion.
    Returns logits / temperature, [B, C, V] float32, where [:, t] predicts completion token t.
    Position ids come from the mask, exactly as `generate` derived them when it sampled, so
    rollout and trainer agree. num_generations=1 runs one forward pass over every row.
    num_generations=G > 1 says that rows i*G .. i*G+G-1 share one prompt (the rollout's
    order); each prompt then runs once (`shared_prefix_logits`, section 11), with the same
    result up to float rounding.
    """
    if temperature <= 0:
        raise ValueError(f"completion_logprobs: temperature={temperature} must be > 0")
    if num_generations < 1:
        raise ValueError(f"completion_logprobs: num_generations={num_generations} must be >= 1 (1: no sharing)")
    C = num_completion_tokens
    if num_generations > 1:
        logits = shared_prefix_logits(model, input_ids, attention_mask, C, num_generations)   # [B, C, V]
    else:
        position_ids = position_ids_from_mask(attention_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=C + 1).logits[:, :-1]              # [B, C, V]: position t predicts t+1
    return logits.float() / temperature                                 # [B, C, V]


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, with_entropy: bool = False,
                        num_generations: int = 1) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens under `model`.

    input_ids, attention_mask: [B, P+C] as for `completion_logits`, which computes the
    distributions. Returns (logps [B, C] float32, entropy [B, C] or None).
    """
    logits = completion_logits(model, input_ids, attention_mask, num_completion_tokens,
                               temperature, num_generations)            # [B, C, V]
    logps = selective_log_softmax(logits, input_ids[:, -num_completion_tokens:])   # [B, C]
    return logps, (entropy_from_logits(logits) if with_entropy else None)


# %% [markdown]
# Try it on the warm-started policy: the log-probs of the correct answer to a few prompts.
# Mind the `position_ids`. `generate` numbers a left-padded prompt's tokens from 0; a plain
# forward pass without `position_ids` numbers them from the first *column*, so a padded
# prompt sees every position shifted by its padding. Does that matter? For Qwen2 it barely
# does: rotary embeddings (RoPE) depend only on the *difference* between two positions, and a
# constant shift cancels, leaving rounding error. For a model with learned absolute
# positions (GPT-2, OPT) the shift changes the answer outright. We pass position ids from
# the mask always, as `generate` and TRL do, so the trainer scores exactly what the rollout
# sampled, whatever the architecture. The table measures both.

# %%
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from minirl.algo.logprobs import completion_logprobs, masked_mean, position_ids_from_mask  # noqa: E402

probs = [p for p in task.test if len(task.prompt(p)) < 6][:2] + task.test[:2]   # short prompts get padded
rows = [{"prompt": task.prompt(p)} for p in probs]
targets = [task.answer_text(p) + tokenizer.eos_token for p in probs]
enc = tokenizer([r["prompt"] for r in rows], padding=True, return_tensors="pt", add_special_tokens=False)
comp = tokenizer(targets, padding=True, return_tensors="pt", add_special_tokens=False, padding_side="right")
ids = torch.cat([enc.input_ids, comp.input_ids], 1)
mask = torch.cat([enc.attention_mask, comp.attention_mask], 1)
C = comp.input_ids.shape[1]
torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2)).eval()   # random weights: only the effect matters
print(f"{'model':>6} | {'prompt':>7} | padded | log p(answer) with position ids | without | difference")
for name, net in (("qwen2", model), ("gpt2", gpt2)):
    with torch.no_grad():
        right, _ = completion_logprobs(net, ids, mask, C)
        logits = net(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1].float()  # no position_ids
        wrong = torch.log_softmax(logits, -1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    for i, r in enumerate(rows):
        m = comp.attention_mask[i].bool()
        pad = bool((enc.attention_mask[i] == 0).any())
        print(f"{name:>6} | {r['prompt']:>7} | {str(pad):>6} | {right[i][m].sum():>31.4f} | {wrong[i][m].sum():>7.4f}"
              f" | {(right[i][m] - wrong[i][m]).abs().max():.1e}")

# %% [markdown]
# ## 2. The configuration, the batch, and the engine that samples it
#
# Three pieces come before any learning. A **configuration** says what to compute; a
# **rollout engine** samples completions from its own copy of the policy; the **batch** it
# returns is what travels between the steps of the loop (and, in later stages, between
# processes and machines).
#
# ### 2.1 One configuration, grouped by concern
#
# A run has about thirty settings. They fall into five groups: what the update computes
# (`algorithm`), how completions are drawn (`sampling`), which engine draws them
# (`rollout`), the optimizer, and the run's bookkeeping. Each group is a small dataclass
# that checks its own values when it is built, and the names of the settings are TRL's
# (`num_generations`, `beta`, `epsilon`, `loss_type`, ...), so a TRL user finds them where
# they expect. The names are also unique across groups: `config.replace(beta=0.04)` knows
# where `beta` lives, and each chapter script turns every setting into a flag
# (`--learning-rate`) with the comment on its line as the help text, so flags and fields
# cannot drift apart.

# %%
# | export minirl/config.py
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

Precision: `dtype` is the policy's (the trainer's, the reference's and the critic's; TRL's
`dtype` in `model_init_kwargs`) and `rollout_dtype` the rollout copy's. Both default to
"auto": bfloat16 on a CUDA device, float32 elsewhere, so a CPU run computes in float32 as it
always did and a GPU run uses its tensor cores. `policy_dtype` and `engine_dtype` give the
resolved names. A bfloat16 policy trains in pure bfloat16 (weights, gradients and AdamW's
state, as TRL does with `dtype=bfloat16`); log-probs and losses are computed in float32.
"""

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


def auto_dtype(name: str, device: str) -> str:
    """A dtype setting with "auto" resolved: bfloat16 on a CUDA device, float32 elsewhere; other names unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if str(device).startswith("cuda") else "float32"


# %% [markdown]
# The first group says what the update computes: the algorithm, the clip range, how per-token
# losses and rewards are averaged, the KL coefficient, and PPO's critic settings.

# %%
# | export minirl/config.py
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


# %% [markdown]
# What one rollout samples, and how: the group size, the length cap, the temperature, the engine.

# %%
# | export minirl/config.py
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


# %% [markdown]
# Where and how long a run goes: device, seed, steps, evaluation and checkpoints.

# %%
# | export minirl/config.py
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
    dtype: str = "auto"                # the policy's precision (trainer, reference, critic); auto: bfloat16 on CUDA

    choices = {"dtype": ("auto", *POLICY_DTYPES)}

    def __post_init__(self):
        check_choice("dtype", self.dtype, self.choices["dtype"])
        check_int("steps", self.steps, low=1)
        check_int("prompts_per_step", self.prompts_per_step, low=1)
        check_int("seed", self.seed, low=0)
        check_int("eval_every", self.eval_every, low=0, why="0 turns evaluation off")
        check_int("checkpoint_every", self.checkpoint_every, low=0, why="0 keeps only the final model")
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)


# %% [markdown]
# `RLConfig` holds one of each group, checks what spans groups (GRPO needs a group of at least
# 2), and addresses every setting by its own name: `flat`, `replace`, `from_flat`.

# %%
# | export minirl/config.py
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
        """The dtype the policy trains in: run.dtype, "auto" resolved for run.device."""
        return auto_dtype(self.run.dtype, self.run.device)

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

# %%
import dataclasses  # noqa: E402

from minirl.config import RLConfig, SamplingConfig  # noqa: E402  (the exported versions)

config = RLConfig()
print("defaults:", {k: v for k, v in config.flat().items() if k in ("algo", "num_generations", "learning_rate",
                                                                     "steps", "prompts_per_step")})
print("changed: ", config.replace(beta=0.04, steps=50).flat()["beta"])
print(f"{len(config.flat())} settings in {len(config.groups())} groups:",
      ", ".join(f"{name} {len(dataclasses.asdict(group))}" for name, group in config.groups().items()))
for bad in (dict(num_generations=1), dict(learning_rate=float("inf")), dict(loss_type="ppo")):
    try:
        RLConfig.from_flat(**bad)
    except ValueError as err:
        print(f"{type(err).__name__}: {err}")

# %% [markdown]
# ### 2.2 The batch that travels
#
# An engine returns a `Rollout`: N = B × G rows, the G completions of each prompt next to
# each other, with the prompt left-padded and the completion right-padded so that every
# prompt ends in the same column. Besides the token ids and masks it carries the **behaviour
# log-probs** (what the engine computed for each token it sampled: notebook 02 compares them
# with the trainer's) and the **version** of the policy that produced it.
#
# Later stages move batches around: notebook 04 gives each rank its share, notebook 06 fans a
# batch out to workers and gathers the results. So a batch knows how to do that itself:
# `to(device)`, `split(n)` into n parts of whole groups (GRPO normalizes within a group, so
# a prompt's G completions must never be separated), `Batch.concat(parts)` (padding parts of
# different widths), and `select(keys)` (a copy that carries only the optional tensors a
# receiver needs). One small base class does this for every batch type by looking at its
# fields.

# %%
# | export minirl/data.py
"""The batch that travels: `Rollout` (what an engine sampled) and `Experience` (what the update needs).

Both are dataclasses of per-row tensors and lists, N = B * G rows in generation order (rows
i*G .. i*G+G-1 are the G completions of prompt i), plus a few values shared by all rows
(the policy version, G, the pad id). Each knows how to move and split itself, which is all
an orchestration needs: `to(device)`, `split(n)` into n parts of whole groups (one per
data-parallel rank), `Batch.concat(parts)` (padding to the widest part), and `select(keys)`
(a copy carrying only the optional tensors a receiver needs).

Simplified vs veRL's `DataProto` (a TensorDict plus non-tensor arrays and meta info): two
typed dataclasses and one small base class, so that every field has a name, a shape comment
and a type a reader can look up.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

# %% [markdown]
# One base class gives every batch its row operations by looking at its fields: `to`, `rows`,
# `split` into whole groups, `concat` with padding, `select`.

# %%
# | export minirl/data.py
class Batch:
    """Row-wise operations shared by Rollout and Experience.

    A field is one of: a tensor whose first dimension is the N rows (2-D ones are padded to
    the widest part when parts are concatenated: on the left for the names in LEFT_PADDED,
    on the right otherwise), a list with one entry per row, a nested Batch, None (an absent
    optional tensor; it must be absent in every part), or a shared value (an int such as the
    version) that every part must agree on.
    """

    LEFT_PADDED: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()

    def __len__(self) -> int:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Tensor, list, Batch)):
                return len(value)
        raise TypeError(f"{type(self).__name__} has no per-row field")

    def _map(self, fn) -> "Batch":
        """A copy with `fn(name, value)` applied to every per-row field (shared values kept)."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values[f.name] = fn(f.name, value) if isinstance(value, (Tensor, list, Batch)) else value
        return dataclasses.replace(self, **values)

    def to(self, device) -> "Batch":
        """The same batch with every tensor on `device`."""
        return self._map(lambda name, v: v.to(device) if isinstance(v, (Tensor, Batch)) else v)

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows start..stop-1 (a view for tensors)."""
        return self._map(lambda name, v: v.rows(start, stop) if isinstance(v, Batch) else v[start:stop])

# %% [markdown]
# Splitting and joining: `split` cuts a batch into equal parts of whole groups (one per
# data-parallel rank, later), and `concat` joins parts back, padding 2-D tensors to the
# widest part.

# %%
# | export minirl/data.py
@add_to_class(Batch)
def split(self, n: int) -> list["Batch"]:
    """n contiguous parts of equal size, each made of whole groups of `group_size` rows.

    Raises ValueError when the N rows do not divide into n parts of whole groups: a
    prompt's G completions must stay together (GRPO normalizes within the group).
    """
    N, G = len(self), self.group_size
    if n < 1 or N % (n * G):
        raise ValueError(f"{type(self).__name__}.split({n}): {N} rows in groups of {G} do not split into "
                         f"{n} equal parts of whole groups; use a number of parts that divides {N // G} "
                         "prompts")
    size = N // n
    return [self.rows(i * size, (i + 1) * size) for i in range(n)]


@add_to_class(Batch)
@staticmethod
def concat(parts: list["Batch"]) -> "Batch":
    """The parts' rows one after another; 2-D tensors padded to the widest part."""
    if not parts:
        raise ValueError("Batch.concat: no parts to concatenate")
    first = parts[0]
    values = {}
    for f in dataclasses.fields(first):
        column = [getattr(p, f.name) for p in parts]
        if isinstance(column[0], Batch):
            values[f.name] = Batch.concat(column)
        elif isinstance(column[0], list):
            values[f.name] = [x for part in column for x in part]
        elif isinstance(column[0], Tensor):
            if any(c is None for c in column):
                raise ValueError(f"{type(first).__name__}.concat: {f.name} is missing in some parts")
            values[f.name] = _cat_padded(column, left=f.name in first.LEFT_PADDED,
                                         value=first.pad_value(f.name))
        else:
            if any(c != column[0] for c in column):
                raise ValueError(f"{type(first).__name__}.concat: parts disagree on {f.name} "
                                 f"({sorted(set(map(str, column)))}); only batches of one "
                                 f"{f.name} can be concatenated")
            values[f.name] = column[0]
    return dataclasses.replace(first, **values)

# %% [markdown]
# `select` drops the optional tensors a receiver does not need, so less crosses a process
# boundary; `pad_value` is what padding fills in (0 unless a subclass says otherwise).

# %%
# | export minirl/data.py
@add_to_class(Batch)
def select(self, keys) -> "Batch":
    """A copy whose optional tensors not named in `keys` are dropped (None): less to ship."""
    keys = set(keys)
    unknown = keys - {f.name for f in dataclasses.fields(self)}
    if unknown:
        raise ValueError(f"{type(self).__name__}.select: no field(s) {sorted(unknown)}")
    return dataclasses.replace(self, **{name: None for name in self.OPTIONAL if name not in keys})


@add_to_class(Batch)
def pad_value(self, name: str) -> int:
    return 0


# %% [markdown]
# A rollout is a batch that also knows its prompts and completions apart; concatenating two pads each side to the longer one.

# %%
# | export minirl/data.py
def _cat_padded(tensors: list[Tensor], left: bool, value) -> Tensor:
    """Concatenate along rows, padding dimension 1 of 2-D (or more) tensors to the widest."""
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = width - t.shape[1]
        if pad:
            filler = t.new_full((t.shape[0], pad, *t.shape[2:]), value)
            t = torch.cat([filler, t] if left else [t, filler], 1)
        padded.append(t)
    return torch.cat(padded)


@dataclass
class Rollout(Batch):
    """What a rollout engine returns: G consecutive completions per prompt, N = B * G rows."""

    prompt_ids: Tensor        # [N, P] long, left-padded
    prompt_mask: Tensor       # [N, P] long
    completion_ids: Tensor    # [N, C] long, right-padded
    completion_mask: Tensor   # [N, C] long, 1 up to and including the first EOS
    logprobs: Tensor          # [N, C] float32 behaviour log-probs, as the engine computed them (0 where masked)
    completions: list[str]    # N decoded completions (special tokens removed)
    prompts: list[str]        # N prompts (each repeated G times)
    version: int              # the policy version that generated them
    num_generations: int = 1  # G: rows come in groups of G completions of one prompt
    pad_token_id: int = 0     # fills the padding when parts of different widths are concatenated
    token_versions: Tensor | None = None  # [N, C] long: each token's policy version, when they differ (stage 7)

    LEFT_PADDED = ("prompt_ids", "prompt_mask")
    OPTIONAL = ("token_versions",)

    @property
    def group_size(self) -> int:
        return self.num_generations

    def pad_value(self, name: str) -> int:
        return self.pad_token_id if name.endswith("_ids") else 0

    @property
    def input_ids(self) -> Tensor:       # [N, P+C]
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def attention_mask(self) -> Tensor:  # [N, P+C]
        return torch.cat([self.prompt_mask, self.completion_mask], 1)

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_ids.shape[1]

# %% [markdown]
# ### 2.3 The rollout engine, as a protocol
#
# In TRL the model that samples is the model that trains. In every distributed system it is
# a *copy*: vLLM's weights on the rollout GPUs, a separate actor on Ray. minirl keeps that
# copy even in one process, so step 4, synchronize, is an explicit call with a version
# number, and an engine refuses to sample from a version other than the one the loop
# expects. What the loop asks of an engine is small, and we write it down as a `Protocol`:
# `generate(prompts, sampling, expected_version)` and `load_weights(named_tensors, version)`.
# HF `generate`, a faster sampler (section 11), vLLM (notebook 04) and a paged engine
# written from scratch (notebook 05) all stand behind it; the loop's types name the
# protocol, never a class.

# %%
# | export minirl/rollout/base.py
"""The rollout-engine protocol: what the loop asks of any engine that samples completions.

An engine holds its own copy of the policy at some version. The loop asks it for G
completions per prompt from the version it expects, and hands it new weights after every
update. HF `generate` (`rollout/hf.py`), the shared-prefix sampler
(`rollout/shared_prefix.py`), vLLM (notebook 04) and a paged engine written from scratch
(notebook 05) all stand behind this one protocol, so the loop never knows which it drives.

Colocated engines, which share devices with the trainer, also offer `sleep()` (release
their weights and KV cache during the update) and `wake_up()`: the `Colocated` protocol.
The loop never calls them. Such an engine sleeps at the end of its own `generate` and wakes
at the start of the next `load_weights` (notebook 04's `ColocatedEngine`, used by stages 4
and 6, and the vLLM engine), so the step reads the same whether the engine shares the
trainer's devices or not.
"""

from typing import Iterable, Protocol, runtime_checkable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout


class VersionMismatchError(RuntimeError):
    """The engine holds other weights than the loop expects."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions from its copy of the policy; takes new weights with a version."""

    version: int

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """sampling.num_generations completions per prompt, from policy `expected_version`.

        Rows i*G .. i*G+G-1 of the Rollout continue prompts[i]. With a `generator`, the
        completions depend on it alone (one seed is drawn from it); the global RNG is left
        as it was. Raises VersionMismatchError if `expected_version` is not `self.version`.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy these weights (all of them, by the trainer's names) into the engine; it now holds `version`."""
        ...


@runtime_checkable
class Colocated(Protocol):
    """An engine that shares devices with the trainer and can free its memory meanwhile."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


# %% [markdown]
# What every engine shares, written once: a request is checked the same way (the version
# first), a seed is drawn from the loop's generator, and the sampled ids become a `Rollout`,
# its completion mask cut after EOS.

# %%
# | export minirl/rollout/base.py
def check_request(engine, prompts: list[str], sampling: SamplingConfig, expected_version: int | None) -> None:
    """The checks every engine makes before sampling: the version, and a non-empty request."""
    if expected_version is not None and expected_version != engine.version:
        raise VersionMismatchError(
            f"{type(engine).__name__} holds policy version {engine.version} but the loop expected version "
            f"{expected_version}: push the trainer's weights (sync.push / load_weights) before generating")
    if not prompts:
        raise ValueError("generate: prompts is empty; pass at least one prompt")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"generate: sampling must be a SamplingConfig, got {type(sampling).__name__}")


def draw_seed(generator: torch.Generator | None) -> int | None:
    """One sampling seed from `generator` (None without one), whatever the engine does with it."""
    if generator is None:
        return None
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


def completion_mask_from_ids(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """[N, C] long mask: 1 for every token up to and including the first EOS, 0 after it.

    A completion that never emits EOS (truncated at max_completion_length) keeps all C tokens.
    """
    is_eos = completion_ids == eos_token_id                                    # [N, C]
    C = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(is_eos[:, 0], C, dtype=torch.long))
    return (torch.arange(C, device=completion_ids.device)[None] <= first[:, None]).long()


def check_tokenizer(tokenizer) -> None:
    """Raise a clear error for a tokenizer that cannot pad a batch or end a completion."""
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer.pad_token is None: batched generation needs a pad token; "
                         "set tokenizer.pad_token = tokenizer.eos_token (what TRL does) or add one")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.eos_token is None: completions need an end-of-sequence token")


def make_rollout(tokenizer, prompts: list[str], num_generations: int, prompt_ids: Tensor, prompt_mask: Tensor,
                 completion_ids: Tensor, logprobs: Tensor, version: int) -> Rollout:
    """Assemble a Rollout from what an engine sampled: masks after EOS, decoded texts, masked log-probs.

    prompt_ids, prompt_mask: [N, P]; completion_ids, logprobs: [N, C], N = len(prompts) * G.
    """
    completion_mask = completion_mask_from_ids(completion_ids, tokenizer.eos_token_id)       # [N, C]
    pad = tokenizer.pad_token_id
    completions = tokenizer.batch_decode(completion_ids * completion_mask + pad * (1 - completion_mask),
                                         skip_special_tokens=True)
    repeated = [p for p in prompts for _ in range(num_generations)]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs.float() * completion_mask,
                   completions, repeated, version, num_generations=num_generations, pad_token_id=pad)

# %% [markdown]
# ### 2.4 The first engine: HF `generate` on a copy of the policy
#
# `HFEngine` copies the policy (optionally in a lower precision, for notebook 02), samples
# with HF `generate` over the B × G repeated prompts, and records the log-probs of the
# tokens it sampled from the very logits it sampled from. `load_weights` refuses a partial
# or misnamed set of weights before copying anything: half a synchronization is worse than
# none.

# %%
# | export minirl/rollout/hf.py
"""The Hugging Face `generate` engine: sampling with a KV cache, on its own copy of the policy.

`HFEngine` holds a copy of the policy (optionally in a lower precision) and samples G
completions per prompt with HF `generate` over the B * G repeated prompts: every forward
pass covers all rows (notebook 02's MoE route recorder relies on that). It returns a
`Rollout` with the completions, masks, the sampled tokens' log-probs as the engine computed
them, and the policy version that produced them.

Simplified vs TRL: TRL samples with the training model itself (no copy, no version); vLLM
rollouts in TRL and veRL live in another process. We keep a separate copy so that step 4 of
the loop, synchronize, is real and checkable. The float8 mode only simulates an FP8 rollout
on a CPU: weights are round-tripped through float8_e4m3fn with one scale per tensor and
computed in bfloat16.
"""

import copy
from typing import Iterable

import torch
from torch import Tensor

from minirl.algo.logprobs import selective_log_softmax
from minirl.config import ROLLOUT_DTYPES, SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, check_tokenizer, draw_seed, make_rollout
from minirl.runtime.validate import check_choice


def fp8_round_trip(weight: Tensor) -> Tensor:
    """Quantize a weight matrix to float8_e4m3fn with one per-tensor scale, back to bfloat16."""
    scale = weight.detach().abs().max().float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return ((weight.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


# %% [markdown]
# The engine itself: its own copy of the policy, and `load_weights` that refuses a partial
# or misnamed set of weights.

# %%
# | export minirl/rollout/hf.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}   # what a copy computes in


class HFEngine:
    """HF `generate` over B * G rows, on the engine's own copy of the policy.

    Samples from softmax(logits / temperature) with no top-k and no top-p, and records the
    behaviour log-probs from the very logits it sampled from. dtype: the copy's precision
    ("float8_e4m3fn" simulates FP8 weights, computing in bfloat16).
    """

    def __init__(self, model, tokenizer, dtype: str = "float32", device=None):
        check_choice("rollout_dtype", dtype, ROLLOUT_DTYPES)
        check_tokenizer(tokenizer)
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.padding_side = "left"      # prompts end at the same column
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        compute = torch.bfloat16 if dtype == "float8_e4m3fn" else DTYPES[dtype]
        self.model = copy.deepcopy(model).to(self.device, compute).eval()
        self.version = 0
        self.load_weights(model.state_dict().items(), version=0)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Synchronize: copy every named tensor into the engine's copy (cast to its dtype); set `version`.

        Raises ValueError naming the tensors that are missing, unexpected or of the wrong
        shape, before anything is copied: half a synchronization is worse than none.
        """
        state = dict(named_tensors)
        if self.dtype == "float8_e4m3fn":
            state = {k: fp8_round_trip(v) if v.dim() >= 2 else v for k, v in state.items()}
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        reshaped = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if missing or unexpected or reshaped:
            raise ValueError(f"{type(self).__name__}.load_weights(version={version}): missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shape {reshaped[:3]} (of {len(own)} tensors); "
                             "push all of the policy's tensors under the names of its state_dict")
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)     # copy_ casts to the copy's dtype
        self.version = version

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The engine's copy of the weights by state_dict name (what the stale-parameter check compares)."""
        return self.model.state_dict().items()

# %% [markdown]
# `generate` checks the request (the version first) and leaves the sampling to `sample`,
# which runs HF `generate` and keeps the log-probs of the very logits it sampled from.

# %%
# | export minirl/rollout/hf.py
@add_to_class(HFEngine)
@torch.no_grad()
def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
             generator: torch.Generator | None = None) -> Rollout:
    """sampling.num_generations completions per prompt; rows i*G .. i*G+G-1 belong to prompts[i].

    A row stops at its EOS (then pad tokens, masked out); generation stops when every row
    has stopped or after max_completion_length tokens. See `RolloutEngine.generate`.
    """
    check_request(self, prompts, sampling, expected_version)
    G = sampling.num_generations
    prompt_ids, prompt_mask, completion_ids, logprobs = self.sample(prompts, sampling, draw_seed(generator))
    return make_rollout(self.tokenizer, prompts, G, prompt_ids, prompt_mask, completion_ids, logprobs,
                        self.version)


@add_to_class(HFEngine)
def sample(self, prompts: list[str], sampling: SamplingConfig, seed: int | None):
    """(prompt_ids [N, P], prompt_mask [N, P], completion_ids [N, C], logprobs [N, C]) from HF generate."""
    tok, G = self.tokenizer, sampling.num_generations
    repeated = [p for p in prompts for _ in range(G)]
    enc = tok(repeated, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
    devices = [self.device] if self.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        out = self.model.generate(**enc, do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=sampling.max_completion_length, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, output_logits=True,
                                  return_dict_in_generate=True)
    completion_ids = out.sequences[:, enc.input_ids.shape[1]:]                       # [N, C]
    logits = torch.stack(out.logits, 1).float() / sampling.temperature               # [N, C, V]
    return enc.input_ids, enc.attention_mask, completion_ids, selective_log_softmax(logits, completion_ids)

# %% [markdown]
# One call: two prompts, four samples each. Then the check that protects the loop: asking
# for version 1 while the engine holds version 0 is refused. And the batch splits into whole
# groups and concatenates back to itself.

# %%
from minirl.data import Batch  # noqa: E402
from minirl.rollout.base import RolloutEngine, VersionMismatchError  # noqa: E402
from minirl.rollout.hf import HFEngine  # noqa: E402

engine = HFEngine(model, tokenizer)
print("an HFEngine is a RolloutEngine:", isinstance(engine, RolloutEngine))
ro = engine.generate(["27+35=", "4+5="], SamplingConfig(num_generations=4), generator=torch.Generator().manual_seed(0))
print("completions:", ro.completions, " version:", ro.version)
print("behaviour log-probs [N, C]:\n", ro.logprobs.round(decimals=2))
try:
    engine.generate(["27+35="], SamplingConfig(num_generations=4), expected_version=1)
except VersionMismatchError as err:
    print("VersionMismatchError:", err)
halves = ro.split(2)
back = Batch.concat(halves)
print("split(2):", [h.prompts[0] for h in halves], "| concat(split) is the batch again:",
      all(torch.equal(getattr(back, k), getattr(ro, k)) for k in ("prompt_ids", "completion_ids", "logprobs")))

# %% [markdown]
# Are the engine's log-probs the trainer's? In float32, with position ids, they should
# agree to rounding error:

# %%
with torch.no_grad():
    trainer_logps, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
print("max |engine - trainer| log-prob:", (ro.logprobs - trainer_logps * ro.completion_mask).abs().max().item())

# %% [markdown]
# ## 3. Advantages
#
# **GRPO** needs no critic. For each prompt it samples a group of G completions and scores
# each one against its siblings: A_i = (r_i − mean(r_group)) / (std(r_group) + 1e-4). A
# group whose members all got the same reward carries no signal (every A_i = 0). TRL offers
# three scalings, and we follow it exactly, down to the unbiased std and the 1e-4:
#
# | `scale_rewards` | divide by | from |
# |---|---|---|
# | `"group"` | the group's std | GRPO (DeepSeekMath) |
# | `"batch"` | the whole batch's std | Hu et al., REINFORCE++ style; more robust to easy groups |
# | `"none"` | nothing | Dr. GRPO: the std division biases toward too easy and too hard prompts |
#
# This is exercise 1.2.

# %%
# | export minirl/algo/advantages.py
"""Advantages: group-normalized (GRPO, no critic) and GAE (PPO, with a critic).

Simplified vs production: GRPO advantages follow TRL's GRPOTrainer exactly for one reward
function (no multi-objective aggregation, no NaN-aware means); GAE follows the classic
recursion over a right-padded completion, one value per token, as TRL's PPOTrainer and
veRL's `compute_gae_advantage_return`, without the KL-in-reward bookkeeping, which the
loop does when it builds per-token rewards.
"""
import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.config import SCALE_REWARDS


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a std.

    rewards: [N] float, N = B * G in generation order (rows i*G .. i*G+G-1 are the G
    completions of prompt i). Returns advantages [N] float:
      A = r - mean(r over its group)
      scale_rewards="group": A / (std(r over its group) + 1e-4)
      scale_rewards="batch": A / (std(r over all N) + 1e-4)
      scale_rewards="none":  A unchanged.
    std is torch's default unbiased std (divides by n - 1), as TRL. Raises ValueError if
    num_generations < 2, if N is not a multiple of num_generations, or for an unknown
    scale_rewards.
    """
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: GRPO compares completions within a group; "
                         "use num_generations >= 2")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: need a flat [B * num_generations] tensor "
                         f"with num_generations={num_generations}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {SCALE_REWARDS}")
    # BEGIN SOLUTION
    grouped = rewards.view(-1, num_generations)                           # [B, G]
    advantages = grouped - grouped.mean(1, keepdim=True)                  # [B, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.reshape(-1)                                         # [N]
    # END SOLUTION


# %%
from minirl.algo.advantages import group_advantages  # noqa: E402

r = torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.])  # two prompts, G = 4
for scale in ("group", "batch", "none"):
    print(f"{scale:>5}:", group_advantages(r, 4, scale).round(decimals=3).tolist())

# %% [markdown]
# **PPO** learns a critic V(s_t) that predicts the return from each token on, and uses
# Generalized Advantage Estimation (Schulman et al., 2016):
# δ_t = r_t + γ V(s_{t+1}) − V(s_t), A_t = δ_t + γλ A_{t+1}, and the critic's target is the
# return R_t = A_t + V(s_t). The reward is *terminal*: 0 on every token except the last
# completion token, which gets the verifier's score (minus an optional per-token KL
# penalty). With γ = 1 and λ = 0.95 the advantage of an early token is a blend of the final
# reward and the critic's guesses along the way. The recursion runs backwards over the
# completion and stops at its end (mask). This is exercise 1.3.

# %%
# | export minirl/algo/advantages.py
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over completion tokens.

    rewards, values: [B, C] float (per-token reward and critic value V(s_t));
    mask: [B, C], 1 on the completion's tokens, a prefix of each row (right padding).
    With V(s_t) = 0 beyond the last real token of a row:
      delta_t = rewards_t + gamma * V(s_{t+1}) - V(s_t)
      A_t     = delta_t + gamma * lam * A_{t+1}          (A = 0 beyond the row's end)
      R_t     = A_t + V(s_t)
    Returns (advantages [B, C], returns [B, C]), both 0 where mask is 0.
    """
    # BEGIN SOLUTION
    mask = mask.to(values.dtype)
    B, C = rewards.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(C)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t] * mask[:, t]
    returns = (advantages + values) * mask
    return advantages, returns
    # END SOLUTION


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - masked mean) / masked std over the batch's tokens; 0 where mask is 0.

    values, mask: [B, C]. The variance is the unbiased one (sum of squares over n - 1 for the
    n unmasked tokens), as TRL's and veRL's `masked_whiten` compute it.
    """
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards [B, C]: rewards[b] [B] on row b's last completion token, 0 elsewhere."""
    last = (mask.long().sum(1) - 1).clamp(min=0)                          # [B]
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return out.scatter(1, last[:, None], rewards[:, None]) * mask


# %%
from minirl.algo.advantages import gae  # noqa: E402

rew = torch.tensor([[0., 0., 1.], [0., 0., 0.]])
val = torch.tensor([[0.5, 0.6, 0.8], [0.3, 0.2, 0.0]])
msk = torch.tensor([[1, 1, 1], [1, 1, 0]])
adv, ret = gae(rew, val, msk)
print("advantages", adv.round(decimals=3).tolist(), "\nreturns   ", ret.round(decimals=3).tolist())

# %% [markdown]
# ## 4. The clipped objective and how to average it
#
# With ratio r_t = π(y_t) / π_old(y_t), PPO's per-token loss is
# −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t): once the policy has moved a token's
# probability by more than ε in the direction the advantage wants, the gradient stops. DAPO
# made the two sides different (ε_high > ε_low, "clip-higher") so that unlikely tokens with
# positive advantage can grow faster. This is exercise 1.4.
#
# Everything that differs between the members of the GRPO family lives in one module,
# `minirl/loss_types.py`, as one registry entry per `loss_type` (section 4.1). It uses tensor
# methods only, no `import torch`, so that the config can check a run's `loss_type` against it
# before torch loads.

# %%
# | export minirl/loss_types.py
"""The loss registry: each `loss_type` names one entry that holds every part of its loss.

A GRPO-family loss differs from its siblings in four parts, and an entry (`LossType`) holds all four:
- `objective(logps, ratio, advantages, epsilon, epsilon_high)` -> (per-token loss to minimize, tokens
  clipped below, tokens clipped above): PPO's clipped surrogate (`clipped_objective`) or CISPO's clipped,
  detached weight on the log-prob (`cispo_objective`);
- `normalise(per_token_loss, mask, max_completion_length)`: the per-token losses as one number;
- `micro_batch_weight(rows, total_rows, tokens, total_tokens)`: a micro-batch's share of the batch's
  loss (notebook 01, section 11.4), so that splitting the update never changes it;
- `rank_weight(local_tokens, global_tokens, local_rows, global_rows, world_size)`: the weight of one
  process's loss when W processes each compute it over their rows and average their gradients
  (notebook 04, section 3).
`LOSS_TYPES` maps a name to its entry; `register_loss_type` adds one and refuses an entry that lacks a
part; `loss_type_entry` reads one (AlgorithmConfig checks its `loss_type` with it when it is built).
`IMPORTANCE_SAMPLING_LEVELS` maps `importance_sampling_level` to how the ratio is formed: per token
(PPO, GRPO) or one per completion (GSPO).

The entries reproduce TRL 1.16's GRPOTrainer for "grpo", "bnpo", "dr_grpo", "dapo" and "cispo".
Written with tensor methods only (torch is not imported: `Tensor` is named for the annotations), so
the config checks a run's loss type before torch loads. Simplified: no SAPO, LUSPO or VESPO, and no
`delta` (TRL's two-sided clipping).
"""
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable

from minirl.runtime.validate import ConfigError

if TYPE_CHECKING:
    from torch import Tensor


def clipped_surrogate(ratio: "Tensor", advantages: "Tensor", epsilon_low: float = 0.2,
                      epsilon_high: float | None = None) -> "Tensor":
    """PPO's clipped per-token loss (to minimize).

    ratio: [B, T] (or [B, 1] for sequence-level ratios), pi/pi_old, > 0;
    advantages: broadcastable to ratio ([B, 1] or [B, T]). epsilon_high defaults to epsilon_low.
    Returns -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A), with the
    broadcast shape of ratio and advantages. Gradient flows through `ratio` only where the
    unclipped term is the minimum.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    # BEGIN SOLUTION
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    return -(ratio * advantages).minimum(clipped * advantages)
    # END SOLUTION


# %% [markdown]
# Then the per-token losses become one number, and here the GRPO family disagrees. TRL
# offers four `loss_type`s that differ only in this:
#
# | `loss_type` | loss = | effect |
# |---|---|---|
# | `"grpo"` | mean over sequences of (mean over the sequence's tokens) | each sequence weighs the same: a token of a long answer weighs less (length bias) |
# | `"bnpo"` | sum over all tokens / number of tokens in the batch | each token weighs the same |
# | `"dapo"` | sum over all tokens / tokens of the whole generation batch | as bnpo, but constant across gradient-accumulation slices (DAPO) |
# | `"dr_grpo"` | sum over all tokens / (B × max_completion_length) | a constant denominator: no length bias at all (Dr. GRPO) |
#
# Three normalizations cover the four (`bnpo` and `dapo` share one: they part ways only when
# the batch is split over processes, notebook 04). These are exercises 1.5, 1.6 and 1.7.

# %%
# | export minirl/loss_types.py
def sequence_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"grpo": the mean over rows of each row's mean over its own tokens.

    per_token_loss, mask: [B, C] (mask 0/1, in per_token_loss's dtype). An empty row (no
    completion token) contributes 0: its token count is clamped to 1. max_completion_length
    is not used. Returns a 0-dim tensor.
    """
    # BEGIN SOLUTION
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    # END SOLUTION


def token_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"bnpo", "dapo", "cispo": the sum of the masked losses over the batch's token count.

    per_token_loss, mask: [B, C]. The count is clamped to 1, so an all-masked batch gives 0,
    not NaN. max_completion_length is not used. Returns a 0-dim tensor.
    """
    # BEGIN SOLUTION
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1)
    # END SOLUTION


def max_length_mean(per_token_loss: "Tensor", mask: "Tensor", max_completion_length: int | None = None) -> "Tensor":
    """"dr_grpo": the sum of the masked losses over B * max_completion_length, a constant.

    per_token_loss, mask: [B, C]; max_completion_length defaults to C (pass it when the
    columns are fewer, as a micro-batch's are). Returns a 0-dim tensor.
    """
    # BEGIN SOLUTION
    length = mask.shape[1] if max_completion_length is None else max_completion_length
    return (per_token_loss * mask).sum() / (mask.shape[0] * length)
    # END SOLUTION


# %% [markdown]
# ### 4.1 One entry per loss type
#
# A loss type fixes two more numbers, both used later and both following from its
# normalization: how much a *part* of the batch counts when its loss is computed on its own.
# The update runs in micro-batches (section 11.4), and each micro-batch's loss is weighted by
# its share of the normalizer (of the rows for `grpo` and `dr_grpo`, of the tokens for the
# others), so that splitting the work never changes the loss. A data-parallel job (notebook
# 04) averages the gradients of W processes, each computing the loss over its rows; process
# r's loss is weighted by W times its share, except for `bnpo`, which TRL normalizes by each
# process's own tokens (weight 1: there, and only there, `bnpo` and `dapo` part ways).
#
# An entry holds all four parts, and `register_loss_type` refuses one that lacks a part: a
# new loss type cannot silently borrow another's weights. The importance ratio is chosen the
# same way, by `importance_sampling_level`: one per token, or one per completion (GSPO, the
# geometric mean of its token ratios; notebook 08 shows why MoE models need it).

# %%
# | export minirl/loss_types.py
def clipped_objective(logps: "Tensor", ratio: "Tensor", advantages: "Tensor", epsilon: float,
                      epsilon_high: float) -> tuple["Tensor", "Tensor", "Tensor"]:
    """PPO's clipped surrogate per token, and where it clipped: below 1 - epsilon with A < 0, above
    1 + epsilon_high with A > 0 (TRL's clip ratios). logps is not used (the ratio carries the gradient)."""
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return clipped_surrogate(ratio, advantages, epsilon, epsilon_high), low, high


def by_rows(rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """A part's share of a normalizer that counts rows ("grpo", "dr_grpo")."""
    return rows / total_rows


def by_tokens(rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """A part's share of a normalizer that counts tokens, both clamped to 1 as the normalization clamps them."""
    return max(tokens, 1) / max(total_tokens, 1)


def ranks_by_rows(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int, world_size: int) -> float:
    """W * N_r / N: a rank's weight when the batch's loss counts rows (0 for a rank with no rows)."""
    return world_size * by_rows(local_rows, global_rows, local_tokens, global_tokens)


def ranks_by_tokens(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int,
                    world_size: int) -> float:
    """W * T_r / T: a rank's weight when the batch's loss divides by the tokens of all ranks (TRL's
    `num_items_in_batch`)."""
    return world_size * by_tokens(local_rows, global_rows, local_tokens, global_tokens)


def each_rank_alone(local_tokens: int, global_tokens: int, local_rows: int, global_rows: int,
                    world_size: int) -> float:
    """1: each rank normalizes by its own tokens and the batch's loss is the mean of the ranks' ("bnpo")."""
    return 1.0


@dataclass(frozen=True)
class LossType:
    """Every part of one loss type (see the module docstring for each part's arguments)."""

    objective: Callable           # (logps, ratio, advantages, epsilon, epsilon_high) -> (loss [B, C], low, high)
    normalise: Callable           # (per_token_loss [B, C], mask [B, C], max_completion_length) -> 0-dim tensor
    micro_batch_weight: Callable  # (rows, total_rows, tokens, total_tokens) -> a micro-batch's weight
    rank_weight: Callable         # (local_tokens, global_tokens, local_rows, global_rows, world_size) -> weight


LOSS_TYPES: dict[str, LossType] = {}


def check_loss_type(name: str, entry) -> None:
    """ConfigError naming the loss type and the part unless every part of a LossType is a function of `entry`."""
    for part in fields(LossType):
        if not callable(getattr(entry, part.name, None)):
            raise ConfigError("loss_type", name, f"its entry's {part.name} is {getattr(entry, part.name, None)!r}, "
                                                 "not a function: every loss type needs all of "
                                                 f"{', '.join(f.name for f in fields(LossType))} (a LossType)")


def register_loss_type(name: str, entry: LossType) -> LossType:
    """Add (or replace) loss type `name`; ConfigError if the entry lacks a part."""
    check_loss_type(name, entry)
    LOSS_TYPES[name] = entry
    return entry


def loss_type_entry(name: str) -> LossType:
    """The entry of loss type `name`; ConfigError for an unknown name or an entry that lacks a part."""
    if name not in LOSS_TYPES:
        raise ConfigError("loss_type", name, f"use one of {', '.join(map(repr, LOSS_TYPES))}, or register yours "
                                             "(minirl.loss_types.register_loss_type)")
    check_loss_type(name, LOSS_TYPES[name])
    return LOSS_TYPES[name]


def aggregate_loss(per_token_loss: "Tensor", mask: "Tensor", loss_type: str = "dapo",
                   max_completion_length: int | None = None) -> "Tensor":
    """Reduce a per-token loss to a scalar as loss type `loss_type` does (its `normalise`).

    per_token_loss: [B, C] or [B, 1] (broadcast over C); mask: [B, C] of 0/1. Returns a 0-dim
    tensor. Raises ConfigError (a ValueError) for an unknown loss_type.
    """
    entry = loss_type_entry(loss_type)
    mask = mask.to(per_token_loss.dtype)
    return entry.normalise(per_token_loss.expand_as(mask), mask, max_completion_length)


def token_log_ratio(log_ratio: "Tensor", mask: "Tensor") -> "Tensor":
    """One log-ratio per token: [B, C] unchanged."""
    return log_ratio


def sequence_log_ratio(log_ratio: "Tensor", mask: "Tensor") -> "Tensor":
    """GSPO: one log-ratio per completion, the mean of its tokens' (the log of their geometric mean): [B, 1]."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable] = {"token": token_log_ratio, "sequence": sequence_log_ratio}

register_loss_type("grpo", LossType(objective=clipped_objective, normalise=sequence_mean,
                                    micro_batch_weight=by_rows, rank_weight=ranks_by_rows))
register_loss_type("bnpo", LossType(objective=clipped_objective, normalise=token_mean,
                                    micro_batch_weight=by_tokens, rank_weight=each_rank_alone))
register_loss_type("dr_grpo", LossType(objective=clipped_objective, normalise=max_length_mean,
                                       micro_batch_weight=by_rows, rank_weight=ranks_by_rows))
register_loss_type("dapo", LossType(objective=clipped_objective, normalise=token_mean,
                                    micro_batch_weight=by_tokens, rank_weight=ranks_by_tokens))


# %% [markdown]
# ### 4.2 Adding a loss type: CISPO
#
# The next loss type is one entry, and nothing else changes: not the loss, not the update,
# not the data-parallel roles of notebook 04. CISPO (MiniMax-M1; TRL 1.16's
# `loss_type="cispo"`) clips the importance *weight* instead of the objective, and stops its
# gradient: the per-token loss is −sg(min(r_t, ε_max)) · A_t · log π(y_t), so every token
# keeps a gradient (PPO drops the clipped ones) and a token whose ratio ran away counts at
# most ε_max. In TRL the cap is `epsilon_high` itself (ScaleRL recommends 5.0; unset, it
# falls back to `epsilon`, 0.2), and the losses are normalized as `dapo`'s. Your own loss
# type goes here the same way: write what differs, reuse the parts that do not, register.

# %%
# | export minirl/loss_types.py
def cispo_objective(logps: "Tensor", ratio: "Tensor", advantages: "Tensor", epsilon: float,
                    epsilon_high: float) -> tuple["Tensor", "Tensor", "Tensor"]:
    """CISPO's per-token loss, as TRL 1.16 computes it: -sg(min(ratio, epsilon_high)) * A * logps.

    The weight is detached: the gradient flows through logps alone, on every token. Clipped
    above: ratio > epsilon_high with A > 0 (TRL's `cispo_clip_ratio`); nothing is clipped below.
    """
    weight = ratio.clamp(max=epsilon_high).detach()
    high = (ratio > epsilon_high) & (advantages > 0)
    nothing = high.new_zeros(high.shape)                                        # CISPO never clips below
    return -weight * advantages * logps, nothing, high


register_loss_type("cispo", LossType(objective=cispo_objective, normalise=token_mean,
                                     micro_batch_weight=by_tokens, rank_weight=ranks_by_tokens))

# %%
from minirl.loss_types import LOSS_TYPES, LossType, register_loss_type, token_mean  # noqa: E402

print("loss types:", ", ".join(LOSS_TYPES))
dapo = LOSS_TYPES["dapo"]
try:                                       # an entry without its rank weight is refused when it is registered
    register_loss_type("half_done", LossType(objective=dapo.objective, normalise=token_mean,
                                             micro_batch_weight=dapo.micro_batch_weight, rank_weight=None))
except ValueError as err:
    print(f"{type(err).__name__}: {err}")

# %% [markdown]
# `policy_loss` puts the parts together, with the options TRL has: the importance ratio per
# token or per sequence, a k3 KL penalty to a frozen reference with coefficient `beta`, and
# optional per-token weights `is_weights` for the truncated importance sampling of notebook 02.
# The KL term is itself an average over tokens sampled from π_old, not from π;
# `use_bias_correction_kl=True` weights it by the same importance ratio π/π_old
# (DeepSeek-V3.2's correction, on by default in TRL 1.16, off by default here as in classic
# GRPO; with one update per batch the ratio is 1, so the KL's value is unchanged but its
# gradient gains a term KL · ∇log π). It also reports the clip fractions, as TRL logs them.

# %%
# | export minirl/algo/losses.py
"""Losses: the GRPO/PPO policy loss of any registered loss type, k3 KL, the value loss.

`policy_loss` reproduces TRL GRPOTrainer's `_compute_loss` for every entry of
`minirl.loss_types.LOSS_TYPES` ("grpo", "bnpo", "dr_grpo", "dapo", "cispo") and importance_sampling_level
in {"token", "sequence"} on one process without gradient accumulation. There, "dapo" (normalize by the
tokens of the whole generation batch) equals "bnpo" (normalize by the tokens of the micro-batch): they
differ only when a batch is split across accumulation steps or processes. minirl's own micro-batches
(section 11.4) are weighted by each loss type's `micro_batch_weight`, so that splitting the update never
changes its loss: "bnpo" keeps the batch's token count (TRL's would take each micro-batch's).
Simplified: no entropy masking, no off-policy masking.
"""
import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.loss_types import IMPORTANCE_SAMPLING_LEVELS, aggregate_loss, loss_type_entry
from minirl.runtime.validate import check_choice


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp. [B, C]."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def policy_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, *, epsilon: float = 0.2,
                epsilon_high: float | None = None, loss_type: str = "dapo",
                importance_sampling_level: str = "token", beta: float = 0.0, ref_logps: Tensor | None = None,
                max_completion_length: int | None = None, is_weights: Tensor | None = None,
                use_bias_correction_kl: bool = False) -> tuple[Tensor, dict[str, float]]:
    """The GRPO/PPO policy loss and its metrics, as TRL GRPOTrainer's `_compute_loss`.

    logps (with grad), old_logps, ref_logps, is_weights, mask: [B, C]; advantages: [B]
    (one per sequence, GRPO) or [B, C] (per token, PPO/GAE). The loss type's entry
    (`minirl.loss_types`) gives the objective and the normalization; importance_sampling_level
    the ratio (token, or sequence: GSPO).
    use_bias_correction_kl: multiply the k3 KL term by the importance ratio pi/pi_old (the
    token ratio, or the sequence ratio for GSPO; with its gradient), as TRL 1.16 does by
    default (DeepSeek-V3.2): the tokens were sampled from pi_old, so this makes the KL an
    estimate under pi. False: the classic GRPO k3 term.
    Returns (loss, metrics) with metrics "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "ratio_mean", and "kl" (the KL term as added, so corrected when
    use_bias_correction_kl) when ref_logps is given.
    """
    entry = loss_type_entry(loss_type)
    check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs)")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)                                   # [B, 1]
    log_ratio = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](logps - old_logps, mask)  # [B, C] or [B, 1]
    ratio = torch.exp(log_ratio)
    per_token, low, high = entry.objective(logps, ratio, advantages, epsilon, epsilon_high)    # [B, C] or [B, 1]
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = kl_k3(logps, ref_logps) if ref_logps is not None else None
    if kl is not None and use_bias_correction_kl:
        kl = kl * ratio                                                        # [B, C]
    if beta != 0.0:
        per_token = per_token + beta * kl
    loss = entry.normalise(per_token.expand_as(mask), mask, max_completion_length)

    with torch.no_grad():
        def share(flags):                    # TRL's global masked mean; [B, 1] counts per sequence
            flags = flags.to(mask.dtype)
            return (flags.mean() if flags.shape[1] == 1 and mask.shape[1] != 1
                    else masked_mean(flags.expand_as(mask), mask)).item()
        metrics = {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
                   "clip_ratio/region_mean": share(low | high), "ratio_mean": share(ratio)}
        if kl is not None:
            metrics["kl"] = masked_mean(kl, mask).item()
    return loss, metrics


# %% [markdown]
# PPO's critic has a clipped loss of its own: a value may move at most `cliprange_value` away
# from the old one per update.

# %%
# | export minirl/algo/losses.py
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float = 0.2,
               loss_type: str = "dapo") -> Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), aggregated like the policy loss.

    values (with grad), old_values, returns, mask: [B, C]. V_clipped = old_values +
    clamp(values - old_values, -cliprange_value, cliprange_value).
    """
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    per_token = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return aggregate_loss(per_token, mask, loss_type)


# %% [markdown]
# The source's clipping example in numbers: the old policy gave a token 0.20, the new one
# gives 0.24, so r = 1.2 = 1 + ε at ε = 0.2, exactly at the edge. A bit further and the
# gradient is gone (notebook 02 sweeps this).

# %%
from minirl.algo.losses import policy_loss  # noqa: E402
from minirl.loss_types import clipped_surrogate  # noqa: E402

for new in (0.22, 0.24, 0.26):
    r = torch.tensor([[new / 0.20]], requires_grad=True)
    loss = clipped_surrogate(r, torch.tensor([[1.0]]), 0.2)
    loss.backward()
    print(f"old 0.20 -> new {new:.2f}: ratio {r.item():.2f}, loss {loss.item():+.3f}, d loss/d ratio {r.grad.item():+.1f}")

# %% [markdown]
# How the aggregations weigh a short and a long completion with the same per-token loss:

# %%
from minirl.loss_types import aggregate_loss  # noqa: E402

per_tok = torch.ones(2, 4)
m2 = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
print(" | ".join(f"{lt}: {aggregate_loss(per_tok, m2, lt).item():.3f}" for lt in LOSS_TYPES))

# %% [markdown]
# ## 5. The roles: actor, reference, critic
#
# Three models take part in the update, and each becomes a **role**: an object that owns
# its model (and optimizer, if it trains) and answers the loop's questions about a batch.
# The `Actor` is the policy being trained: its log-probs before the update, the update
# itself, and the named weights the engine must receive. The `Reference` is a frozen copy
# of the starting policy, for the KL penalty. The `Critic` (PPO only) estimates values and
# trains toward the returns. Under FSDP (notebook 04) or inside a Ray actor (notebook 06) a
# role keeps the same methods; only what sits inside changes.
#
# The critic needs a model first. PPO needs V(s_t) for every completion token. We choose the
# clearest design that real systems also use: a **separate value model**, the policy's
# backbone (copied, so it starts from the warm start's features, as OpenRLHF and veRL
# initialize the critic from the actor or reward model) with a scalar linear head instead of
# the language-model head. Sharing one backbone between actor and critic saves memory but
# couples their gradients; with separate models each has its own optimizer, which is also
# how veRL places them as separate roles (notebook 06). The head starts at zero, so the
# first values are 0.

# %%
# | export minirl/models/critic.py
"""The PPO critic: a copy of the policy's transformer backbone with a scalar value head.

Simplified vs TRL's PPOTrainer / veRL: no separate reward model and no shared-backbone
option; the critic is initialized from the policy (the warm start) with a zero head.
"""
import copy

from torch import Tensor, nn

from minirl.algo.logprobs import position_ids_from_mask


class ValueModel(nn.Module):
    """V(s_t) for each completion token: backbone hidden state at position t-1 -> linear -> scalar."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy) -> "ValueModel":
        """A critic whose backbone is a copy of `policy`'s (e.g. Qwen2ForCausalLM.model)."""
        backbone = copy.deepcopy(getattr(policy, policy.base_model_prefix))
        device = next(policy.parameters()).device
        return cls(backbone, policy.config.hidden_size).to(device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int) -> Tensor:
        """input_ids, attention_mask: [B, P+C] -> values [B, C] float32 (the state before each token)."""
        C = num_completion_tokens
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
        return self.head(hidden[:, -C - 1:-1]).squeeze(-1).float()        # [B, C]


# %% [markdown]
# The actor. `update` runs `num_iterations` optimizer steps on one batch with the clipped
# objective of section 4. `backward` computes each step's gradient in micro-batches of rows
# of similar completion length, at most `max_tokens_per_microbatch` completion tokens each,
# weighted so that their gradients add up to the whole batch's (section 11.4 says why and
# how; this task's batches fit in one). A step whose loss or gradient norm is not finite is skipped
# (`skipped` in the metrics), leaving the weights and Adam's moments untouched: one bad batch
# must not poison hours of training. Its metrics also say how far the engine's behaviour
# log-probs are from the trainer's (`logprob_diff_abs`, the `ratio/...` statistics), the
# gauge notebook 02 is built around.

# %%
# | export minirl/roles/actor.py
"""The actor: the policy being trained, with its optimizer, answering the loop's three questions.

`logprobs(rollout)`: the trainer's log-probs of the sampled tokens before the update;
`update(experience)`: `num_iterations` clipped-objective steps, returning metrics;
`named_weights()`: what the weight sync pushes to the rollout engine. Under FSDP
(notebook 04) or inside a Ray actor (notebook 06) an actor keeps these methods, so the step
that calls them never changes.

Both run the batch in micro-batches of similar completion length (`micro_batches`, at most
`max_tokens_per_microbatch` completion tokens each, section 11.4), accumulating gradients
before one optimizer step; the loss, its normalization and its gradient are the whole
batch's. Simplified vs TRL's GRPOTrainer: one optimizer step per batch and iteration (TRL
can split a generation batch into several steps), no learning-rate schedule.
"""

import math

import torch
from torch import Tensor

from minirl.algo.logprobs import MicroBatchedLogprobs, masked_mean, micro_batches
from minirl.algo.losses import policy_loss
from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience, Rollout
from minirl.loss_types import loss_type_entry


def clipped_step(params, optimizer, max_grad_norm: float) -> tuple[bool, float]:
    """Clip the gradients in .grad and step, unless their norm is not finite. Returns (stepped, grad_norm)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    return True, grad_norm


def optimizer_step(params, optimizer, loss: Tensor, max_grad_norm: float) -> tuple[bool, float]:
    """backward, clip, step, unless the loss or the gradient norm is not finite. Returns (stepped, grad_norm).

    A non-finite batch leaves the weights and the optimizer's moments as they were.
    """
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False, math.nan
    loss.backward()
    return clipped_step(params, optimizer, max_grad_norm)

# %% [markdown]
# The gauge notebook 02 is built around, computed on every update: how far the rollout's
# behaviour log-probs are from the trainer's, as a ratio per token and as a mean log-prob
# gap.

# %%
# | export minirl/roles/actor.py
def ratio_statistics(trainer_logps: Tensor, behavior_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout's behaviour log-probs are from the trainer's, per token (notebook 02's lens).

    ratio = exp(trainer - behaviour) over the tokens where mask is 1: its min, max, std and
    the share outside [0.8, 1.25]; and the mean |trainer - behaviour| log-prob gap.
    """
    valid = mask.bool()
    ratio = torch.exp(trainer_logps - behavior_logps)[valid]
    if ratio.numel() == 0:
        return {}
    return {"logprob_diff_abs": masked_mean((trainer_logps - behavior_logps).abs(), mask).item(),
            "ratio/min": ratio.min().item(), "ratio/max": ratio.max().item(),
            "ratio/std": ratio.std().item() if ratio.numel() > 1 else 0.0,
            "ratio/outside": ((ratio < 0.8) | (ratio > 1.25)).float().mean().item()}


# %% [markdown]
# The actor itself: the policy and its optimizer, and the first thing the loop asks of it, the log-probs of a
# rollout, computed in micro-batches.

# %%
# | export minirl/roles/actor.py
class Actor:
    """The policy being trained and its AdamW optimizer."""

    def __init__(self, model, algorithm: AlgorithmConfig, optimizer: OptimizerConfig, sampling: SamplingConfig):
        self.model = model.eval()
        self.algorithm, self.sampling = algorithm, sampling
        self.max_grad_norm = optimizer.max_grad_norm
        self.max_tokens_per_microbatch = optimizer.max_tokens_per_microbatch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.learning_rate,
                                           weight_decay=optimizer.weight_decay)

    def micro_batches(self, rollout: Rollout) -> list[list[int]]:
        """The rows of each micro-batch of this rollout (section 11.4)."""
        return micro_batches(rollout.completion_mask.sum(1).tolist(), self.max_tokens_per_microbatch)

    def _shares_prompt(self) -> bool:
        return True                          # each group's prompt computed once (section 11.1)

    def _scorer(self, rollout: Rollout, requires_grad: bool) -> MicroBatchedLogprobs:
        return MicroBatchedLogprobs(self.model, rollout, self.micro_batches(rollout), self.sampling.temperature,
                                    self._shares_prompt(), requires_grad)

    def _micro_logprobs(self, scorer: MicroBatchedLogprobs, k: int, with_entropy: bool = False):
        return scorer(k, with_entropy)       # micro-batch k's (logps, entropy); notebook 04 weights its gradient here

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """log pi(y_t | ...) of every completion token under the current weights: [N, C] float32, 0 where masked."""
        scorer = self._scorer(rollout, requires_grad=False)
        out = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        for k, (rows, width) in enumerate(zip(scorer.rows, scorer.widths, strict=True)):
            out[rows, :width] = self._micro_logprobs(scorer, k)[0]
        return out * rollout.completion_mask

# %% [markdown]
# The gradient of one batch: `backward` runs the micro-batches, weighting each so that their
# gradients add up to the whole batch's, and stops backpropagating at the first non-finite
# loss; `_loss` is the policy loss with this run's settings.

# %%
# | export minirl/roles/actor.py
@add_to_class(Actor)
def backward(self, exp: Experience) -> dict:
    """The gradient of the batch's loss, accumulated in .grad over the micro-batches; returns the metrics.

    Each micro-batch's loss is weighted by its share of the batch's normalization (the loss
    type's `micro_batch_weight`), so the gradients add up to the whole batch's. A micro-batch whose
    loss is not finite ends the backward passes (the rest only run forward, for the metrics)
    and makes metrics["loss"] NaN. The metrics are computed once, over the whole batch.
    """
    ro, algo = exp.rollout, self.algorithm
    mask = ro.completion_mask                                                  # [N, C]
    logps, entropy = torch.zeros(mask.shape, device=mask.device), torch.zeros(mask.shape, device=mask.device)
    total_rows, total_tokens = len(ro), float(mask.sum())
    weigh = loss_type_entry(algo.loss_type).micro_batch_weight
    scorer, finite = self._scorer(ro, requires_grad=True), True
    for k, (rows, width) in enumerate(zip(scorer.rows, scorer.widths, strict=True)):
        part = lambda t, rows=rows, width=width: (  # noqa: E731
            t if t is None else t[rows] if t.dim() == 1 else t[rows, :width])
        lp, ent = self._micro_logprobs(scorer, k, with_entropy=True)            # [n, width] each
        loss, _ = self._loss(lp, lp.detach() if exp.old_logps is None else part(exp.old_logps),
                             part(exp.advantages), mask[rows, :width], part(exp.ref_logps), part(exp.is_weights))
        weight = weigh(len(rows), total_rows, float(mask[rows].sum()), total_tokens)
        finite = finite and bool(torch.isfinite(loss))
        if finite:
            (loss * weight).backward()
        logps[rows, :width], entropy[rows, :width] = lp.detach(), ent.detach()
    if finite:
        scorer.backward()                                                      # the shared prompts' share
    old = logps if exp.old_logps is None else exp.old_logps
    with torch.no_grad():                                                      # the batch's loss, as one pass
        loss, metrics = self._loss(logps, old, exp.advantages, mask, exp.ref_logps, exp.is_weights)
    return metrics | {"loss": loss.item() if finite else math.nan,
                      "entropy": masked_mean(entropy, mask).item(),
                      **ratio_statistics(old, ro.logprobs, mask)}              # rollout vs trainer (notebook 02)


@add_to_class(Actor)
def _loss(self, logps, old_logps, advantages, mask, ref_logps, is_weights):
    algo = self.algorithm
    return policy_loss(logps, old_logps, advantages, mask, epsilon=algo.epsilon, epsilon_high=algo.epsilon_high,
                       loss_type=algo.loss_type, importance_sampling_level=algo.importance_sampling_level,
                       beta=algo.beta if algo.algo == "grpo" else 0.0, ref_logps=ref_logps,
                       max_completion_length=self.sampling.max_completion_length, is_weights=is_weights,
                       use_bias_correction_kl=algo.use_bias_correction_kl)

# %% [markdown]
# The second question, `update`: the optimizer steps on one batch, each skipped when its
# loss or gradient norm is not finite. Then what the weight sync pushes (`named_weights`)
# and what a checkpoint saves beside the weights (`state_dict`).

# %%
# | export minirl/roles/actor.py
@add_to_class(Actor)
def update(self, exp: Experience) -> dict:
    """`num_iterations` optimizer steps on this batch; returns the last step's metrics.

    The first iteration's log-probs are pi_old when `exp.old_logps` is None (one update
    per batch: the ratio is 1 and only its gradient matters).
    """
    self.model.train()
    metrics = {}
    for _ in range(self.algorithm.num_iterations):
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.backward(exp)
        if math.isfinite(metrics["loss"]):
            stepped, grad_norm = clipped_step(self.model.parameters(), self.optimizer, self.max_grad_norm)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            stepped, grad_norm = False, math.nan
        metrics.update(grad_norm=grad_norm, skipped=int(not stepped))
    self.model.eval()
    return metrics


@add_to_class(Actor)
def named_weights(self):
    """(name, tensor) for every entry of the policy's state_dict: what the engine must load."""
    return self.model.state_dict().items()


@add_to_class(Actor)
def state_dict(self) -> dict:
    """The optimizer's state (the weights are saved in Hugging Face format, beside it)."""
    return {"optimizer": self.optimizer.state_dict()}


@add_to_class(Actor)
def load_state_dict(self, state: dict) -> None:
    self.optimizer.load_state_dict(state["optimizer"])

# %%
# | export minirl/roles/reference.py
"""The reference: a frozen copy of the initial policy, for the KL penalty.

Simplified vs TRL / veRL: a full copy in the same process and precision (TRL can instead
disable a LoRA adapter to recover the reference; veRL can colocate it with the actor).
"""

import copy

import torch
from torch import Tensor

from minirl.algo.logprobs import completion_logprobs
from minirl.data import Rollout


class Reference:
    """log pi_ref of the sampled tokens, from a frozen copy of the policy as it was at the start."""

    def __init__(self, model, temperature: float = 1.0):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.temperature = temperature

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> Tensor:
        """[N, C] float32 log-probs of the completion tokens under the reference."""
        return completion_logprobs(self.model, rollout.input_ids, rollout.attention_mask,
                                   rollout.num_completion_tokens, self.temperature,
                                   num_generations=rollout.num_generations)[0]

# %%
# | export minirl/roles/critic.py
"""The critic (PPO): a value model and its optimizer; values before the update, and its own update.

Simplified vs TRL's PPOTrainer / veRL: the critic is a copy of the policy's backbone with a
zero-initialized scalar head (`ValueModel.from_policy`), trained with the clipped value loss
in one step per batch.
"""

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.algo.losses import value_loss
from minirl.config import AlgorithmConfig, OptimizerConfig
from minirl.data import Experience, Rollout
from minirl.models.critic import ValueModel
from minirl.roles.actor import optimizer_step


class Critic:
    """V(s_t) for every completion token, fitted to the GAE returns."""

    def __init__(self, value_model: ValueModel, algorithm: AlgorithmConfig, optimizer: OptimizerConfig):
        self.model = value_model.eval()
        self.algorithm = algorithm
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(value_model.parameters(), lr=optimizer.value_learning_rate,
                                           weight_decay=optimizer.weight_decay)

    @torch.no_grad()
    def values(self, rollout: Rollout) -> Tensor:
        """[N, C] float32 values of the states before each completion token; 0 after the completion."""
        return self.model(rollout.input_ids, rollout.attention_mask, rollout.num_completion_tokens) \
            * rollout.completion_mask

    def update(self, exp: Experience) -> dict:
        """One clipped value-loss step toward `exp.returns`."""
        ro = exp.rollout
        self.model.train()
        values = self.model(ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
        loss = value_loss(values, exp.values, exp.returns, ro.completion_mask, self.algorithm.cliprange_value,
                          self.algorithm.loss_type)
        stepped, grad_norm = optimizer_step(self.model.parameters(), self.optimizer, loss, self.max_grad_norm)
        self.model.eval()
        return {"value_loss": loss.item(), "value_grad_norm": grad_norm, "value_skipped": int(not stepped),
                "value_mean": masked_mean(exp.values, ro.completion_mask).item()}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

# %% [markdown]
# Ask the roles about the batch sampled above: the actor's log-probs are the engine's (same
# weights, same precision), the fresh critic says 0 everywhere.

# %%
from minirl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from minirl.models.critic import ValueModel  # noqa: E402
from minirl.roles.actor import Actor  # noqa: E402
from minirl.roles.critic import Critic  # noqa: E402

actor = Actor(model, AlgorithmConfig(), OptimizerConfig(), SamplingConfig(num_generations=4))
critic = Critic(ValueModel.from_policy(model), AlgorithmConfig(algo="ppo"), OptimizerConfig())
print("max |actor - engine| log-prob:", (actor.logprobs(ro) * ro.completion_mask - ro.logprobs).abs().max().item())
print("critic values [N, C]:", critic.values(ro).abs().max().item())

# %% [markdown]
# ## 6. Synchronize, and the step
#
# Step 4 of the loop gets an interface of its own, because it is the step that changes most
# from stage to stage: here the engine lives in this process and copies the trainer's
# tensors; in notebook 04 the tensors are first gathered from shards (or a LoRA adapter is
# merged); in notebook 06 they are broadcast to another process. Every variant ends with the
# same check (the engine reports the version just pushed) and returns what it moved, so the
# sync's share of a step can be measured the same way everywhere (the source's symptom table
# flags synchronization above 5 % of the step).

# %%
# | export minirl/sync/base.py
"""Weight synchronization as an interface: push the trainer's weights into an engine, as a new version.

Step 4 of the loop. A `WeightSync` takes the actor's named tensors, gets them into the
rollout engine however the placement requires, and returns a `SyncReport` (the version the
engine now holds, how many tensors and bytes moved, how long it took). Stage 1 copies
in-process (`InProcessSync`); notebook 04 gathers FSDP-sharded tensors or merges LoRA
first; notebook 06 broadcasts across Ray actors. All of them end with the same check: the
engine reports the version that was pushed (`check_pushed`), and on request a check of the
weights it holds against the trainer's (`InProcessSync(verify=...)`: notebook 02 writes one,
`minirl.sync.checks.check_synchronization`).
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from torch import Tensor

from minirl.rollout.base import RolloutEngine, VersionMismatchError


@dataclass
class SyncReport:
    """What one synchronization did."""

    version: int      # the policy version the engine holds now
    tensors: int      # named tensors handed over
    bytes: int        # their size, in the trainer's dtype
    seconds: float    # wall-clock time of the push


class WeightSync(Protocol):
    def push(self, named_weights: Iterable[tuple[str, Tensor]], engine: RolloutEngine, version: int) -> SyncReport:
        """Load `named_weights` into `engine` as `version`; raise if the engine does not end up holding it."""
        ...


def check_pushed(engine: RolloutEngine, version: int) -> None:
    """The engine must report the version just pushed (an engine that ignored the push is caught here)."""
    if engine.version != version:
        raise VersionMismatchError(f"after pushing version {version}, {type(engine).__name__} reports version "
                                   f"{engine.version}: its load_weights did not take the new weights")


# %% [markdown]
# Stage 1's sync: the engine lives in this process, so a push copies the tensors, then checks
# the version the engine reports.

# %%
# | export minirl/sync/base.py
class InProcessSync:
    """Stage 1: the engine lives in the trainer's process and copies the trainer's tensors.

    verify: a check run after every push, verify(trainer_weights: {name: tensor}, engine) ->
    a list of problems, e.g. notebook 02's `check_synchronization`, which compares every weight
    the engine holds with the trainer's within the rounding of the engine's dtype (slower: it
    reads every tensor twice). Raises RuntimeError naming the problems.
    """

    def __init__(self, verify: Callable[[dict, RolloutEngine], list[str]] | None = None):
        self.verify = verify

    def push(self, named_weights, engine, version: int) -> SyncReport:
        start = time.perf_counter()
        named = [(name, tensor.detach()) for name, tensor in named_weights]
        engine.load_weights(named, version)
        check_pushed(engine, version)
        if self.verify is not None:
            problems = self.verify(dict(named), engine)
            if problems:
                raise RuntimeError("weight sync left the engine stale: " + "; ".join(problems))
        return SyncReport(version, len(named), sum(t.numel() * t.element_size() for _, t in named),
                          time.perf_counter() - start)

# %% [markdown]
# The update needs more than the rollout: the trainer's log-probs before the update, the
# reference's, the critic's values, the advantages, and (with notebook 02's correction) the
# importance weights. An `Experience` holds them beside the rollout; it splits and
# concatenates like any batch.

# %%
# | export minirl/data.py
@dataclass
class Experience(Batch):
    """One generation batch and everything computed from it before the update. N = B * G rows."""

    rollout: Rollout
    rewards: Tensor                      # [N] float, summed over reward functions
    advantages: Tensor | None = None     # [N] (GRPO) or [N, C] (PPO)
    old_logps: Tensor | None = None      # [N, C] the trainer's log-probs before the update (None: = logps.detach())
    ref_logps: Tensor | None = None      # [N, C] the frozen reference's
    values: Tensor | None = None         # [N, C] the critic's values before the update (PPO)
    returns: Tensor | None = None        # [N, C] the critic's targets (PPO)
    is_weights: Tensor | None = None     # [N, C] importance-sampling weights against the rollout (notebook 02)

    OPTIONAL = ("advantages", "old_logps", "ref_logps", "values", "returns", "is_weights")

    @property
    def group_size(self) -> int:
        return self.rollout.num_generations

    @property
    def version(self) -> int:
        return self.rollout.version

# %% [markdown]
# Now the step. `sample_prompts` draws B rows without replacement from a seeded generator;
# `score` calls the reward functions with TRL's signature and checks what they return: a
# wrong length, a non-numeric or non-finite reward is an error that names the reward
# function, and with `reward_errors="zero"` a function that fails on one sample gives that
# sample 0 and is counted in the metrics.

# %%
# | export minirl/train/step.py
"""One RL step over roles: generate -> score -> make experience -> advantages -> update -> sync.

`rl_step` is the loop body every stage runs. It talks to the three seams only through
their protocols: a rollout engine (`generate`, `load_weights`), the roles (`Actor`,
`Reference`, `Critic`), and a weight sync (`push`). Stage 1 passes plain in-process
objects; notebook 04 passes FSDP-wrapped roles on every rank; notebook 06 passes Ray
worker groups with the same methods. The step never changes, so what it computes never
changes with where it runs. Its middle, `learn` (experience -> correction -> advantages ->
update), is a function of its own: the asynchronous trainer of notebook 07, whose batches
come from a queue instead of an engine call, runs the same `learn` on them.

Simplified vs TRL's GRPOTrainer: the weighted sum of the reward functions must be a number
for every sample (TRL's skips a function's NaN, "does not apply"), one generation batch per
step, and the engine holds its own copy of the policy with a version (TRL samples with the
training model itself). PPO puts its KL penalty in the per-token
reward (as TRL's PPOTrainer); GRPO adds the k3 KL to the loss (as TRL's GRPOTrainer).
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from minirl.algo.advantages import gae, group_advantages, terminal_rewards, whiten
from minirl.config import AlgorithmConfig, RLConfig
from minirl.data import Experience, Rollout
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.runtime.timing import StageTimer
from minirl.tasks.rewards import combine_rewards, frac_reward_zero_std, reward_name


@dataclass
class Roles:
    """The models of a run, and the policy version the engine must hold for the next batch."""

    actor: Actor
    reference: Reference | None = None   # only with a KL penalty (beta > 0)
    critic: Critic | None = None         # only for PPO
    version: int = 0


def sample_prompts(rows: list[dict], n: int, generator: torch.Generator) -> list[dict]:
    """n distinct dataset rows, drawn with `generator` (all rows if the dataset is smaller)."""
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    picks = torch.randperm(len(rows), generator=generator)[:n].tolist()
    return [rows[i] for i in picks]

# %%
# | export minirl/train/step.py
def _call_reward(func, prompts, completions, columns, reward_errors, errors: list) -> list[float]:
    try:
        return list(func(prompts=prompts, completions=completions, **columns))
    except Exception as err:
        if reward_errors == "raise":
            raise RuntimeError(f"reward function {reward_name(func)} raised {type(err).__name__}: {err}; "
                               "fix it, or pass reward_errors='zero' to score failing samples 0") from err
    values = []
    for i in range(len(completions)):            # find the failing samples one by one
        try:
            values.append(float(func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                                     **{k: v[i:i + 1] for k, v in columns.items()})[0]))
        except Exception as err:
            errors.append(f"{reward_name(func)}[{i}]: {type(err).__name__}: {err}")
            values.append(0.0)
    return values


# %% [markdown]
# `score` calls each reward function through it and checks what came back: one finite float
# per completion, weighted as TRL's `reward_weights`.

# %%
# | export minirl/train/step.py
def score(reward_funcs: list, rollout: Rollout, rows: list[dict], reward_errors: str = "raise",
          reward_weights: list[float] | None = None) -> tuple[Tensor, dict]:
    """Stage 2: rewards [N] (the weighted sum over functions) and metrics (each function's mean, error count).

    Each function is called with TRL's signature, f(prompts, completions, **columns), where the
    columns are the dataset rows' other fields, repeated G times. A wrong number of rewards, a
    non-numeric or non-finite reward is an error naming the function; with reward_errors="zero"
    a failing sample scores 0 and is counted in metrics["reward_errors"]. reward_weights: one
    per function (TRL's `reward_weights`; None: 1 each); `rewards/<name>` is the function's
    unweighted mean, as TRL logs it.
    """
    G = rollout.num_generations
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    weights = [1.0] * len(reward_funcs) if reward_weights is None else list(reward_weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(reward_funcs)} reward functions: "
                         "give one weight per function")
    per_func, errors = [], []
    for func in reward_funcs:
        values = _call_reward(func, rollout.prompts, rollout.completions, columns, reward_errors, errors)
        name = reward_name(func)
        if len(values) != len(rollout.completions):
            raise ValueError(f"reward function {name} returned {len(values)} rewards for "
                             f"{len(rollout.completions)} completions: reward_funcs must return one float each")
        values = torch.tensor([_as_float(v) for v in values], dtype=torch.float32)
        if not torch.isfinite(values).all():
            if reward_errors == "raise":
                raise ValueError(f"reward function {name} returned non-numeric or non-finite rewards "
                                 f"({(~torch.isfinite(values)).sum().item()} of {len(values)}); return finite "
                                 "floats, or pass reward_errors='zero' to score them 0")
            bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
            errors += [f"{name}[{i}]: not a finite number" for i in bad]
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        per_func.append(values)
    total, metrics = combine_rewards(torch.stack(per_func, 1), weights,
                                     [reward_name(f) for f in reward_funcs])              # [N], per-function means
    metrics["reward_errors"] = len(errors)
    if errors:
        metrics["reward_error_examples"] = errors[:3]
    return total, metrics


def _as_float(value) -> float:
    """A reward as a float; NaN for anything that is not a number (None, a string, a list, ...)."""
    if isinstance(value, (str, bytes)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan

# %% [markdown]
# Between scoring and the update come the quantities the update needs, each in its own
# stage: `make_experience` asks the roles (no gradients), the behaviour corrections run
# (`correct_behaviour`: none yet; notebook 02 registers its truncated importance sampling
# in `BEHAVIOUR_CORRECTIONS`, applied when the config's `importance_sampling_correction` is on), and
# `compute_advantages` turns rewards into advantages, GRPO's group-normalized ones or PPO's
# GAE over per-token rewards (the KL penalty, for PPO, is part of the reward, as in TRL's
# PPOTrainer).

# %%
# | export minirl/train/step.py
@torch.no_grad()
def make_experience(rollout: Rollout, rewards: Tensor, roles: Roles, algorithm: AlgorithmConfig) -> Experience:
    """The log-probs and values the update needs, computed before it: old, reference, critic.

    old_logps are only needed when pi_old differs from the first update's own log-probs
    (several iterations per batch, importance-sampling correction, or PPO's KL-in-reward).
    """
    needs_old = (algorithm.num_iterations > 1 or algorithm.importance_sampling_correction
                 or (algorithm.algo == "ppo" and algorithm.beta > 0))
    return Experience(
        rollout, rewards,
        old_logps=roles.actor.logprobs(rollout) if needs_old else None,                   # [N, C]
        ref_logps=roles.reference.logprobs(rollout) if roles.reference is not None else None,
        values=roles.critic.values(rollout) if roles.critic is not None else None)


# Behaviour corrections, by name: (exp, algorithm) -> exp, each doing nothing unless the config turns it on.
# Notebook 02 registers truncated importance sampling; `learn` applies them in order.
BEHAVIOUR_CORRECTIONS: dict[str, Callable[[Experience, AlgorithmConfig], Experience]] = {}


def correct_behaviour(exp: Experience, algorithm: AlgorithmConfig) -> Experience:
    """Every registered behaviour correction, in order (notebook 02's truncated IS, when the config asks)."""
    for correction in BEHAVIOUR_CORRECTIONS.values():
        exp = correction(exp, algorithm)
    return exp


def compute_advantages(exp: Experience, algorithm: AlgorithmConfig, group=None) -> Experience:
    """GRPO: group-normalized [N]. PPO: terminal reward (minus beta * k1 KL per token), GAE, whitened [N, C].

    group: None in one process. In a data-parallel run (notebook 04) each rank holds whole
    groups, so "group" scaling stays local, but "batch" scaling divides by the std of the
    whole global batch: `group.all_gather` brings every rank's rewards.
    """
    if algorithm.algo == "grpo":
        G = exp.rollout.num_generations
        if algorithm.scale_rewards == "batch" and group is not None and group.world_size > 1:
            batch_std = group.all_gather(exp.rewards).std()                              # over all ranks' rewards
            exp.advantages = group_advantages(exp.rewards, G, "none") / (batch_std + 1e-4)
        else:
            exp.advantages = group_advantages(exp.rewards, G, algorithm.scale_rewards)
        return exp
    mask = exp.rollout.completion_mask
    token_rewards = terminal_rewards(exp.rewards, mask)                                   # [N, C]
    if algorithm.beta > 0:
        token_rewards = token_rewards - algorithm.beta * (exp.old_logps - exp.ref_logps) * mask
    advantages, exp.returns = gae(token_rewards, exp.values, mask, algorithm.gamma, algorithm.lam)
    exp.advantages = whiten(advantages, mask)
    return exp

# %% [markdown]
# And the step itself, in the source's order. It talks to the seams only through their
# methods: an engine, the roles, a sync. Read it top to bottom; this is the function every
# later stage runs. Its middle, from the batch and its rewards to the updated roles, is a
# function of its own, `learn`: notebook 07's asynchronous trainer takes its batches from a
# queue instead of an engine call and runs this same `learn` on them.

# %%
# | export minirl/train/step.py
def learn(roles: Roles, rollout: Rollout, rewards: Tensor, config: RLConfig, group=None,
          timer: StageTimer | None = None, correct=None) -> dict:
    """The update half of a step: experience -> correction -> advantages -> actor update (+ critic); its metrics.

    rollout: the batch, N = B * G rows; rewards: [N]. correct(exp) -> exp fills the
    behaviour correction (`is_weights`, and `old_logps` if it needs them); default
    `correct_behaviour` (notebook 02's truncated IS, when the config turns it on).
    Notebook 07 passes its corrections for stale batches here. timer: a StageTimer that
    gets the "reference", "advantages", "update" (and "update_critic") seconds.
    group: as in `rl_step`.
    """
    timer = StageTimer() if timer is None else timer
    with timer("reference"):
        exp = make_experience(rollout, rewards, roles, config.algorithm)
    with timer("advantages"):
        exp = correct_behaviour(exp, config.algorithm) if correct is None else correct(exp)
        exp = compute_advantages(exp, config.algorithm, group)
    with timer("update"):
        metrics = roles.actor.update(exp)
    if roles.critic is not None:
        with timer("update_critic"):
            metrics |= roles.critic.update(exp)
    return metrics


def batch_statistics(rollout: Rollout, rewards: Tensor, group=None) -> dict:
    """The record's numbers about a batch: its version, reward (mean, std), the share of groups whose rewards
    are all equal (`frac_reward_zero_std`, TRL's name: those groups have zero advantage and teach nothing),
    completion length (mean, longest), real prompt and completion tokens. group: as in `rl_step` (every
    rank's rows; each rank holds whole groups)."""
    lengths = rollout.completion_mask.float().sum(1)                                      # [N]
    prompt_tokens = rollout.prompt_mask.sum()
    if group is not None:                                          # the global batch's rows, every rank's
        rewards, lengths = group.all_gather(rewards), group.all_gather(lengths)
        prompt_tokens = group.all_gather(prompt_tokens.reshape(1)).sum()
    return {"generated_version": rollout.version, "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_reward_zero_std": frac_reward_zero_std(rewards, rollout.num_generations),
            "completion_length": lengths.mean().item(),
            "tokens/prompt": int(prompt_tokens), "tokens/completion": int(lengths.sum()),
            "completion_length_max": lengths.max().item()}                   # for MFU and stragglers (notebook 09)


def sync_and_record(roles: Roles, engine, sync, rollout: Rollout, rewards: Tensor, metrics: dict,
                    timer: StageTimer, group=None) -> dict:
    """The step's tail: push the actor's weights into `engine` as the next version (timed as "sync"), then the
    record: the update's `metrics`, the new version, the sync's bytes, the batch's statistics and every stage's
    seconds. Notebook 07's trainer ends its steps with it too. group: as in `rl_step`."""
    with timer("sync"):
        report = sync.push(roles.actor.named_weights(), engine, roles.version + 1)
    roles.version = report.version
    return (metrics | {"version": roles.version, "sync/bytes": report.bytes} | batch_statistics(rollout, rewards, group)
            | timer.times)


# %% [markdown]
# `rl_step` puts `learn` between the engine's `generate` and the sync's `push`: the four steps
# of the loop, in the source's order.

# %%
# | export minirl/train/step.py
def rl_step(roles: Roles, engine, sync, rows: list[dict], reward_funcs: list, config: RLConfig,
            generator: torch.Generator | None = None, group=None, reward_weights: list[float] | None = None) -> dict:
    """One pass generate -> score -> learn (experience, advantages, update) -> sync; returns the step's record.

    rows: this step's B dataset rows ({"prompt", **columns}); engine: any RolloutEngine;
    sync: any WeightSync. The record holds the update's metrics, the batch's reward and
    completion length (mean and longest), its real prompt and completion tokens
    (`tokens/prompt`, `tokens/completion`), the versions, and `time/<stage>` seconds for
    every stage.
    group: None in one process. In a data-parallel run (notebook 04) every rank calls rl_step
    on its share of the batch, and `group` (with `world_size` and `all_gather(tensor)`, the
    ranks' tensors concatenated along dim 0) makes the batch-wide numbers global: the
    "batch" reward std and the record's reward, length and token statistics.
    reward_weights: one per reward function (None: 1 each).
    """
    timer = StageTimer()
    with timer("generate"):
        rollout = engine.generate([r["prompt"] for r in rows], config.sampling, expected_version=roles.version,
                                  generator=generator)
    with timer("score"):
        rewards, metrics = score(reward_funcs, rollout, rows, config.algorithm.reward_errors, reward_weights)
    metrics |= learn(roles, rollout, rewards, config, group, timer)
    return sync_and_record(roles, engine, sync, rollout, rewards, metrics, timer, group)

# %% [markdown]
# ## 7. The run: a loop and its callbacks
#
# A run repeats the step and does a few other jobs around it: evaluate now and then, log
# every step, save checkpoints, show progress. Each job is a small **callback** that sees
# every record; the loop itself stays a few lines long (minGPT keeps its trainer short the
# same way). `train` checks its inputs, builds the state and hands it to `run_in_dir`, which
# opens the run directory, resumes, sets up the callbacks and calls `run`; later stages
# (the Ray driver of notebook 06) call `run_in_dir` with their own step functions. The loop,
# the callbacks that measure and watch, and `train` are here; the run directory, checkpoints
# and `run_in_dir` are bookkeeping (code: appendix).

# %%
# | export minirl/train/run.py
"""A run: build the roles, the engine and the sync; then step, and hand each record to callbacks.

`run(state, step_fn, callbacks, steps)` is the whole loop: it calls the step and passes each
record to the callbacks, which do everything else a run needs (evaluate, log JSON lines,
checkpoint, show progress, stop early). `train()` assembles the stage-1 run from a config
and a policy; later stages reuse `run` and the callbacks with their own step functions.

Simplified vs TRL's Trainer: gradients accumulate only over the update's micro-batches
(within one optimizer step), no learning-rate schedule, no distributed launcher (notebook 04
adds torchrun).
"""

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minirl.config import RLConfig
from minirl.models.critic import ValueModel
from minirl.models.policy import load_default_policy
from minirl.roles.actor import Actor
from minirl.roles.critic import Critic
from minirl.roles.reference import Reference
from minirl.rollout.registry import build_engine
from minirl.runtime.io import append_jsonl, atomic_write_json, write_jsonl
from minirl.runtime.model_loading import check_prompts
from minirl.runtime.rundir import RUN_FILE, RunDirError, open_run_dir
from minirl.runtime.validate import ConfigError
from minirl.sync.base import InProcessSync
from minirl.tasks.task import Task, arithmetic_task
from minirl.train.checkpoint import latest_checkpoint, remove_stale_temporaries, restore_checkpoint, save_checkpoint
from minirl.train.step import Roles, rl_step, sample_prompts

SAFE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "device")


# %% [markdown]
# The engine that `rollout_engine` names comes from a registry owned by the rollout layer: a
# name maps to a factory that imports its backend only when it builds it, and every stage
# builds its engine through `build_engine`. This notebook registers its two engines; notebook
# 04 registers vLLM and notebook 05 its paged engine, each in the notebook that builds it, so
# no stage's code names a backend.

# %%
# | export minirl/rollout/registry.py
"""The rollout-engine registry: a name maps to a factory, and the factory imports its backend.

`ENGINES` maps an engine's name (config.rollout.rollout_engine, the chapters' --rollout-engine)
to an `EngineEntry`: `build(config, model, tokenizer, device, **options)` returns that engine
holding a copy of `model` (version 0) in config.engine_dtype, importing its backend only then;
`problem(config)` says why this machine or run cannot use it (None: it can), without importing
anything heavy, so that a chapter refuses the flag before torch or a model loads
(`check_engine`). Every stage builds its engine with `build_engine`. Notebook 01 registers "hf"
and "shared_prefix", notebook 04 "vllm", notebook 05 "paged": each engine in the notebook that
builds it. options: what a stage adds (stage 4's vLLM settings); a factory takes those it uses.
"""
from dataclasses import dataclass
from typing import Callable

from minirl.config import RLConfig
from minirl.runtime.validate import ConfigError


def runs_anywhere(config: RLConfig) -> str | None:
    """The `problem` of an in-process engine: none (it runs wherever torch runs)."""
    return None


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine."""

    build: Callable     # (config, model, tokenizer, device, **options) -> RolloutEngine; imports its backend
    problem: Callable   # (config) -> why this run cannot use the engine, or None; imports nothing heavy


ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, problem: Callable = runs_anywhere):
    """Decorator: register the factory below it as engine `name` (replacing one of that name)."""
    def add(build: Callable) -> Callable:
        ENGINES[name] = EngineEntry(build, problem)
        return build
    return add


def check_engine(config: RLConfig) -> None:
    """ConfigError naming rollout_engine when no engine has that name, or when this run cannot use it."""
    name = config.rollout.rollout_engine
    if name not in ENGINES:
        raise ConfigError("rollout_engine", name, f"use one of {', '.join(map(repr, ENGINES))}")
    problem = ENGINES[name].problem(config)
    if problem is not None:
        raise ConfigError("rollout_engine", name, problem)


def build_engine(config: RLConfig, model, tokenizer, device=None, **options):
    """The engine config.rollout.rollout_engine names, holding a copy of `model` (version 0), on `device`
    (default config.run.device); ConfigError for an unknown name. options: passed to its factory."""
    name = config.rollout.rollout_engine
    if name not in ENGINES:
        raise ConfigError("rollout_engine", name, f"use one of {', '.join(map(repr, ENGINES))}")
    return ENGINES[name].build(config, model, tokenizer, config.run.device if device is None else device, **options)


@register_engine("hf")
def build_hf(config: RLConfig, model, tokenizer, device, **options):
    """HF `generate` on the B * G rows (section 2); options: none used."""
    from minirl.rollout.hf import HFEngine  # noqa: PLC0415 (the backend loads when built, not when named)
    return HFEngine(model, tokenizer, config.engine_dtype, device=device)


@register_engine("shared_prefix")
def build_shared_prefix(config: RLConfig, model, tokenizer, device, **options):
    """Each prompt prefilled once for its G samples (section 11); options: none used."""
    from minirl.rollout.shared_prefix import SharedPrefixEngine  # noqa: PLC0415 (loads when built)
    return SharedPrefixEngine(model, tokenizer, config.engine_dtype, device=device)

# %% [markdown]
# The parts of a run, built from its config: the roles for a model (and the engine, from the
# registry above).

# %%
# | export minirl/train/run.py
def build_roles(config: RLConfig, model) -> Roles:
    """Actor (always), Reference (when beta > 0), Critic (PPO) for `model`, on config.run.device in
    config.policy_dtype (a no-op for the float32 policy on a CPU)."""
    dtype = getattr(torch, config.policy_dtype)
    model.to(device=config.run.device, dtype=dtype).eval()
    reference = Reference(model, config.sampling.temperature) if config.algorithm.beta > 0 else None
    critic = None
    if config.algorithm.algo == "ppo":
        critic = Critic(ValueModel.from_policy(model).to(dtype), config.algorithm, config.optimizer)
    return Roles(Actor(model, config.algorithm, config.optimizer, config.sampling), reference, critic)



# %% [markdown]
# What a run holds between steps (`RunState`), the callbacks that watch it, and the loop that drives the step function.

# %%
# | export minirl/train/run.py
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

    def extra_state(self) -> dict:
        """What a later stage's state adds to a checkpoint beyond the roles and the generator ({} here;
        notebook 07 saves its queue)."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        """Restore what `extra_state` returned (nothing here)."""


class Callback:
    """Hooks of a run; each does one job. on_end runs last, also after an error (see state.interrupted)."""

    def on_start(self, state: RunState) -> None: ...

    def on_step(self, state: RunState, record: dict) -> None: ...

    def on_end(self, state: RunState) -> None: ...


class RunStopped(Exception):
    """Raised by StopAfter: the run stopped on purpose before its last step (a simulated crash)."""


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

# %% [markdown]
# The first callback measures: held-out accuracy at step 0 and every `eval_every` steps. The two
# that write a run directory, `JSONLLogger` (metrics.jsonl) and `Checkpointer`, are bookkeeping
# (code: appendix).

# %%
# | export minirl/train/run.py
class Evaluator(Callback):
    """Adds "accuracy" (eval_fn(model), 0..1) at step 0, every `every` steps and at the last step."""

    def __init__(self, eval_fn, every: int, last_step: int):
        self.eval_fn, self.every, self.last_step = eval_fn, every, last_step

    def evaluate(self, state: RunState, record: dict) -> None:
        start = time.perf_counter()
        record["accuracy"] = self.eval_fn(state.roles.actor.model)
        record["time/eval"] = time.perf_counter() - start

    def on_start(self, state):
        if self.every and state.step == 0:
            state.metrics.append({"step": 0, "version": state.roles.version})
            self.evaluate(state, state.metrics[-1])

    def on_step(self, state, record):
        if self.every and (state.step % self.every == 0 or state.step == self.last_step):
            self.evaluate(state, record)

# %% [markdown]
# Two callbacks for the person watching: a progress bar, and (next cell) a warning when the rewards give
# nothing to learn from. The bar first.

# %%
# | export minirl/train/run.py
class ProgressBar(Callback):
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.bar = total, desc, None

    def on_start(self, state):
        self.bar = tqdm(total=self.total, initial=state.step, desc=self.desc)

    def on_step(self, state, record):
        postfix = {"reward": f"{record['reward']:.2f}"} | ({"acc": f"{record['accuracy']:.2f}"}
                                                           if "accuracy" in record else {})
        self.bar.set_postfix(postfix)
        self.bar.update(1)

    def on_end(self, state):
        self.bar.close()

# %% [markdown]
# The warning: when in the first few steps every group's completions scored alike, every
# advantage is 0 and nothing is learned; it says so once and names the likely cause.
# `StopAfter` stops a run right after step k, as a crash would, so that resuming can be
# tried.

# %%
# | export minirl/train/run.py
class NoSignalWarning(Callback):
    """Says once, on stderr, when none of the first `steps` steps had a group with different rewards: the
    GRPO advantages were all 0, so nothing could be learned. Names the likely cause from the mean rewards."""

    def __init__(self, steps: int = 3):
        self.steps, self.seen, self.done = steps, [], False

    def on_step(self, state, record):
        if self.done or "frac_reward_zero_std" not in record:
            return
        self.seen.append(record)
        if record["frac_reward_zero_std"] < 1:
            self.done = True
        elif len(self.seen) >= self.steps:
            self.done = True
            print(no_signal_message(self.seen), file=sys.stderr, flush=True)


def no_signal_message(records: list[dict]) -> str:
    """The warning of `NoSignalWarning`: what happened in `records` and what to check."""
    means = {k.removeprefix("rewards/"): sum(r[k] for r in records) / len(records)
             for k in records[-1] if k.startswith("rewards/")}
    reward = sum(r["reward"] for r in records) / len(records)
    if all(v == 0 for v in means.values()):
        why = ("every completion scored 0: check that the policy's completions can match the reward's format "
               "(the math reward wants a final '#### N' or \\boxed{N}; a base model may need a chat or few-shot "
               "prompt), that the reward reads the right dataset column, or warm-start the policy first")
    else:
        why = ("every completion of a prompt scored the same (all right or all wrong): use prompts nearer the "
               "policy's skill, more num_generations, a higher temperature, or a graded reward")
    return (f"warning: no learning signal in the first {len(records)} steps: in every group all completions had "
            f"equal rewards (frac_reward_zero_std = 1), so every advantage was 0 (mean reward {reward:.3g}; "
            + ", ".join(f"{k} {v:.3g}" for k, v in means.items()) + f"). {why[0].upper()}{why[1:]}.")


class StopAfter(Callback):
    """Stop right after step k, as a crash would (no final save): raises RunStopped."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, state, record):
        if state.step >= self.step:
            raise RunStopped(f"stopped after step {state.step} (stop_after={self.step})")

# %% [markdown]
# Assembling a stage-1 run: the roles for the model, an engine holding version 0, an
# in-process sync, a generator for prompts and sampling seeds. `train` checks its inputs, wires
# them to a task and hands the state to `run_in_dir`, which adds the run directory (code: appendix).

# %%
# | export minirl/train/run.py
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
                   reward_weights=state.reward_weights)


def train(config: RLConfig, model=None, tokenizer=None, task: Task | None = None, *, out_dir=None,
          resume: bool = False, overwrite: bool = False, progress: bool = True, reward_funcs=None,
          reward_weights=None, dataset=None, eval_fn=None, stop_after: int | None = None,
          extra_callbacks: tuple = (), run_info: dict | None = None) -> list[dict]:
    """The stage-1 run: `config.run.steps` steps of `rl_step`; returns one record per step (and per evaluation).

    model/tokenizer: default the embedded warm-started policy. task: a `minirl.tasks.task.Task`
    (its training rows, reward functions and weights, and its held-out evaluation); default the
    embedded arithmetic task (`arithmetic_task()`). dataset, reward_funcs (with reward_weights)
    and eval_fn(model) -> 0..1 override the task's. With out_dir: run.json, metrics.jsonl,
    checkpoints/ and final/ there (the directory must be new, or resume=True continues its run
    from the newest intact checkpoint, or overwrite=True replaces it). stop_after=k raises
    RunStopped after step k. extra_callbacks run after the built-in ones (evaluator, logger,
    checkpointer, progress bar, the no-signal warning). run_info: more facts for run.json besides
    the settings (a script records the model's name).
    """
    if (model is None) != (tokenizer is None):
        raise ValueError("train: pass both model and tokenizer, or neither (the embedded policy)")
    if model is None:
        model, tokenizer, _ = load_default_policy(device=config.run.device, progress=progress)
    task = task or arithmetic_task()
    rows = task.train if dataset is None else list(dataset)
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    if "prompt" not in rows[0]:
        raise ValueError(f"dataset rows need a 'prompt' column; got columns {sorted(rows[0])}")
    check_prompts(tokenizer, [r["prompt"] for r in rows], getattr(model.config, "max_position_embeddings", None),
                  config.sampling.max_completion_length)     # at the door: unknown characters, too long
    if reward_funcs is None:
        reward_funcs, reward_weights = task.reward_funcs, task.reward_weights
    if not reward_funcs:
        raise ValueError("reward_funcs is empty: pass at least one f(prompts, completions, **columns)")
    eval_fn = eval_fn or task.eval_fn(tokenizer, task.max_new_tokens or config.sampling.max_completion_length)
    state = setup(config, model, tokenizer, rows, list(reward_funcs), reward_weights)
    return run_in_dir(state, stage1_step, tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite,
                      eval_fn=eval_fn, progress=progress, label="stage 1", extra_callbacks=extra_callbacks,
                      stop_after=stop_after, run_info=run_info)


# %% [markdown]
# Checkpoints (atomic, verified, exactly resumable), the run directory and the plot of a run's
# records are bookkeeping, not RL: code: appendix.

# %% [markdown]
# ## 8. Run it: does the policy learn?
#
# The claim to check: from the warm start, the default configuration gains at least 25
# points of held-out greedy accuracy within 5 minutes on two CPU cores, repeatably for a
# fixed seed. In full mode this cell launches the chapter script, the README's main command,
# with its own progress bar; in smoke mode it runs 20 steps inline, enough to see the loop
# turn.

# %%
import json  # noqa: E402

from minirl.config import RLConfig  # noqa: E402
from minirl.train.plots import plot_metrics  # noqa: E402
from minirl.train.run import train  # noqa: E402


def run_chapter(out: Path, *flags: str) -> list[dict]:
    """Run chapters/01_single_process.py into `out` (replacing an earlier run there), streaming its output."""
    script = ROOT / "chapters" / "01_single_process.py"
    proc = subprocess.Popen([sys.executable, str(script), "--out", str(out), "--overwrite", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    for chunk in iter(lambda: proc.stdout.read1(256), b""):   # the script's progress bar, live
        sys.stdout.write(decode(chunk))
    assert proc.wait() == 0, f"{script} failed"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


if SMOKE:
    model, tokenizer, _ = load_default_policy()
    grpo_metrics = train(RLConfig.from_flat(steps=20, eval_every=10), model, tokenizer, progress=False)
else:
    grpo_metrics = run_chapter(RUNS / "01_grpo")
evals = [m for m in grpo_metrics if "accuracy" in m]
grpo_summary = {"accuracy_before": evals[0]["accuracy"], "accuracy_after": evals[-1]["accuracy"],
                "steps": grpo_metrics[-1]["step"], "seconds": sum(m.get("time/step", 0) for m in grpo_metrics)}
plot_metrics(grpo_metrics, title="GRPO, embedded policy, one process")
plt.show()

# %% [markdown]
# Before and after, on the held-out problems the policy never trained on; and the run of section 0,
# which used the same seed for fewer steps, beside this one at the steps both evaluated:

# %%
gain = grpo_summary["accuracy_after"] - grpo_summary["accuracy_before"]
print(f"{'':28} | held-out greedy accuracy")
print(f"{'warm start (step 0)':28} | {grpo_summary['accuracy_before']:.3f}")
print(f"{'after ' + str(grpo_summary['steps']) + ' GRPO steps':28} | {grpo_summary['accuracy_after']:.3f}"
      f"   ({100 * gain:+.1f} points, {grpo_summary['seconds']:.0f} s of training)")
elapsed, reached = 0.0, None   # the first evaluation at +25 points, and the training seconds before it
for m in grpo_metrics:
    elapsed += m.get("time/step", 0.0)
    if reached is None and "accuracy" in m and m["accuracy"] - grpo_summary["accuracy_before"] >= 0.25:
        reached = (m["step"], elapsed)
print("first evaluation at +25 points:", "none" if reached is None else f"step {reached[0]}, {reached[1]:.0f} s")
print("claim: >= +25 points within 300 s on 2 CPU cores ->",
      "smoke mode, too short to judge" if SMOKE else ("met" if reached is not None and reached[1] <= 300
                                                      else "NOT met on this machine"))
again = {m["step"]: m["accuracy"] for m in grpo_metrics if "accuracy" in m}
common = [(s, a, again[s]) for s, a in first_evals if s in again]   # section 0's run: same seed, fewer steps
print("repeatable for a fixed seed: the evaluations both runs made,", ", ".join(f"step {s}: {a:.3f} / {b:.3f}"
                                                                              for s, a, b in common), "->",
      "identical" if all(a == b for _, a, b in common) else "NOT identical")

# %% [markdown]
# Where does the time go? Every record carries the seconds of each stage. The source says
# that in RL for LLMs generation usually dominates (its symptom table flags rollout above
# 80 % of the step). With a 4-token completion and a 1 M-parameter model the balance here
# may be different: the table shows which stage dominates on this machine. Notebook 09
# turns such shares into a diagnosis.

# %%
stages = ["generate", "score", "reference", "advantages", "update", "sync"]
totals = {s: sum(m.get(f"time/{s}", 0.0) for m in grpo_metrics) for s in stages}
whole = sum(totals.values())
print(f"{'stage':>10} | seconds | share")
for s in stages:
    print(f"{s:>10} | {totals[s]:7.2f} | {100 * totals[s] / whole:5.1f} %")
print("largest:", max(totals, key=totals.get))
share = totals["generate"] / whole
print(f"generation {100 * share:.1f} % of the step: {'above' if share > 0.8 else 'below'} the source's 80 % "
      f"rollout flag, so generation {'dominates' if share > 0.8 else 'does not dominate'} here")

# %% [markdown]
# ## 9. PPO beside GRPO
#
# The same step with `algo="ppo"`: `make_experience` adds the critic's values,
# `compute_advantages` builds terminal per-token rewards and runs GAE (γ = 1, λ = 0.95) and
# whitens the advantages, and `critic.update` fits the values to the returns with a clipped
# loss. Per step PPO costs more: a second model to run forward and to train, and twice the
# optimizer memory; that cost is why GRPO dropped the critic. Both runs below use the same
# seed, steps and evaluation schedule, so their accuracy curves can be read against each
# other.

# %%
if SMOKE:
    model, tokenizer, _ = load_default_policy()
    ppo_metrics = train(RLConfig.from_flat(algo="ppo", steps=20, eval_every=10), model, tokenizer,
                        progress=False)
else:
    ppo_metrics = run_chapter(RUNS / "01_ppo", "--algo", "ppo")
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
for name, metrics in (("GRPO", grpo_metrics), ("PPO", ppo_metrics)):
    points = [(m["step"], m["accuracy"]) for m in metrics if "accuracy" in m]
    left.plot(*zip(*points, strict=True), "o-", label=name)
left.set(xlabel="step", ylabel="held-out greedy accuracy", title="same seed, same steps")
left.legend()
steps_ppo = [m["step"] for m in ppo_metrics if "value_loss" in m]
loss = [m["value_loss"] for m in ppo_metrics if "value_loss" in m]
k = max(1, len(loss) // 20)
smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
right.plot(steps_ppo, loss, lw=0.5, alpha=0.4, label="per step")
right.plot(steps_ppo, smooth, lw=1.5, label=f"mean of {k}")
right.set(xlabel="step", ylabel="critic loss (clipped value loss)", title="PPO's critic")
right.legend()
plt.tight_layout()
plt.show()
accuracy = {name: [m["accuracy"] for m in ms if "accuracy" in m] for name, ms in (("GRPO", grpo_metrics),
                                                                                  ("PPO", ppo_metrics))}
print(f"final held-out accuracy: GRPO {accuracy['GRPO'][-1]:.3f}, PPO {accuracy['PPO'][-1]:.3f} "
      f"(difference {100 * (accuracy['PPO'][-1] - accuracy['GRPO'][-1]):+.1f} points)")
windows = [ppo_metrics[1:][i:i + max(1, len(loss) // 6)] for i in range(0, len(loss), max(1, len(loss) // 6))]
print(f"{'steps':>9} | batch reward p | ½·p(1-p) | critic loss")
below = 0
for w in windows:
    p = sum(m["reward"] for m in w) / len(w)
    critic = sum(m["value_loss"] for m in w) / len(w)
    below += critic < 0.5 * p * (1 - p)
    print(f"{w[0]['step']:>4}-{w[-1]['step']:<4} | {p:14.3f} | {0.5 * p * (1 - p):8.4f} | {critic:11.4f}")
print(f"critic loss below ½·p(1-p) in {below} of {len(windows)} windows")
critics = [sum(m["value_loss"] for m in w) / len(w) for w in windows]
peak = critics.index(max(critics))
print("critic loss by window: highest in window", peak + 1, "of", len(critics), "->",
      "smoke mode, too short to judge" if SMOKE else "rises, then falls" if 0 < peak < len(critics) - 1
      else "does not rise then fall")
per_step = {name: sum(m.get("time/step", 0) for m in ms) / ms[-1]["step"] for name, ms in (("GRPO", grpo_metrics),
                                                                                           ("PPO", ppo_metrics))}
print(f"seconds per step: GRPO {per_step['GRPO']:.3f}, PPO {per_step['PPO']:.3f} -> PPO costs "
      f"{per_step['PPO'] / per_step['GRPO']:.1f}x " + ("more" if per_step["PPO"] > per_step["GRPO"] else "NOT more"))

# %% [markdown]
# Read the critic's curve with care: its loss is not a score that should fall steadily. Its
# targets are returns built from a 0/1 reward, so even a critic that knew the success rate p
# of the batch exactly would be off by the spread of those rewards: its expected loss would
# be ½·p(1 − p) (half the variance of a 0/1 outcome), which is largest at p = ½. As the
# policy improves, p climbs from the warm start's level toward 1, so the loss first rises and
# then falls, following that curve; the table sets the two side by side, window by window.
# Where the critic's loss sits below ½·p(1 − p), it has learned more than the batch's
# average: which prompts are easier. On this task, where the reward is a single 0/1 at the end
# of a 4-token answer, that is about all a critic can add over GRPO's per-group baseline, and
# the accuracy plot shows how close the two algorithms land after the same steps.

# %% [markdown]
# ## 10. Bad input fails early, with the parameter's name
#
# A loop that runs for hours must fail in the first second when it is misconfigured, and
# must not corrupt its weights when one batch goes wrong. A few of the checks:

# %%
def show(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        print(f"{type(err).__name__}: {err}")


show(lambda: RLConfig.from_flat(num_generations=1))
show(lambda: RLConfig.from_flat(loss_type="ppo"))
show(lambda: RLConfig.from_flat(max_completion_length=0))
show(lambda: train(RLConfig.from_flat(steps=1), model, tokenizer, dataset=[], progress=False))
show(lambda: train(RLConfig.from_flat(steps=1, eval_every=0), model, tokenizer, progress=False,
                   reward_funcs=[lambda prompts, completions, **kw: [1.0]]))
show(lambda: train(RLConfig.from_flat(steps=1, eval_every=0), model, tokenizer, progress=False,
                   reward_funcs=[lambda prompts, completions, **kw: ["good"] * len(completions)]))

# %% [markdown]
# And a non-finite loss skips the optimizer step (logged as `skipped`), leaving the weights
# as they were:

# %%
from minirl.data import Experience  # noqa: E402

actor = Actor(model, AlgorithmConfig(), OptimizerConfig(), SamplingConfig(num_generations=2))
batch2 = HFEngine(model, tokenizer).generate(["1+2=", "3+4="], SamplingConfig(num_generations=2))
before = {k: v.clone() for k, v in model.state_dict().items()}
out = actor.update(Experience(batch2, torch.zeros(4), advantages=torch.full((4,), float("nan"))))
print("skipped:", out["skipped"], "| weights unchanged:",
      all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))

# %% [markdown]
# ## 11. Speed: share the prompt, then race TRL's GRPOTrainer
#
# The source's framework table puts TRL at "single process, HF generate, learners and
# prototypes". minirl's stage 1 is the same design, and `tests/test_trl_parity.py` checks
# that the two compute the same loss and gradients on the same batch. Doing the same
# arithmetic, they should also take about the same time: TRL's extra layers (Accelerate, the
# `Trainer`'s callbacks and logging, re-tokenizing the prompts, a sampler that repeats each
# prompt G times) should add little to a step that is spent in the model's forward and
# backward passes. Section 11.3 prints what is left of the gap after minirl's two savings, as
# a share of TRL's step; that remainder also holds the timing noise, so on a loaded machine
# it can come out above a tenth. A faster loop must therefore do less arithmetic, without
# changing what it computes.
#
# There is such arithmetic. The G = 8 completions of a prompt all begin with that prompt, and
# the simple path computes it 8 times, twice over: `generate` prefills B × G rows, and the
# update runs a forward and a backward over all B × G × (P + C) tokens. The source lists
# prefix caching among the core GRPO optimizations of rollout engines (keep the prompt's KV
# cache, reuse it for the G responses). The same idea works in the trainer.
#
# ### 11.1 The update: one prompt pass per group
#
# Run the B distinct prompts once with `use_cache=True`, keeping only the last position's
# logits (`logits_to_keep=1`): they predict the first completion token of all G samples.
# Repeat the KV cache G times, then run the N = B × G completions, all but their last token,
# against it, with the full attention mask and the positions derived from it. Nothing is
# approximated: every completion token attends to the same keys and values as in one long
# forward pass, so the log-probs agree up to float rounding. So do the gradients: the
# repeated cache is a differentiable copy, and backpropagation sums the G copies' gradients
# into the one prompt pass, which is the chain rule for an activation used G times.
# `completion_logprobs(..., num_generations=G)` takes this path; the loop passes
# the rollout's `num_generations`.

# %%
# | export minirl/algo/logprobs.py
from transformers.modeling_outputs import CausalLMOutputWithPast

# the forward argument and output field holding the KV cache: `cache` since transformers 5.2x
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def group_prompts(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int) -> tuple[Tensor, Tensor]:
    """Each group's prompt once: rows 0, G, 2G, ... of prompt_ids, prompt_mask [N, P] -> [B, P] each.

    Raises ValueError if N is not a multiple of G or if the rows of a group have different
    prompts (ids or mask): a Rollout's layout, G consecutive completions per prompt, is required.
    """
    (N, P), G = prompt_ids.shape, num_generations
    if N % G:
        raise ValueError(f"shared_prefix_logits: {N} rows are not groups of num_generations={G}; pass "
                         "B * num_generations rows, or num_generations=1 (no sharing)")
    firsts = prompt_ids[::G], prompt_mask[::G]                                            # [B, P] each
    for name, full, first in zip(("input_ids", "attention_mask"), (prompt_ids, prompt_mask), firsts, strict=True):
        if not torch.equal(full.view(-1, G, P), first[:, None].expand(-1, G, P)):
            raise ValueError(f"completion_logprobs: num_generations={G} but the rows of a group have different "
                             f"prompts ({name} differs in the first {P} columns): pass G consecutive completions "
                             "per prompt (a Rollout's order), or num_generations=1")
    return firsts


def shared_prefix_logits(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                         num_generations: int) -> Tensor:
    """The logits that predict the last C tokens, computing each group's shared prompt once.

    input_ids, attention_mask: [N, P+C], N = B * G rows in groups of G = num_generations
    consecutive rows that have the same prompt (identical first P columns of ids and mask, as
    a Rollout lays them out); prompts left-padded, completions right-padded.
    Returns logits [N, C, V] in the model's dtype, where [:, t] predicts completion token t:
    the same values (up to float rounding) and gradients as the rows' logits[:, P-1:-1] from
    one forward pass with position ids from the mask, for about 1/G of the prompt's compute.
    Needs a model whose cache supports `batch_repeat_interleave` (HF DynamicCache).
    Raises ValueError if N is not a multiple of G, if there is no prompt column, or if the rows
    of a group have different prompts.
    """
    T, G, C = input_ids.shape[1], num_generations, num_completion_tokens
    P = T - C
    if P < 1 or C < 1:
        raise ValueError(f"shared_prefix_logits: num_completion_tokens={C} leaves no prompt/completion in "
                         f"{T} columns; need 1 <= num_completion_tokens < {T}")
    prompt_ids, prompt_mask = group_prompts(input_ids[:, :P], attention_mask[:, :P], G)   # [B, P]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].repeat_interleave(G, 0)                                    # [N, 1, V]
    if C == 1:
        return first
    cache = getattr(out, CACHE_ARG)
    cache.batch_repeat_interleave(G)                                                      # [B, ...] -> [N, ...]
    positions = position_ids_from_mask(attention_mask)[:, P:-1]                           # [N, C-1]
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=positions,
                 use_cache=False, **{CACHE_ARG: cache}).logits                            # [N, C-1, V]
    return torch.cat([first, rest], 1)                                                    # [N, C, V]


# %% [markdown]
# Check it on a real batch from the warm start: 16 prompts × 8 samples, both paths, the
# log-probs and the gradients of the same (random) loss. A group whose rows do not share
# their prompt is refused rather than silently mis-scored.

# %%
from minirl.algo.logprobs import completion_logprobs  # noqa: E402  (now with num_generations)
from minirl.rollout.hf import HFEngine  # noqa: E402

model, tokenizer, _ = load_default_policy()
G = 8
prompts10 = [r["prompt"] for r in task.rows("train")[:16]]
SAMPLING = SamplingConfig(num_generations=G, max_completion_length=4)
batch = HFEngine(model, tokenizer).generate(prompts10, SAMPLING, generator=torch.Generator().manual_seed(0))
ids, mask, C = batch.input_ids, batch.attention_mask, batch.num_completion_tokens
loss_weights = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(1)) * batch.completion_mask
model.train()


def update_pass(num_generations):
    """Forward + backward of a random loss over the batch; returns (log-probs, gradients)."""
    model.zero_grad(set_to_none=True)
    logps, _ = completion_logprobs(model, ids, mask, C, with_entropy=True, num_generations=num_generations)
    (logps * loss_weights).sum().backward()
    return logps.detach(), [p.grad.clone() for p in model.parameters()]


one_pass, one_grads = update_pass(1)
shared, shared_grads = update_pass(G)
m = batch.completion_mask.bool()
grad_err = max((a - b).abs().max().item() for a, b in zip(one_grads, shared_grads, strict=True))
grad_scale = max(a.abs().max().item() for a in one_grads)
print(f"rows {ids.shape[0]} = {len(prompts10)} prompts x G={G}, prompt columns P={batch.prompt_ids.shape[1]}, C={C}")
print(f"max |log p(one pass) - log p(shared prefix)| = {(one_pass - shared)[m].abs().max().item():.1e}")
print(f"max |gradient difference| / max |gradient| = {grad_err / grad_scale:.1e}")
show(lambda: completion_logprobs(model, ids, mask, C, num_generations=2 * G))   # groups of 16 span two prompts

# %% [markdown]
# What it saves, per update (forward and backward, median of interleaved repeats). The
# prompt columns shrink from N × P to B × P tokens, 1/G of them; the completion tokens are
# all still computed, so the whole pass shrinks less than G-fold.

# %%
import statistics  # noqa: E402

from tqdm.auto import tqdm  # noqa: E402


def median_ms(fns: dict, reps: int, desc: str | None = None) -> dict:
    """Run each function `reps` times, interleaved; median milliseconds per function (with `desc`: a progress bar)."""
    times = {name: [] for name in fns}
    for _ in tqdm(range(reps), desc=desc, disable=desc is None):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t[1:] if len(t) > 2 else t) for name, t in times.items()}


REPS = 3 if SMOKE else 15
update_ms = median_ms({"one pass over N rows": lambda: update_pass(1), "shared prefix": lambda: update_pass(G)}, REPS)
model.eval()
P = batch.prompt_ids.shape[1]
print(f"{'update (forward + backward)':30} | prompt tokens computed | ms (median; of {REPS} repeats, the first dropped)")
for (name, ms), tokens in zip(update_ms.items(), (ids.shape[0] * P, len(prompts10) * P), strict=True):
    print(f"{name:30} | {tokens:>22} | {ms:8.1f}")
speedup = update_ms["one pass over N rows"] / update_ms["shared prefix"]
print(f"speedup of the update: {speedup:.2f}x, {'less' if speedup < G else 'NOT less'} than G = {G}-fold "
      f"(the prompt tokens alone shrink {ids.shape[0] * P / (len(prompts10) * P):.0f}-fold)")

# %% [markdown]
# The source's figure for prefix caching, against the count:

# %%
saved = 1 - 1 / G
agree = 0.70 <= saved <= 0.80      # the rule: inside the source's range
print("quantity | source | minirl | agree? | why")
print(f"prefix compute saved, G = {G} | 70-80 % | {100 * saved:.1f} % (prompt tokens {ids.shape[0] * P} -> "
      f"{len(prompts10) * P}) | {'yes' if agree else 'no'} | computing a prompt once instead of G times saves 1 - 1/G = {100 * saved:.1f} %; "
      "the source's range does not follow from G = 8 alone (a cache of whole blocks, as vLLM's, recomputes a "
      "prompt's partial last block, which lowers the saving for short prompts)")

# %% [markdown]
# ### 11.2 Generation: prefill once, sample in a plain loop
#
# The rollout engine can share the prompt in the same way: prefill each prompt once, repeat
# its cache G times, then decode the N rows token by token. HF `generate` wraps every decoding
# step in machinery (input preparation, logits processors, stopping criteria, bookkeeping)
# that a 1 M-parameter model feels, so the loop is written out: softmax(logits / τ), one
# multinomial draw per row, a pad token after EOS, stop when every row has ended. The
# behaviour log-probs are the log-softmax of the same logits / τ that were sampled from, in
# the rollout copy's own precision, exactly as before.
#
# What differs from `HFEngine`, precisely:
#
# - **The samples, possibly.** With one seed both engines draw the same random numbers in the
#   same order (one multinomial over the N rows per token), but the prefill of B rows instead
#   of B × G rounds differently, and a draw that falls on the boundary between two tokens can
#   flip; from there that row continues differently (the cell below prints how many came out
#   identical). The distribution is the same: softmax of
#   the same logits / τ.
# - **Only plain sampling.** `generate` would also apply the model's `generation_config`
#   (repetition penalty, min-p, ...) and other stopping rules; the loop samples exactly
#   softmax(logits / τ) and stops at EOS or `max_new_tokens`, which is what the RL loss
#   assumes anyway. (Both paths use no top-k and no top-p.)
# - **The model's cache must support `batch_repeat_interleave`** (HF's DynamicCache does).
#
# Everything else (shapes, masks, the behaviour log-probs, padding after EOS, the version
# check, determinism for a seeded generator) is the same.

# %% [markdown]
# Every hand-written decoding loop in minirl (this engine's, which notebook 07's in-flight
# producer also runs, and notebook 05's paged engine and its speculative verifier) samples a
# token and records its behaviour log-prob the same way, so that the way is written once:
# `sample_tokens`.

# %%
# | export minirl/rollout/sampling.py
"""One token per row and its behaviour log-prob: the sampling step every hand-written decoding loop shares.

HF `generate` (HFEngine) and vLLM sample inside their own code; minirl's own loops (the
shared-prefix engine, which notebook 07's in-flight producer also runs, and the paged engine
of notebook 05 and its speculative verifier) call `sample_tokens`, so a behaviour log-prob
means the same thing in every engine: log_softmax(logits / temperature) at the sampled token.

Simplified: plain sampling (no top-k, top-p or repetition penalty), which is what the RL
loss assumes.
"""

import torch
from torch import Tensor


def sample_tokens(logits: Tensor, temperature: float | Tensor,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One token per row from softmax(logits / temperature); temperature 0 picks the argmax.

    logits: [R, V] (upcast to float32); temperature: a float, or [R] per row. Returns
    (tokens [R] long, logprobs [R] float32), logprobs = log_softmax(logits / temperature)
    at the token (at temperature 1 for greedy rows). `generator` draws the samples (the
    global RNG when None); greedy rows draw too, so a row's temperature never shifts the
    random stream of the others.
    """
    logits = logits.float()                                                              # [R, V]
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(logits.shape[0])  # [R]
    greedy = t == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, t)[:, None], -1)        # [R, V]
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)           # [R]
    tokens = torch.where(greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


# %%
# | export minirl/rollout/shared_prefix.py
"""The shared-prefix engine: prefill each prompt once, repeat its KV cache G times, sample in a plain loop.

The G completions of a GRPO group all begin with the same prompt; HF `generate` over the
B * G repeated prompts computes that prompt G times. This engine computes it once, repeats
the cache, and decodes the N = B * G rows token by token with nothing but a softmax and a
multinomial draw per step: about twice as fast as `HFEngine` on the tiny policy (notebook
01, section 10), for the same distribution.

Its loop is the one decoding loop of minirl's in-process engines: notebook 07's in-flight
weight updates run it with a hook (`before_forward`) that may load new weights between two
decoding steps, instead of a loop of their own.

Simplified: plain sampling only (softmax(logits / temperature), no top-k / top-p, no
repetition penalty or other `generation_config` processors); the model's cache must support
`batch_repeat_interleave` (HF's DynamicCache does).
"""

import torch
from torch import Tensor

from minirl.algo.logprobs import CACHE_ARG, position_ids_from_mask
from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, draw_seed, make_rollout
from minirl.rollout.hf import HFEngine
from minirl.rollout.sampling import sample_tokens


class SharedPrefixEngine(HFEngine):
    """HFEngine's copy and checks, with the prefill shared by each prompt's G samples.

    `generate` also takes `before_forward`: a callable run before every forward pass (the
    prefill and each decoding step), which may load new weights into the engine
    (notebook 07's in-flight updates; the Rollout then carries the engine's version at the end).
    """

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None, before_forward=None) -> Rollout:
        check_request(self, prompts, sampling, expected_version)
        prompt_ids, prompt_mask, completion_ids, logprobs = self.sample(prompts, sampling, draw_seed(generator),
                                                                        before_forward)
        return make_rollout(self.tokenizer, prompts, sampling.num_generations, prompt_ids, prompt_mask,
                            completion_ids, logprobs, self.version)

    def sample(self, prompts: list[str], sampling: SamplingConfig, seed: int | None, before_forward=None):
        tok, G = self.tokenizer, sampling.num_generations
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sampler = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        completion_ids, logprobs = sample_shared_prefix(
            self.model, enc.input_ids, enc.attention_mask, G, sampling.max_completion_length, sampling.temperature,
            tok.eos_token_id, tok.pad_token_id, sampler, before_forward)                  # [N, C] each
        return (enc.input_ids.repeat_interleave(G, 0), enc.attention_mask.repeat_interleave(G, 0),
                completion_ids, logprobs)

# %%
# | export minirl/rollout/shared_prefix.py
@torch.no_grad()
def sample_shared_prefix(model, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int, max_new_tokens: int,
                         temperature: float, eos_token_id: int, pad_token_id: int,
                         generator: torch.Generator | None = None, before_forward=None) -> tuple[Tensor, Tensor]:
    """Sample G completions per prompt with a KV cache, prefilling each prompt once.

    prompt_ids, prompt_mask: [B, P], each prompt once, left-padded. Rows i*G .. i*G+G-1 of
    the result continue prompt i. Each step samples from softmax(logits.float() / temperature)
    with torch.multinomial (using `generator`, or the global RNG when None); a row that has
    emitted EOS gets pad_token_id from then on; the loop stops when every row has emitted EOS
    or after max_new_tokens. Returns (completion_ids [N, C] long, logprobs [N, C] float32),
    C <= max_new_tokens, where logprobs are log_softmax(logits.float() / temperature) at the
    sampled tokens: the behaviour log-probs (also at pad positions; the caller masks them).
    before_forward: None, or a callable run before each of the C forward passes (the prefill,
    whose logits give token 0, and the step that gives each later token); it may load new
    weights into `model` in place. The KV cache of earlier tokens is kept as it was computed.
    """
    G = num_generations
    if before_forward is not None:
        before_forward()
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, CACHE_ARG)
    cache.batch_repeat_interleave(G)                                           # [B, ...] -> [N, ...]
    logits = out.logits[:, -1].repeat_interleave(G, 0)                         # [N, V]
    mask = prompt_mask.repeat_interleave(G, 0)                                 # [N, P], grows by one per step
    position = mask.sum(1, keepdim=True) - 1                                   # [N, 1] the last prompt token's
    unfinished = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        token, logp = sample_tokens(logits, temperature, generator)            # [N] each
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        logprobs.append(logp)                                                  # [N]
        unfinished = unfinished & (token != eos_token_id)
        if not unfinished.any() or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        position = position + 1
        if before_forward is not None:
            before_forward()                                                   # e.g. newer weights (notebook 07)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                       use_cache=True, **{CACHE_ARG: cache}).logits[:, -1]     # [N, V]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)                    # [N, C] each


# %% [markdown]
# Compare the engines. Same seed: how many of the 128 completions come out identical, and do
# the behaviour log-probs still equal the trainer's? Different seeds: do the two sample the
# same distribution (mean reward and mean sampled log-prob over several batches, with their
# standard errors)? Then the time per batch.

# %%
from minirl.algo.logprobs import masked_mean  # noqa: E402
from minirl.rollout.shared_prefix import SharedPrefixEngine  # noqa: E402

engines = {"hf": HFEngine(model, tokenizer), "shared_prefix": SharedPrefixEngine(model, tokenizer)}
same_seed = {name: e.generate(prompts10, SAMPLING, generator=torch.Generator().manual_seed(0))
             for name, e in engines.items()}
identical = sum(a == b for a, b in zip(same_seed["hf"].completions, same_seed["shared_prefix"].completions, strict=True))
print(f"same seed: {identical} of {len(same_seed['hf'].completions)} completions identical")
for name, ro in same_seed.items():
    with torch.no_grad():
        trainer_logps, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
    gap = (ro.logprobs - trainer_logps * ro.completion_mask).abs().max()
    print(f"{name:>13}: max |behaviour - trainer| log-prob {gap:.1e}")

answers = [r["answer"] for r in task.rows("train")[:16] for _ in range(G)]
print(f"{'engine':>13} | mean reward   | mean log p per token | batches of 128")
n_batches = 4 if SMOKE else 20
dist = {}
for k, (name, e) in enumerate(engines.items()):
    rewards, logps = [], []
    for seed in range(n_batches):
        ro = e.generate(prompts10, SAMPLING, generator=torch.Generator().manual_seed(1000 * k + seed))  # disjoint seeds
        rewards.append(sum(task.reward(ro.prompts, ro.completions, answer=answers)) / len(answers))
        logps.append(masked_mean(ro.logprobs, ro.completion_mask).item())
    se = lambda xs: statistics.stdev(xs) / len(xs) ** 0.5  # noqa: E731
    print(f"{name:>13} | {statistics.mean(rewards):.3f} ± {se(rewards):.3f} | {statistics.mean(logps):+.3f} ± "
          f"{se(logps):.3f}       | {n_batches}")
    dist[name] = [(statistics.mean(xs), se(xs)) for xs in (rewards, logps)]
within = [abs(a - b) <= 3 * (sa ** 2 + sb ** 2) ** 0.5 for (a, sa), (b, sb) in zip(*dist.values(), strict=True)]
print("same distribution (each mean within 3 combined standard errors of the other's):",
      "smoke mode, too few batches to judge" if SMOKE else "yes" if all(within) else "NO",
      f"(reward {within[0]}, log p {within[1]})")

generate_ms = median_ms({name: (lambda e=e: e.generate(prompts10, SAMPLING)) for name, e in engines.items()}, REPS)
print(f"generate 128 completions: HF generate {generate_ms['hf']:.1f} ms, shared prefix "
      f"{generate_ms['shared_prefix']:.1f} ms ({generate_ms['hf'] / generate_ms['shared_prefix']:.2f}x)")

# %% [markdown]
# ### 11.3 The race: minirl against TRL's GRPOTrainer
#
# `benchmarks/grpo_vs_trl.py` runs both trainers interleaved in one process (a step of one,
# then a step of the other) on the same policy, prompts and settings; its docstring lists
# what is compared. TRL's large-model defaults are switched off there so that both do the
# same arithmetic: bf16 autocast (slow on a CPU) and gradient checkpointing (the forward pass
# runs again in backward; notebook 03 measures that trade). On this path TRL 1.16 generates
# with HF `generate` over the B × G repeated prompts and scores all B × G full sequences,
# which is minirl's simple path. So the gap between the two should be what sections 11.1 and
# 11.2 saved, plus TRL's extra layers. The cell runs a short benchmark (one torch thread, as
# this notebook) and puts its gap beside those savings (skipped in smoke mode);
# `benchmarks/README.md` has longer runs, with one and two threads.

# %%
bench = Path("../benchmarks/grpo_vs_trl.py") if Path("../benchmarks").exists() else Path("benchmarks/grpo_vs_trl.py")
bench_out = Path(os.environ.get("MINIRL_RUNS", "runs")) / "01_bench"
if SMOKE:
    print("smoke mode: skipping the TRL benchmark")
elif not bench.exists():
    print(f"{bench} not found: the benchmark is not part of this checkout")
else:
    proc = subprocess.Popen([sys.executable, str(bench), "--quick", "--threads", "1", "--out", str(bench_out)],
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:                       # its lines as they come (it takes a while): the progress
        if not line.startswith("{"):               # not TRL's log dict
            print(line, end="", flush=True)
    assert proc.wait() == 0, f"{bench} failed"
    result = json.loads((bench_out / "summary.json").read_text())
    trl_ms, minirl_ms = 1000 * result["trl_median_seconds"], 1000 * result["minirl_median_seconds"]
    saved_update = update_ms["one pass over N rows"] - update_ms["shared prefix"]
    saved_generate = generate_ms["hf"] - generate_ms["shared_prefix"]
    print(f"\n{'per step (ms)':44} | measured")
    print(f"{'TRL GRPOTrainer':44} | {trl_ms:8.1f}")
    print(f"{'minirl':44} | {minirl_ms:8.1f}")
    print(f"{'gap':44} | {trl_ms - minirl_ms:8.1f}")
    print(f"{'  saved by sharing the prompt in the update':44} | {saved_update:8.1f}  (section 11.1)")
    print(f"{'  saved by sharing the prefill in generation':44} | {saved_generate:8.1f}  (section 11.2)")
    print(f"{'  rest (TRL overhead, noise)':44} | {trl_ms - minirl_ms - saved_update - saved_generate:8.1f}")
    rest = (trl_ms - minirl_ms - saved_update - saved_generate) / trl_ms
    print(f"TRL's extra layers (the rest): {100 * rest:+.1f} % of TRL's step -> "
          + ("less than a tenth" if rest < 0.1 else "NOT less than a tenth")
          + " (the rest also holds the timing noise: see the load average above)")

# %% [markdown]
# ### 11.4 Long completions: the update at the cost of real tokens
#
# A batch is a rectangle: N rows by C completion columns, C the longest completion. With the
# 4-token answers of this task every completion is about as long as the longest, and padding
# costs nothing. Reasoning rollouts are not like that. Their lengths have a long tail: most
# completions stop early, a few run to `max_completion_length`. Notebook 05's long-tail
# policy reproduces it (its random weights emit EOS early on most rows and late on a few): of
# the 64 completions below, capped at 256 tokens, the mean is a few dozen tokens and the longest near the cap, so a
# forward and backward over the rectangle computes several times the tokens there are (the cell
# counts them), most of it padding. TRL pads the same way. Before the update ran in micro-batches,
# `benchmarks/grpo_vs_trl.py --workload long` measured it at about 20 s of minirl's 25-28 s step
# for that reason (`benchmarks/README.md`).
#
# There are two standard cures. **Packing** (notebook 08, section 5) concatenates sequences
# into rows of a token budget, with attention kept inside each sequence. **Length
# bucketing** sorts rows by length and cuts them into micro-batches, each padded only to its
# own longest row; gradients accumulate over the micro-batches, as they do over TRL's
# `gradient_accumulation_steps`. We bucket, for two reasons. Packing a group would
# mean either running its prompt once per completion (throwing away section 11.1's saving)
# or a tree-shaped mask (the prompt, then G branches). Also, without a variable-length
# attention kernel (flash attention's, a GPU's) the attention of a packed row is computed
# densely over the whole row, masked entries included, and on a CPU that costs more than
# the padding it saves. Rows sorted by length keep the plain causal mask, and the prompt's
# KV cache still serves them.
#
# `micro_batches` is the plan: take the rows longest first, give each micro-batch the width
# of its first row and as many rows as fit under `max_tokens_per_microbatch` (rows × width,
# padding included).

# %%
# | export minirl/algo/logprobs.py
def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped by completion length into micro-batches of at most `max_tokens` padded completion tokens.

    lengths[i]: row i's completion tokens (the sum of its mask). Rows are taken longest first;
    a micro-batch is as wide as its first row and takes the next rows while rows x width stays
    within max_tokens, so each is padded only to its own longest completion. A row longer than
    max_tokens gets a micro-batch of its own. max_tokens=0: one micro-batch of every row (the
    padded path). Returns each micro-batch's row indices in ascending order; ties are broken by
    index, so the plan is deterministic.
    """
    if max_tokens < 0:
        raise ValueError(f"micro_batches: max_tokens={max_tokens} must be >= 0 (0: one micro-batch)")
    if max_tokens == 0:
        return [list(range(len(lengths)))]
    batches, width = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = max(lengths[i], 1)
    return [sorted(rows) for rows in batches]


# %% [markdown]
# A micro-batch holds rows of many prompts, so section 11.1's trick needs a change. Running
# each micro-batch's prompts in its own pass would compute a prompt once per micro-batch that
# holds one of its completions. Keeping the prompt pass's graph alive while micro-batch after
# micro-batch runs its backward breaks the rule DDP and FSDP live by: one backward per forward.
# Instead, `PromptCache` runs the B prompts once without gradient and keeps their KV cache (and
# the logits at each prompt's last position, which predict every completion's first token) as
# leaf tensors. Each micro-batch gathers its rows' prompts from those leaves, so its backward
# leaves ∂loss/∂cache in the leaves' `.grad`, summed over the micro-batches. At the end,
# `backward` runs the prompt pass again, this time with gradient, and sends those sums back
# through it. By the chain rule the parameters then get the gradient one pass over the whole
# batch gives them. The price is a second forward over the B prompts (B × P tokens), and
# every forward is followed by its own backward.

# %%
# | export minirl/algo/logprobs.py
from transformers import DynamicCache

from minirl.data import Rollout


class PromptCache:
    """Each group's prompt run once for a batch scored in micro-batches; its outputs are leaves that collect gradient.

    prompt_ids, prompt_mask: [B, P], each group's prompt once (a Rollout's rows 0, G, 2G, ...).
    The prompt pass runs without gradient. Every layer's keys and values ([B, kv_heads, P, d])
    and the logits at the last position ([B, 1, V]) are kept as leaves (requires_grad when
    `requires_grad`). `logits` scores rows against them; `backward` runs the pass again with
    gradient and backpropagates what the micro-batches' backward passes left in the leaves'
    .grad. Assumes a deterministic forward (no dropout, as in Qwen2 and Llama) and an HF
    DynamicCache (`.layers[i].keys / .values`).
    """

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, requires_grad: bool = True):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        with torch.no_grad():
            last, kv = self._run()
        self.last = last.requires_grad_(requires_grad)                                    # [B, 1, V]
        self.kv = [(k.requires_grad_(requires_grad), v.requires_grad_(requires_grad)) for k, v in kv]

    def _run(self):
        out = self.model(input_ids=self.prompt_ids, attention_mask=self.prompt_mask, use_cache=True,
                         position_ids=position_ids_from_mask(self.prompt_mask), logits_to_keep=1)
        return out.logits[:, -1:], [(layer.keys, layer.values) for layer in getattr(out, CACHE_ARG).layers]

    def logits(self, input_ids: Tensor, attention_mask: Tensor, prompt_of: Tensor,
               num_completion_tokens: int) -> Tensor:
        """The logits predicting the last C tokens of n rows, row i continuing prompt `prompt_of[i]`.

        input_ids, attention_mask: [n, P+C] (the rows' prompt columns, then C completion columns);
        prompt_of: [n] long in [0, B). Returns [n, C, V] in the model's dtype, as shared_prefix_logits.
        """
        P, C = self.prompt_ids.shape[1], num_completion_tokens
        first = self.last[prompt_of]                                                      # [n, 1, V]
        if C == 1:
            return first
        cache = DynamicCache(ddp_cache_data=[(k[prompt_of], v[prompt_of]) for k, v in self.kv])   # [n, ...]
        rest = self.model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], use_cache=False,
                          position_ids=position_ids_from_mask(attention_mask)[:, P:-1],
                          **{CACHE_ARG: cache}).logits                                    # [n, C-1, V]
        return torch.cat([first, rest], 1)                                                # [n, C, V]

    def backward(self) -> None:
        """The prompt pass again, with gradient, backpropagating the gradient the micro-batches left on its outputs."""
        leaves = [self.last] + [t for pair in self.kv for t in pair]
        if all(t.grad is None for t in leaves):
            return                                                                        # no backward ran
        last, kv = self._run()
        outputs = [last] + [t for pair in kv for t in pair]
        pairs = [(out, leaf.grad) for out, leaf in zip(outputs, leaves, strict=True) if leaf.grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


# %% [markdown]
# `MicroBatchedLogprobs` puts the pieces together for a Rollout. Each micro-batch is cut to
# its own width: the columns past its longest completion are padding for all of its rows and
# are never computed. A plan of one micro-batch (a batch within the budget, such as this
# task's 128 × 4 tokens) is section 11.1's single graph, with no second prompt pass. The
# actor's `update` and `logprobs` both go through it.

# %%
# | export minirl/algo/logprobs.py
class MicroBatchedLogprobs:
    """The log-probs of a Rollout's completions, one micro-batch (a list of rows, from `micro_batches`) at a time.

    `self(k)` returns micro-batch k's (logps [n_k, w_k] float32, entropy or None), w_k its width:
    its longest completion, at least 2 columns when the prompt is shared (so that every
    micro-batch makes one completion pass, whatever its rows), at most the rollout's C.
    Its prompts are computed:
      - without sharing (share_prompt False or num_generations 1): with each row, one pass;
      - sharing, one micro-batch of every row: `shared_prefix_logits` over the whole batch;
      - sharing, several micro-batches: once for all of them (`PromptCache`, made at the first
        call); then call `backward()` after the micro-batches' backward passes.
    Values equal one pass over the padded batch up to float rounding; so do the gradients.
    """

    def __init__(self, model, rollout: Rollout, plan: list[list[int]], temperature: float = 1.0,
                 share_prompt: bool = True, requires_grad: bool = True):
        if temperature <= 0:
            raise ValueError(f"MicroBatchedLogprobs: temperature={temperature} must be > 0")
        self.model, self.rollout, self.temperature, self.requires_grad = model, rollout, temperature, requires_grad
        self.share = share_prompt and rollout.num_generations > 1
        self.ids, self.mask = rollout.input_ids, rollout.attention_mask                          # [N, P+C]
        lengths, C = rollout.completion_mask.sum(1), rollout.num_completion_tokens                 # [N]
        device = rollout.completion_ids.device
        self.rows = [torch.as_tensor(rows, dtype=torch.long, device=device) for rows in plan]
        self.widths = [min(C, max(int(lengths[rows].max()), 2 if self.share else 1)) for rows in self.rows]
        self.prompts = None

    def __len__(self) -> int:
        return len(self.rows)

    def tokens(self) -> int:
        """Completion tokens the micro-batches compute, padding included: sum of rows x width."""
        return sum(len(rows) * width for rows, width in zip(self.rows, self.widths, strict=True))

    def __call__(self, k: int, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        ro, rows, w = self.rollout, self.rows[k], self.widths[k]
        P, G = ro.prompt_ids.shape[1], ro.num_generations
        ids, mask = self.ids[rows, :P + w], self.mask[rows, :P + w]                             # [n, P+w]
        if self.share and len(self.rows) > 1:
            if self.prompts is None:
                self.prompts = PromptCache(self.model, *group_prompts(ro.prompt_ids, ro.prompt_mask, G),
                                           self.requires_grad)
            logits = self.prompts.logits(ids, mask, rows // G, w).float() / self.temperature   # [n, w, V]
        else:
            logits = completion_logits(self.model, ids, mask, w, self.temperature, G if self.share else 1)
        logps = selective_log_softmax(logits, ids[:, -w:])                                      # [n, w]
        return logps, (entropy_from_logits(logits) if with_entropy else None)

    def backward(self) -> None:
        """With a PromptCache: backpropagate through the prompts what the micro-batches' backward passes left."""
        if self.prompts is not None:
            self.prompts.backward()


# %% [markdown]
# Each micro-batch's loss must be weighted so that the weighted losses add up to the batch's.
# Every aggregation of section 4 is a sum of per-row terms over one normalizer, so the weight
# is the micro-batch's share of that normalizer: of the rows for `grpo` (a mean of per-row
# means) and `dr_grpo` (B × max_completion_length), of the tokens for `bnpo`, `dapo` and
# `cispo`. Each loss type's entry holds its weight (`micro_batch_weight`, section 4.1), and
# `Actor.backward` multiplies each micro-batch's loss by it. The loss of the update is then
# the same, and so is its gradient: micro-batching changes how the work is cut, never what is
# computed. (TRL's `bnpo` normalizes by each micro-batch's own tokens, so there it changes
# with `gradient_accumulation_steps`; ours does not.)

# %% [markdown]
# Check it, and measure it, on the long-tail workload: notebook 05's policy (7.6 M parameters,
# random weights), few-shot prompts of ~70 tokens, G = 8 completions each, at most 256 new
# tokens (smoke mode: 2 prompts, at most 64). The same `Actor.backward` runs twice on the same
# batch, with `max_tokens_per_microbatch=0` (one pass, padded to the longest completion, as
# TRL computes it) and with the default budget. The cell compares the gradients and counts
# the completion tokens each computes.

# %%
from minirl.algo.logprobs import MicroBatchedLogprobs  # noqa: E402
from minirl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from minirl.data import Experience  # noqa: E402
from minirl.roles.actor import Actor  # noqa: E402
from minirl.rollout.engine.workloads import few_shot_prompts, load_long_tail_policy  # noqa: E402

t0 = time.perf_counter()
long_model, long_tok, _ = load_long_tail_policy()
LONG = SamplingConfig(num_generations=8, max_completion_length=64 if SMOKE else 256)
long_batch = SharedPrefixEngine(long_model, long_tok).generate(few_shot_prompts(2 if SMOKE else 8, length=64), LONG,
                                                               generator=torch.Generator().manual_seed(0))
print(f"generated {len(long_batch)} completions, {time.perf_counter() - t0:.0f} s; now the gradients, both ways",
      flush=True)
long_exp = Experience(long_batch, torch.zeros(len(long_batch)),
                      advantages=torch.randn(len(long_batch), generator=torch.Generator().manual_seed(1)))
lengths = long_batch.completion_mask.sum(1)
BUDGET = OptimizerConfig().max_tokens_per_microbatch
long_actors = {"padded (one pass)": Actor(long_model, AlgorithmConfig(), OptimizerConfig(max_tokens_per_microbatch=0),
                                          LONG),
               f"micro-batches (<= {BUDGET})": Actor(long_model, AlgorithmConfig(), OptimizerConfig(), LONG)}


def long_backward(actor):
    """Forward and backward of the actor's loss over the long batch; returns the gradients (no optimizer step)."""
    long_model.train()
    long_model.zero_grad(set_to_none=True)
    actor.backward(long_exp)
    long_model.eval()
    return [p.grad.clone() for p in long_model.parameters()]


long_grads = [long_backward(a) for a in tqdm(long_actors.values(), desc="gradients")]
long_err = max((a - b).abs().max().item() for a, b in zip(*long_grads, strict=True)) / max(g.abs().max().item()
                                                                             for g in long_grads[0])
long_ms = median_ms({name: (lambda a=a: long_backward(a)) for name, a in long_actors.items()}, 1 if SMOKE else 3,
                    desc="timing both updates")
B, P = len(long_batch) // LONG.num_generations, long_batch.prompt_ids.shape[1]
print(f"policy: {sum(p.numel() for p in long_model.parameters()) / 1e6:.1f} M parameters")
print(f"{len(long_batch)} completions of {B} prompts ({P} prompt columns): mean {lengths.float().mean():.0f} tokens, "
      f"longest {lengths.max()}; {int(lengths.sum())} real completion tokens")
print(f"max |gradient difference| / max |gradient| = {long_err:.1e}")
print(f"{'update (forward + backward)':28} | micro-batches | completion tokens computed | prompt forwards | seconds")
long_rows = {}
for name, actor in long_actors.items():
    scorer = MicroBatchedLogprobs(long_model, long_batch, actor.micro_batches(long_batch))
    long_rows[name] = (len(scorer), scorer.tokens())
    prompt_forwards = 1 if len(scorer) == 1 else 2                 # PromptCache: without, then with gradient
    print(f"{name:28} | {len(scorer):13} | {scorer.tokens():26} | {prompt_forwards:15} | {long_ms[name] / 1000:7.2f}")
(_, padded_tokens), (_, packed_tokens) = long_rows.values()
padded_s, packed_s = (long_ms[name] / 1000 for name in long_actors)
print(f"the padded rectangle: {padded_tokens / int(lengths.sum()):.1f}x the real completion tokens; micro-batches "
      f"remove {100 * (padded_tokens - packed_tokens) / (padded_tokens - int(lengths.sum())):.0f} % of its padding")
follows = 2 / 3 <= (padded_s / packed_s) / (padded_tokens / packed_tokens) <= 3 / 2
print("the time falls", "about as the tokens do" if follows else "NOT as the tokens do",
      "(time saving within a factor 1.5 of the token saving)")
print(f"saving: {padded_tokens / packed_tokens:.1f}x fewer completion tokens, the update {padded_s / packed_s:.1f}x "
      f"faster ({padded_s:.2f} s -> {packed_s:.2f} s)")

# %% [markdown]
# The gradients agree to float32 rounding, so nothing is approximated. Most of the padding is
# gone: what remains is each micro-batch's padding to its own longest row, plus the second
# prompt pass. The time falls about as the tokens do, because on a CPU a forward pass costs
# about its number of tokens. Memory falls too. The largest forward pass holds at most
# `max_tokens_per_microbatch` completion tokens instead of N × C, and activations are what
# a training step's peak is made of (notebook 03).
#
# On a GPU the default budget is small: each micro-batch should still fill the device, so
# set it to thousands of tokens (veRL's `ppo_max_token_len_per_gpu` is typically 16 384).
# With `max_tokens_per_microbatch=0` the update is one pass, the padded reference. The
# benchmark's `--workload long` runs the whole GRPO step this way against TRL, and
# `benchmarks/README.md` gives its figures, generate and update seconds separately.


# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/01_single_process.py`: the bodies of the functions below are
# replaced by `raise NotImplementedError`. Fill them in, then grade:
#
# ```
# python -m minirl.grade --only 01
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 1.1 | `selective_log_softmax` | gathered log-probs equal log_softmax's, stable for large logits, sum to 1 |
# | 1.2 | `group_advantages` | group/batch/none scaling as TRL, unbiased std + 1e-4, equal rewards give 0 |
# | 1.3 | `gae` | the backward recursion with masking; γ = λ = 1 gives the Monte Carlo return |
# | 1.4 | `clipped_surrogate` | PPO's min/clip for both signs of A, clip-higher, no gradient when clipped |
# | 1.5 | `sequence_mean` | grpo's mean of per-row means; an empty row counts 0 |
# | 1.6 | `token_mean` | bnpo / dapo / cispo: over the batch's tokens; an all-masked batch gives 0, not NaN |
# | 1.7 | `max_length_mean` | dr_grpo: over B × max_completion_length, whatever the columns |
#
# Questions to think about (not graded): set `scale_rewards="none"` or `loss_type="grpo"`
# and rerun section 8: does the curve change, and why so little on this task (hint: how
# long are the completions)? Set `rollout_dtype="bfloat16"` and watch the metric
# `logprob_diff_abs`: notebook 02 starts there.

# %% [markdown]
# ## Appendix: run directories, checkpoints, plots
#
# The bookkeeping around the loop of section 7, which `train` and `run_in_dir` use: the callbacks that
# write a run directory, the resume checks, `run_in_dir`, the checkpoints of `minirl/train/checkpoint.py`
# and the plot of `minirl/train/plots.py`.

# %% [markdown]
# The two callbacks that write into a run directory: the metrics log, and the checkpoints
# (saved by `minirl/train/checkpoint.py`, below).

# %%
# | export minirl/train/run.py
class JSONLLogger(Callback):
    """metrics.jsonl: rewritten from the run's records at the start (a resume drops what came after
    its checkpoint), then one line appended per step."""

    def __init__(self, path):
        self.path = Path(path)

    def on_start(self, state):
        write_jsonl(self.path, state.metrics)

    def on_step(self, state, record):
        append_jsonl(self.path, record)


class Checkpointer(Callback):
    """A checkpoint every `every` steps (0: none during the run); at a normal end, a last checkpoint
    if the final step has none, and the final policy in Hugging Face format under `final/`."""

    def __init__(self, out_dir, every: int, keep: int, config: RLConfig, tokenizer):
        self.root, self.final = Path(out_dir) / "checkpoints", Path(out_dir) / "final"
        self.every, self.keep, self.config, self.tokenizer = every, keep, config, tokenizer
        self.saved_step = None

    def save(self, state):
        save_checkpoint(self.root, state, self.config, self.tokenizer, keep=self.keep)
        self.saved_step = state.step

    def on_start(self, state):
        remove_stale_temporaries(self.root)

    def on_step(self, state, record):
        if self.every and state.step % self.every == 0:
            self.save(state)

    def on_end(self, state):
        if state.interrupted:
            return
        if self.saved_step != state.step:
            self.save(state)
        state.roles.actor.model.save_pretrained(self.final)
        self.tokenizer.save_pretrained(self.final)

# %% [markdown]
# A run directory belongs to one run: starting a new run in a directory that holds another
# is refused (resume it, or overwrite it), a lock keeps two processes from writing into it at
# once, and resuming with settings that change what the run computes (a learning rate, a seed,
# G) is refused, naming each changed setting.

# %%
# | export minirl/train/run.py
def check_resume_config(saved: dict, config: RLConfig) -> None:
    """Refuse to resume a run with settings that change what it computes (steps and bookkeeping may change)."""
    old, new = RLConfig.from_dict(saved).flat(), config.flat()
    changed = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if k not in SAFE_ON_RESUME and old[k] != new[k]]
    if changed:
        raise ConfigError(changed[0].split(":")[0], new[changed[0].split(":")[0]],
                          f"the checkpoint was made with other settings ({'; '.join(changed)}); resume with the "
                          f"run's own settings (only {', '.join(SAFE_ON_RESUME)} may change), or start a new run")

# %% [markdown]
# Checkpoints on one process: `LocalCheckpoints` saves them during a run and restores the newest intact one
# (stage 4's sharded checkpoints have the same two methods).

# %%
# | export minirl/train/run.py
class LocalCheckpoints:
    """One process's checkpoints for `run_in_dir`: `callback()` saves them during the run, `restore(state)`
    loads the newest intact one (RunDirError if none). Stage 4's sharded checkpoints have the same two methods."""

    def __init__(self, out_dir, config: RLConfig, tokenizer):
        self.out_dir, self.config, self.tokenizer = Path(out_dir), config, tokenizer

    def callback(self) -> Callback:
        run = self.config.run
        return Checkpointer(self.out_dir, run.checkpoint_every, run.keep_checkpoints, self.config, self.tokenizer)

    def restore(self, state: RunState) -> None:
        found = latest_checkpoint(self.out_dir / "checkpoints")
        if found is None:
            raise RunDirError(f"resume: {self.out_dir} holds no intact checkpoint (the run stopped before its "
                              "first one); start it again with overwrite=True (--overwrite)")
        _, training, weights = found
        check_resume_config(training["config"], state.config)
        restore_checkpoint(training, weights, state)

# %% [markdown]
# `run_in_dir` is the loop in a run directory: it opens the directory, restores the newest
# checkpoint when resuming, and puts the callbacks (evaluation, log, checkpoints, progress)
# around `run`. Stages 4, 6 and 7 call it too.

# %%
# | export minirl/train/run.py
def run_in_dir(state: RunState, step_fn, tokenizer, *, out_dir=None, resume: bool = False, overwrite: bool = False,
               eval_fn=None, progress: bool = True, label: str = "", extra_callbacks: tuple = (),
               stop_after: int | None = None, run_info: dict | None = None, checkpoints=None, main: bool = True,
               agree=None, first_callbacks: tuple = ()) -> list[dict]:
    """`run` with the jobs around it: the run directory, resume, evaluation, log, checkpoints, progress.

    One copy for every orchestration that runs `step_fn` on a RunState (stage 1's `train`, stage 6's
    Driver, every rank of stage 4 and 7's trainer): where the step runs changes, what a run directory
    holds does not. checkpoints: `LocalCheckpoints` by default. In a job of several processes each
    calls it, main=False on all but the one that writes run.json and metrics.jsonl and shows the bar
    (all take part in checkpoints); agree(what, fn) runs the opening and the restore so that a
    failure on one process stops every one (`minirl.parallel.launch.agree`). first_callbacks run
    before the built-in ones (to add to a record before it is logged).
    """
    config = state.config
    together = agree or (lambda what, fn: fn())
    if resume and out_dir is None:
        raise ValueError("resume=True needs the out_dir of the run to continue")
    record = {"config": dataclasses.asdict(config), **(run_info or {})}
    run_dir = together("opening the run directory", lambda: None if out_dir is None or not main else
                       open_run_dir(out_dir, record, resume=resume, overwrite=overwrite))
    if out_dir is not None and checkpoints is None:
        checkpoints = LocalCheckpoints(out_dir, config, tokenizer)
    try:
        if resume:
            together("restoring the checkpoint", lambda: checkpoints.restore(state))
            if main:
                atomic_write_json(Path(out_dir) / RUN_FILE, (run_dir.record() or {}) | record)   # more steps, say
        callbacks = list(first_callbacks)
        if eval_fn:
            callbacks.append(Evaluator(eval_fn, config.run.eval_every, config.run.steps))
        if out_dir is not None:
            callbacks += [JSONLLogger(Path(out_dir) / "metrics.jsonl")] if main else []
            callbacks.append(checkpoints.callback())
        if progress and main:
            callbacks.append(ProgressBar(config.run.steps, f"{config.algorithm.algo} ({label})"))
        callbacks.append(NoSignalWarning())
        callbacks += list(extra_callbacks)
        if stop_after is not None:
            callbacks.append(StopAfter(stop_after))
        return run(state, step_fn, callbacks, config.run.steps)
    finally:
        if run_dir is not None:
            run_dir.close()

# %% [markdown]
# Checkpoints are ordinary Hugging Face directories (`save_pretrained`, so any tool can load
# them) plus a `training_state.pt` with what the weights do not say: the run's settings, the
# optimizers, the critic, the RNG states, the prompt/sampling generator, the step, the policy
# version and the records so far. Each is written to a temporary directory and renamed into
# place, so a crash mid-write never leaves a half checkpoint. A resume verifies each
# candidate, newest first, and falls back past a damaged one with a warning that names it.
# On a CPU the resumed run is bit-identical to one that was never interrupted
# (`tests/test_chapter01.py` crashes a run on purpose, resumes it and checks).

# %%
# | export minirl/train/checkpoint.py
"""Atomic, verified, exactly resumable checkpoints of a run.

A checkpoint is `checkpoints/step-000010/`: the policy in Hugging Face format
(`save_pretrained`, tokenizer included, so any tool can load it) and `training_state.pt`
with what the weights do not say: the run's config, the optimizers, the critic, the
prompt/sampling generator, torch's and Python's RNG states, the step, the policy version,
the metrics so far, and what a later stage's state adds (`RunState.extra_state`: notebook
07's queued trajectories and tickets). It is written to a temporary directory and renamed into place, so a
crash mid-write never leaves a half checkpoint. Before a resume each candidate is verified
(both files load); a broken one is reported by name and the previous intact one is used.

Simplified vs TRL/Accelerate: one process writes one file of state (notebook 04 writes
sharded checkpoints with torch.distributed.checkpoint); the frozen reference is not saved
(it is the initial policy, rebuilt from the model the run starts from).
"""

import dataclasses
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

PREFIX = "step-"
TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names its directory and the broken file."""


# %% [markdown]
# Saving writes a temporary directory and renames it into place; loading checks both files and
# names what is broken.

# %%
# | export minirl/train/checkpoint.py
def save_checkpoint(root, state, config, tokenizer, keep: int = 2) -> Path:
    """Write `root/step-{state.step:06d}` atomically; keep the newest `keep` checkpoints of this run."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=root))
    roles = state.roles
    roles.actor.model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    training = {
        "step": state.step, "version": roles.version, "config": dataclasses.asdict(config),
        "metrics": state.metrics, "actor": roles.actor.state_dict(),
        "critic": roles.critic.state_dict() if roles.critic is not None else None,
        "generator": state.generator.get_state(), "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "extra": state.extra_state(),        # what a later stage adds (notebook 07: its queue); {} here
    }
    torch.save(training, tmp / "training_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)                                   # atomic: all of it or none of it
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path) -> tuple[dict, dict]:
    """(training state, model weights) of one checkpoint; CheckpointError names what is broken."""
    path = Path(path)
    for name in ("training_state.pt", "model.safetensors"):
        if not (path / name).is_file() or (path / name).stat().st_size == 0:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or empty")
    try:
        training = torch.load(path / "training_state.pt", weights_only=False, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: training_state.pt does not load "
                              f"({type(err).__name__}: {err})") from err
    try:
        weights = load_file(path / "model.safetensors")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: model.safetensors does not load ({err})") from err
    return training, weights

# %% [markdown]
# Finding the newest intact checkpoint (a broken one is named and skipped), and restoring it into the run.

# %%
# | export minirl/train/checkpoint.py
def latest_checkpoint(root) -> tuple[Path, dict, dict] | None:
    """The newest intact checkpoint under `root` as (path, training state, weights), or None.

    A newer checkpoint that does not load is skipped with a warning naming it, so a crash
    that damaged the last one costs the steps since the one before, never the run.
    """
    root = Path(root)
    candidates = sorted(root.glob(f"{PREFIX}*"), reverse=True) if root.is_dir() else []
    for path in candidates:
        try:
            return (path, *load_checkpoint(path))
        except CheckpointError as err:
            warnings.warn(f"{err}; falling back to the previous checkpoint", stacklevel=2)
    return None


def remove_stale_temporaries(root) -> list[Path]:
    """Delete half-written `.tmp-step-*` directories left by a crash during a save; returns them."""
    root = Path(root)
    stale = sorted(root.glob(f"{TMP_PREFIX}{PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def restore_checkpoint(training: dict, weights: dict, state) -> None:
    """Load a checkpoint (from `load_checkpoint`) into a freshly built run state, in place.

    The engine is then handed the restored weights at the restored version.
    """
    roles = state.roles
    model = roles.actor.model
    device = next(model.parameters()).device
    try:
        result = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    except RuntimeError as err:                  # shapes differ: another model than the run's
        raise CheckpointError(f"the checkpoint's weights do not fit the model ({str(err).splitlines()[1].strip()}"
                              "...); resume with the model the run started from") from None
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]   # tied weights are saved once
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint weights do not fit the model: missing {missing[:3]}, unexpected "
                              f"{result.unexpected_keys[:3]}; resume with the model the run started from")
    roles.actor.load_state_dict(training["actor"])
    if roles.critic is not None:
        roles.critic.load_state_dict(training["critic"])
    state.generator.set_state(training["generator"])
    torch.set_rng_state(training["torch_rng"])
    random.setstate(training["python_rng"])
    if training["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(training["cuda_rng"])
    state.step, roles.version, state.metrics = training["step"], training["version"], training["metrics"]
    state.load_extra_state(training.get("extra", {}))
    state.sync.push(roles.actor.named_weights(), state.engine, roles.version)

# %% [markdown]
# The plot of section 8: reward per step and held-out accuracy.

# %%
# | export minirl/train/plots.py
"""Plots of a run's records: the reward per step and the held-out accuracy."""

import matplotlib.pyplot as plt


def plot_metrics(metrics: list[dict], path=None, title: str = "stage 1"):
    """Reward per step and held-out accuracy; saved to `path` if given. Returns the figure."""
    steps = [m["step"] for m in metrics if "reward" in m]
    reward = [m["reward"] for m in metrics if "reward" in m]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, reward, lw=0.6, alpha=0.5, label="batch reward (temperature 1)")
    k = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - k + 1):i + 1]) / len(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
    ax.plot(steps, smooth, lw=1.5, label=f"reward, mean of {k}")
    evals = [(m["step"], m["accuracy"]) for m in metrics if "accuracy" in m]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out greedy accuracy")
    ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
