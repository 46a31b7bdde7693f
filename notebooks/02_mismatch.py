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
# # 02 · Same weights, different probabilities: the training–inference mismatch lab
#
# **By the end of this notebook you can** measure, token by token, how far the rollout
# engine's probabilities are from the trainer's for the *same* weights and tokens; say where
# the error concentrates; run the source's four-step diagnosis; and apply the corrections:
# the behaviour log-probs, truncated importance sampling, vocabulary pruning, and Rollout
# Routing Replay (R3) for a mixture-of-experts policy, then train with and without one.
#
# The source (section 18.4) starts from a surprising claim: *parameter synchronization is not
# enough*. A rollout engine holding exactly the trainer's weights still computes different
# probabilities, along a different numerical path (lower precision, a KV cache, other
# kernels, other batch shapes), and PPO's clipping cannot see the error.
#
# | symbol | meaning | in minirl |
# |---|---|---|
# | $\pi_\text{rollout}$ | what the rollout engine sampled from | `Rollout.logprobs` (behaviour) |
# | $\pi_\text{old}$ | the trainer's recomputation of it | `completion_logprobs(...)` in fp32 |
# | $\pi_\theta$ | the policy being optimized | the trainer's model after updates |

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import copy
import math
import os
import textwrap
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
torch.manual_seed(0)


def show(rows, header):
    """Print rows under header, aligned; a last "why" column is printed below, one note a row."""
    notes = [r[-1] for r in rows] if header[-1] == "why" else []
    rows = [tuple(str(c) for c in r[:len(header) - bool(notes)]) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        line = " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
        print(line + (f" ({j})" if j and notes else ""))
        if j == 0:
            print("-+-".join("-" * w for w in widths))
    for j, note in enumerate(notes, 1):
        print(textwrap.fill(f"  ({j}) why: {note}", 100, subsequent_indent="      "))

# %% [markdown]
# The result first. The package's finished `measure_logprobs` samples completions with a
# rollout copy of the embedded policy (notebook 00) that holds exactly the trainer's weights,
# then lets the trainer (fp32, one full forward) score the same tokens. If the two computed
# the same probabilities, every ratio π_old / π_rollout would be 1.000:

# %%
from minirl.models.policy import load_default_policy
from minirl.runtime.logprob_measure import measure_logprobs  # the harness §2 builds on
from minirl.tasks.arithmetic import make_task

model, tokenizer, _ = load_default_policy(progress=False)
task = make_task()
NUM_PROMPTS = 8 if SMOKE else 64
prompts = [row["prompt"] for row in task.rows("train")[:NUM_PROMPTS]]
print(f"{'rollout copy':>14} | {'tokens':>6} | {'mean |dlogp|':>12} | {'max |dlogp|':>11} | "
      "ratio pi_old/pi_rollout | outside [0.8, 1.25]")
first = {}
for dtype in ("bfloat16", "float8_e4m3fn"):
    s = first[dtype] = measure_logprobs(model, tokenizer, prompts, rollout_dtype=dtype).stats()
    print(f"{dtype:>14} | {s['tokens']:>6} | {s['mean_abs_delta']:>12.2e} | "
          f"{s['max_abs_delta']:>11.2e} | [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}]{'':>8} | "
          f"{s['share_outside']:.2%}")
same = [d for d, s in first.items() if s["max_abs_delta"] == 0]
print(f"same weights, same tokens, identical probabilities: {', '.join(same) or 'in neither copy'} "
      "(rule: every |dlogp| is 0)")

# %% [markdown]
# Same weights, same tokens, different probabilities. The sections below open this piece by
# piece: what PPO's clipping does and does not see (§1), the measurement itself and where
# the error concentrates (§2), the source's four-step diagnosis as one call (§3), the
# corrections (§4), and two training runs with and without one (§5).

# %% [markdown]
# ## 1. PPO clipping, by the numbers
#
# PPO limits how far one update moves the policy with the ratio
# $r_t = \pi_\theta(a_t\mid s_t) / \pi_\text{old}(a_t\mid s_t)$ and the clipped objective
# $\min\big(r_t \hat A_t,\ \text{clip}(r_t, 1-\epsilon, 1+\epsilon)\hat A_t\big)$
# (notebook 01's `minirl.loss_types.clipped_surrogate` returns minus it). Seen from one token
# with $\pi_\text{old} = p$, an update moves the objective only while the new probability stays
# inside $[p(1-\epsilon),\ p(1+\epsilon)]$.

# %%
# | export minirl/diagnostics/mismatch.py
"""Training–inference mismatch: the PPO ratio, measured log-prob gaps, and a diagnosis.

The rollout engine (HF generate with a KV cache, in bf16/fp16/fp8) and the trainer (a full
forward in fp32) compute different probabilities for the same tokens from the same weights.
This module measures that gap token by token (`measure_logprobs`, `mismatch_stats`,
`probability_buckets`) and runs the source's four diagnosis steps as one call
(`diagnose_mismatch`). Simplified on purpose: production systems (veRL, TRL with vLLM, slime)
log the same quantities from a separate inference server; here the rollout engine is an HF
copy in the same process, so every difference comes from precision and computation path.
"""
import torch
from torch import Tensor


def ppo_ratio(new_logps: Tensor, old_logps: Tensor) -> Tensor:
    """r = pi_new / pi_old = exp(new_logps - old_logps), elementwise (any shape)."""
    return torch.exp(new_logps - old_logps)


def clip_bounds(old_probs: Tensor, epsilon: float = 0.2,
                epsilon_high: float | None = None) -> tuple[Tensor, Tensor]:
    """The new-probability interval inside which PPO's clipped objective still moves a token.

    old_probs: any shape, probabilities in (0, 1] under pi_old. Returns (low, high), each of
    that shape: low = old_probs * (1 - epsilon) and high = min(old_probs * (1 + epsilon_high), 1)
    (a probability cannot exceed 1). epsilon_high defaults to epsilon (DAPO's "clip higher"
    sets it larger). With A > 0, raising the probability past `high` gains nothing more; with
    A < 0, lowering it below `low` gains nothing more. Example: 0.20 at epsilon 0.2 gives
    (0.16, 0.24).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    # BEGIN SOLUTION
    low = old_probs * (1.0 - epsilon)
    high = torch.clamp(old_probs * (1.0 + epsilon_high), max=1.0)
    return low, high
    # END SOLUTION


# %% [markdown]
# The source's example: the old policy gives a token probability 0.20, the updated policy
# 0.24, so $r = 1.2$, exactly the upper boundary at $\epsilon = 0.2$.

# %%
from minirl.loss_types import clipped_surrogate  # notebook 01's loss: minus the objective


def objective(ratio, advantages):
    return -clipped_surrogate(ratio, advantages, 0.2)


old_p, new_p = torch.tensor(0.20), torch.tensor(0.24)
r = ppo_ratio(new_p.log(), old_p.log())
low, high = clip_bounds(old_p)
at_boundary = objective(r, torch.tensor(1.0))
beyond = objective(ppo_ratio(torch.tensor(0.26).log(), old_p.log()), torch.tensor(1.0))
show([("r for 0.20 -> 0.24", 1.2, f"{r.item():.4f}", abs(r.item() - 1.2) < 1e-6),
      ("upper clip bound for p_old = 0.20", 0.24, f"{high.item():.4f}",
       abs(high.item() - 0.24) < 1e-6),
      ("objective at r = 1.2, A = +1", 1.2, f"{at_boundary.item():.4f}",
       abs(at_boundary.item() - 1.2) < 1e-6),
      ("objective at 0.20 -> 0.26, A = +1", "(1.2)", f"{beyond.item():.4f}",
       abs(beyond.item() - 1.2) < 1e-6)], ("quantity", "source", "minirl", "agree?"))
print("rule: agree? is True when minirl's value is within 1e-6 of the source's (the last row is")
print("clipped: no gain past 1 + eps)")

# %% [markdown]
# Sweep the ratio for a positive and a negative advantage. The flat parts are where the
# gradient is zero: past $1+\epsilon$ a good token gains nothing more, below $1-\epsilon$ a
# bad token's probability is not pushed down further.

# %%
ratios = torch.linspace(0.4, 1.8, 281)
fig, axes = plt.subplots(1, 2, figsize=(7, 2.8), sharex=True)
for ax, adv in zip(axes, (+1.0, -1.0), strict=True):
    ax.plot(ratios, ratios * adv, ls="--", color="gray", label="unclipped r·A")
    ax.plot(ratios, objective(ratios, torch.tensor(adv)), lw=2, label="clipped (ε = 0.2)")
    for b in (0.8, 1.2):
        ax.axvline(b, color="red", lw=0.6)
    ax.set(title=f"advantage A = {adv:+.0f}", xlabel="ratio r = π_θ / π_old", ylabel="objective")
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **The wrong denominator.** All of that assumes $\pi_\text{old}$ is the policy that
# generated the token. Take the source's numbers: the rollout engine (FP8) sampled a token
# with probability 0.30; the trainer (BF16, other kernels) recomputes 0.29 from the same
# weights. Before any update, $\pi_\theta = \pi_\text{old}$ in the trainer, so PPO's ratio is
# exactly 1 and clipping sees nothing. The true importance ratio against the policy that
# produced the sample is $0.29/0.30$:

# %%
p_rollout, p_trainer = torch.tensor(0.30), torch.tensor(0.29)
ppo_sees = ppo_ratio(p_trainer.log(),
                     p_trainer.log())          # pi_theta / pi_old before any update
truth = ppo_ratio(p_trainer.log(), p_rollout.log())              # pi_theta / pi_rollout
dlogp = (p_rollout.log() - p_trainer.log()).abs()
print(f"PPO's ratio before any update (trainer / trainer): {ppo_sees.item():.4f}: nothing to clip")
print(f"true ratio vs the behaviour policy (0.29 / 0.30):  {truth.item():.4f}")
print(f"|delta log p| = {dlogp.item():.4f}: {dlogp.item() / math.log(1.2):.0%} of the clip band's "
      f"upper half (log 1.2 = {math.log(1.2):.4f})")
print("used up before the optimizer moved")
for n in (10, 100, 1000):
    print(f"  a sequence of {n:>4} tokens each off by the same factor: sequence ratio "
          f"{truth.item() ** n:.3g}")

TOL = 1e-6   # rule: a ratio "is" a value when it is within TOL of it (float32 rounding)
wrong = abs(truth.item() - 0.29 / 0.30) < TOL and abs(truth.item() - 1) > TOL   # 0.29/0.30, not 1
blind = abs(ppo_sees.item() - 1) < TOL                                          # nothing to clip
print()
show([("ratio error from 0.30 vs 0.29", "wrong before any update",
       f"{truth.item():.3f} ({1 / truth.item() - 1:.1%} off)", "yes" if wrong else "no",
       f"0.29/0.30; |dlogp| = {dlogp.item():.3f}"),
      ("what clipping does about it", "nothing", f"PPO's ratio is {ppo_sees.item():.3f}",
       "yes" if blind else "no", "the denominator is the recomputation, not the sampler")],
     ("quantity", "source", "minirl", "agree?", "why"))
print("rule: row 1 agrees when the true ratio is 0.29/0.30 and not 1, row 2 when PPO's ratio is 1")
print(f"(within {TOL:g})")

# %% [markdown]
# A consistent 3.4 % per-token bias compounds over a sequence (0.034 over 100 tokens); random
# per-token errors partly cancel instead. Which happens on a real rollout is for measurement.
#
# ## 2. Measure it: the rollout's log-probs against the trainer's, token by token
#
# The rollout side is `minirl.rollout.hf.HFEngine`, the rollout engine's own copy of the
# policy: HF `generate` with a KV cache, in the precision you give it. Its `Rollout.logprobs`
# are the **behaviour log-probs**, computed while sampling. The trainer side is
# `minirl.algo.logprobs.completion_logprobs`: one full forward in fp32 over prompt + completion,
# the recomputation every PPO/GRPO trainer does. Both tensors are `[B, C]`, masked up to and
# including the first EOS; `mismatch_stats` summarizes the gap (its input checks live in
# `minirl/runtime/logprob_checks.py`).

# %%
# | export minirl/diagnostics/mismatch.py
from minirl.runtime.logprob_checks import check_logprob_pair


def mismatch_stats(trainer_logps: Tensor, behavior_logps: Tensor, mask: Tensor,
                   low: float = 0.8, high: float = 1.25) -> dict[str, float]:
    """Summary of the gap between the trainer's and the rollout's log-probs of the sampled tokens.

    trainer_logps, behavior_logps, mask: [B, C]. With delta = trainer - behavior and
    ratio = exp(delta) (pi_old / pi_rollout, the importance weight TIS corrects with):
    tokens, mean_abs_delta, max_abs_delta, kl_k3 (E[ratio - 1 - delta], an unbiased,
    non-negative estimate of KL(pi_rollout || pi_old) from the rollout's own samples),
    share_outside (share of tokens whose ratio leaves [low, high]), ratio_min, ratio_max.
    Computed in float64 over the positions where mask is 1; all 0 when there are none.
    """
    check_logprob_pair(trainer_logps, behavior_logps, mask)
    delta = (trainer_logps.double() - behavior_logps.double())[mask.bool()]
    if delta.numel() == 0:
        return dict(tokens=0, mean_abs_delta=0.0, max_abs_delta=0.0, kl_k3=0.0, share_outside=0.0,
                    ratio_min=1.0, ratio_max=1.0)
    ratio = delta.exp()
    return dict(tokens=int(delta.numel()), mean_abs_delta=delta.abs().mean().item(),
                max_abs_delta=delta.abs().max().item(), kl_k3=(ratio - 1 - delta).mean().item(),
                share_outside=((ratio < low) | (ratio > high)).double().mean().item(),
                ratio_min=ratio.min().item(), ratio_max=ratio.max().item())


# %% [markdown]
# Where does the error live? Bucket the tokens by the rollout's probability (exercise 2.2).

# %%
# | export minirl/diagnostics/mismatch.py
PROBABILITY_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


def probability_buckets(trainer_logps: Tensor, behavior_logps: Tensor, mask: Tensor,
                        edges: tuple[float, ...] = PROBABILITY_EDGES, low: float = 0.8,
                        high: float = 1.25) -> list[dict]:
    """The log-prob gap bucketed by the rollout's probability of each sampled token.

    trainer_logps, behavior_logps, mask: [B, C] (float log-probs, mask 0/1). Only positions
    with mask == 1 count. A token's probability is p = exp(behavior_logps) clamped to at most
    1 (the rollout's view: what was known when it was sampled). Token j belongs to bucket i
    when edges[i] <= p < edges[i + 1]; the last bucket also holds p == edges[-1].
    edges: increasing floats. With delta = trainer_logps - behavior_logps, returns one dict
    per bucket (len(edges) - 1 dicts, in order) with keys:
      "lo", "hi" (the bucket's edges, floats), "tokens" (int count),
      "mean_abs_delta", "max_abs_delta" (floats over the bucket's |delta|),
      "share_outside" (share of the bucket's tokens whose exp(delta) is < low or > high).
    An empty bucket reports tokens 0 and 0.0 for the three statistics.
    """
    check_logprob_pair(trainer_logps, behavior_logps, mask)
    # BEGIN SOLUTION
    valid = mask.bool()
    p = behavior_logps.double()[valid].exp().clamp(max=1.0)
    delta = (trainer_logps.double() - behavior_logps.double())[valid]
    ratio = delta.exp()
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == len(edges) - 2
        inside = (p >= lo) & ((p <= hi) if last else (p < hi))
        d, r = delta[inside].abs(), ratio[inside]
        n = int(inside.sum())
        rows.append(dict(lo=float(lo), hi=float(hi), tokens=n,
                         mean_abs_delta=d.mean().item() if n else 0.0,
                         max_abs_delta=d.max().item() if n else 0.0,
                         share_outside=((r < low) | (r > high)).double().mean().item()
                         if n else 0.0))
    return rows
    # END SOLUTION



# %% [markdown]
# The trainer's side: the recomputation of a rollout's log-probs, in the trainer's precision.

# %%
# | export minirl/diagnostics/mismatch.py
import copy

from minirl.algo.logprobs import completion_logprobs
from minirl.rollout.hf import DTYPES, HFEngine


def trainer_logprobs(model, rollout_batch, train_dtype: str = "float32",
                     temperature: float = 1.0) -> Tensor:
    """The trainer's recomputation of a Rollout's completion log-probs, [B, C] float32.

    One full forward over prompt + completion (no KV cache) with `model` cast to train_dtype
    (a copy, when the dtype differs). Temperature must be the sampling temperature.
    """
    if train_dtype not in DTYPES:
        raise ValueError(f"train_dtype={train_dtype!r}: use one of {sorted(DTYPES)}")
    trainer = model
    if next(model.parameters()).dtype != DTYPES[train_dtype]:
        trainer = copy.deepcopy(model).to(DTYPES[train_dtype])
    input_ids = torch.cat([rollout_batch.prompt_ids, rollout_batch.completion_ids],
                          dim=1)      # [B, P+C]
    attention_mask = torch.cat([rollout_batch.prompt_mask, rollout_batch.completion_mask], dim=1)
    with torch.no_grad():
        logps, _ = completion_logprobs(trainer, input_ids, attention_mask,
                                       rollout_batch.completion_ids.shape[1],
                                       temperature=temperature)
    return logps.float()


# %% [markdown]
# The two sides, by hand: a bf16 rollout copy samples (and records its behaviour
# log-probs), the fp32 trainer recomputes the same tokens.

# %%
from minirl.config import SamplingConfig
from minirl.rollout.hf import HFEngine

rollout = HFEngine(model, tokenizer, dtype="bfloat16")
batch = rollout.generate(prompts, SamplingConfig(8, 4, 1.0),
                         generator=torch.Generator().manual_seed(0))
trainer_side = trainer_logprobs(model, batch)                                 # [B, C]
st = mismatch_stats(trainer_side, batch.logprobs.float(), batch.completion_mask)
print(f"{st['tokens']} tokens: mean |dlogp| {st['mean_abs_delta']:.2e}, KL(k3) {st['kl_k3']:.2e}, "
      f"ratio pi_old / pi_rollout in [{st['ratio_min']:.3f}, {st['ratio_max']:.3f}]")
p_sampled = batch.logprobs.float().exp()[batch.completion_mask.bool()]
print(f"sampled tokens with rollout p >= 0.9: {(p_sampled >= 0.9).double().mean():.0%}; "
      f"with p < 0.01 (the tail): {(p_sampled < 0.01).double().mean():.1%}")

# %% [markdown]
# `measure_logprobs` (`minirl/runtime/logprob_measure.py`) makes exactly these two calls and
# returns both sides, aligned, as a `LogprobPair` with `.stats()` and `.buckets()`. The tiny
# policy is confident (the last line above), so we also sample at temperature 2 to put more
# low-probability tokens in the buckets. Where does the error concentrate? The bucketed table
# for an FP8 rollout (the largest gap) and the mean |Δ log p| per bucket for each precision:

# %%
from minirl.runtime.mismatch_report import format_buckets  # the rows as a fixed-width table

PAIR_DTYPES = ("bfloat16", "float8_e4m3fn") if SMOKE else ("bfloat16", "float16", "float8_e4m3fn")
pairs = {}
for d in PAIR_DTYPES:
    for T in (1.0, 2.0):
        t0 = time.time()
        pairs[d, T] = measure_logprobs(model, tokenizer, prompts, d, temperature=T)
        print(f"measured {d} at T = {T:g} ({len(pairs)} of {2 * len(PAIR_DTYPES)}, "
              f"{time.time() - t0:.1f} s)")
print("\nFP8 rollout, temperature 2:")
print(format_buckets(pairs["float8_e4m3fn", 2.0].buckets()))
print(f"\n{'rollout':>14} | {'T':>3} | {'tokens':>6} | ratio range       | outside [0.8, 1.25]")
for (d, T), pr in pairs.items():
    st = pr.stats()
    print(f"{d:>14} | {T:>3g} | {st['tokens']:>6} | "
          f"[{st['ratio_min']:.3f}, {st['ratio_max']:.3f}]    | {st['share_outside']:.2%}")
sure_smallest, factors = True, []   # the p >= 0.9 bucket against every other non-empty bucket
for pr in pairs.values():
    rows = [r for r in pr.buckets() if r["tokens"]]
    top = rows[-1]["mean_abs_delta"] if rows[-1]["lo"] == 0.9 else float("nan")
    others = [r["mean_abs_delta"] for r in rows if r["lo"] < 0.9]
    sure_smallest &= all(o > top for o in others)
    factors += [o / top for o in others]
print(f"p >= 0.9 bucket has the smallest mean |dlogp| in every measurement: "
      f"{'yes' if sure_smallest else 'no'}")
print(f"the other buckets' mean |dlogp| is {min(factors):.0f}x to {max(factors):.0f}x larger")

fig, ax = plt.subplots(figsize=(8, 3.2))
width = 0.13
for i, ((d, T), pr) in enumerate(pairs.items()):
    rows = pr.buckets()
    xs = [j + (i - len(pairs) / 2 + 0.5) * width for j in range(len(rows))]
    heights = [r["mean_abs_delta"] if r["tokens"] else float("nan") for r in rows]   # NaN: no bar
    ax.bar(xs, heights, width, label=f"{d}, T={T:g}")
ax.set_xticks(range(len(rows)), [f"[{r['lo']:g}, {r['hi']:g})" for r in rows])
ax.set(yscale="log", xlabel="rollout probability of the sampled token", ylabel="mean |Δ log p|",
       title="mismatch by token probability (empty bucket: no bar)")
ax.legend(fontsize=7, ncol=3)
plt.tight_layout()
plt.show()

# %% [markdown]
# Tokens the policy is sure of (p >= 0.9) carry the least log-prob error: log-softmax is flat
# near p = 1. The source's claims ("errors on many low-probability tokens accumulate", and its
# 0.30 vs 0.29 token), beside what we measure:

# %%
source_gap = math.log(0.30 / 0.29)                               # the source's one token
fp8_gap = pairs["float8_e4m3fn",
                1.0].stats()["mean_abs_delta"]  # our FP8 rollout, every token, T = 1
same_order = 0.1 <= fp8_gap / source_gap <= 10                   # rule: within a factor of 10
show([("errors concentrate on low p", "yes", f"p >= 0.9 smallest in all {len(pairs)}",
       "yes" if sure_smallest else "no", "log-softmax saturates near p = 1"),
      ("FP8 0.30 vs BF16 0.29", f"{source_gap:.3f}, one token", f"FP8 mean |dlogp| {fp8_gap:.3f}",
       "same order" if same_order else "no",
       "our FP8 is a weight round-trip on a 1 M-parameter model")],
     ("quantity", "source", "minirl", "agree?", "why"))
print("rules: row 1 agrees when the p >= 0.9 bucket is the smallest in every measurement above;")
print(f"row 2 is of the same order when ours / the source's |dlogp| is in [0.1, 10] "
      f"(here {fp8_gap / source_gap:.2f})")

# %% [markdown]
# ## 3. The diagnosis, in the source's order
#
# 1. **Version and synchronization.** Is the engine at the trainer's version, and did the
#    last transfer complete? The version is a label; the weights are the truth, so we compare
#    them too, allowing exactly the rounding of the rollout's dtype (exercise 2.3).
# 2. **Token by token.** Compare the log-probs of the same tokens; locate the errors.
# 3. **Precision and kernels.** Re-run the rollout in other precisions.
# 4. **MoE routes.** Compare the experts each token was routed to on both sides (§4.3).

# %%
# | export minirl/sync/checks.py
"""Did the weights arrive? The stale-parameter check every weight sync can run after a push.

A version number is a label; the weights are the truth. `stale_parameters` names the tensors
whose rollout copy differs from the trainer's beyond a rounding tolerance;
`minirl.runtime.sync_checks.check_synchronization` runs it on every tensor of an engine.
"""
from torch import Tensor


def stale_parameters(trainer_state: dict[str, Tensor], rollout_state: dict[str, Tensor],
                     rel_tol: float = 0.0, abs_tol: float = 0.0) -> list[str]:
    """Names of the parameters whose rollout copy is not the trainer's, up to rounding.

    trainer_state, rollout_state: name -> tensor (any dtypes; compare in float32).
    A name is reported when it is missing from either side, when its shapes differ, or when
    any element has |rollout - trainer| > abs_tol + rel_tol * |trainer|. rel_tol / abs_tol
    are the rounding a cast to the rollout's dtype can cause (`rounding_tolerance`).
    Returns the names sorted alphabetically (an empty list: synchronized).
    """
    # BEGIN SOLUTION
    stale = []
    for name in sorted(set(trainer_state) | set(rollout_state)):
        if name not in trainer_state or name not in rollout_state:
            stale.append(name)
            continue
        t, r = trainer_state[name].float(), rollout_state[name].float()
        if t.shape != r.shape or ((r - t).abs() > abs_tol + rel_tol * t.abs()).any():
            stale.append(name)
    return stale
    # END SOLUTION


# %% [markdown]
# How much difference is rounding? Exactly what a round-to-nearest cast to the rollout's dtype
# can cause: half a unit in the last place. Step 1 with that tolerance, the version label
# first and then every tensor, is `check_synchronization` (`minirl/runtime/sync_checks.py`).
# `diagnose_mismatch` runs the four steps and returns a `MismatchReport`
# (`minirl/runtime/mismatch_report.py`) whose `str` is a page to read.

# %%
# | export minirl/diagnostics/mismatch.py
from minirl.runtime.logprob_measure import compare_routes, measure_logprobs
from minirl.runtime.mismatch_report import MismatchReport, worst_tokens
from minirl.runtime.moe_routes import routers
from minirl.runtime.sync_checks import check_synchronization, dtype_name


def diagnose_mismatch(model, tokenizer, prompts: list[str], rollout=None,
                      trainer_version: int | None = None, rollout_dtype: str = "bfloat16",
                      train_dtype: str = "float32",
             sweep: tuple[str, ...] = ("float32", "bfloat16", "float16", "float8_e4m3fn"),
             num_generations: int = 8, max_new_tokens: int = 4, temperature: float = 1.0,
             seed: int = 0, progress: bool = False) -> MismatchReport:
    """Run the four diagnosis steps on `model` (the trainer's policy) and its rollout engine.

    rollout: the engine to diagnose (when None, a fresh HFEngine in rollout_dtype, in sync).
    Step 3 builds a fresh, synchronized rollout per dtype in `sweep` on the same prompts.
    Step 4 runs only when the policy has MoE routers (minirl.runtime.moe_routes).
    progress=True prints a line as each step (and each dtype of the sweep) is done.
    """
    device = next(model.parameters()).device
    if rollout is None:
        rollout = HFEngine(model, tokenizer, dtype=rollout_dtype, device=device)
        if trainer_version is not None:
            rollout.version = trainer_version
    def done(step: str) -> None:
        if progress:
            print(f"  diagnose: {step} done", flush=True)

    problems = check_synchronization(model, rollout, trainer_version)
    done("1. synchronization")
    kwargs = dict(num_generations=num_generations, max_new_tokens=max_new_tokens,
                  temperature=temperature, seed=seed)
    pair = measure_logprobs(model, tokenizer, prompts, train_dtype=train_dtype, rollout=rollout,
                            **kwargs)
    done("2. token by token")
    table = {}
    for d in sweep:
        table[d] = measure_logprobs(model, tokenizer, prompts, d, train_dtype, **kwargs).stats()
        done(f"3. precision sweep, {d}")
    routes = None
    if routers(model):
        routes = compare_routes(model, tokenizer, prompts, rollout_dtype=dtype_name(rollout),
                                **kwargs)
        done("4. MoE routes")
    return MismatchReport(dtype_name(rollout), train_dtype, problems, pair.stats(), pair.buckets(),
                          worst_tokens(pair, tokenizer), table, routes)

# %% [markdown]
# Run the four steps on a rollout copy that is in sync:

# %%
SWEEP = ("float32", "float8_e4m3fn") if SMOKE else ("float32", "bfloat16", "float16",
                                                    "float8_e4m3fn")
t0 = time.time()
report = diagnose_mismatch(model, tokenizer, prompts, trainer_version=0, sweep=SWEEP, progress=True)
print(f"done in {time.time() - t0:.0f} s\n")
print(report)
cache_only = report.sweep["float32"]["mean_abs_delta"]
print(f"\nthe KV-cache path alone (float32 row): mean |dlogp| {cache_only:.1e}, "
      f"{'at rounding level' if cache_only < 1e-5 else 'above rounding'} (rule: below 1e-5)")

# %% [markdown]
# The float32 row is the KV-cache path alone: at rounding level on this CPU, so precision, not
# the cache, separates the engines here (on a GPU, kernels and batch shapes add their share:
# `chapters/02_mismatch.py --device cuda`). Now plant the most common real bug: the trainer
# steps, the version counter is bumped, the weights never move. Step 1 catches it.

# %%
stale_rollout = HFEngine(model, tokenizer, dtype="bfloat16")
trainer = copy.deepcopy(model)
optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
loss = trainer(**batch, labels=batch["input_ids"]).loss        # any update will do
loss.backward()
optimizer.step()
stale_rollout.version = 1                                      # the counter moved, not the weights
for problem in check_synchronization(trainer, stale_rollout, trainer_version=1):
    print(textwrap.fill(f"PROBLEM: {problem}", 100, subsequent_indent="  "))
stale_rollout.load_weights(trainer.state_dict(), version=1)    # a real synchronization
print("after load_weights:", check_synchronization(trainer, stale_rollout,
                                                   trainer_version=1) or "OK")

# %% [markdown]
# ## 4. Corrections
#
# ### 4.1 Record the behaviour policy, and weight by it: truncated importance sampling
#
# The first correction is bookkeeping: keep the log-probs the rollout engine computed while
# sampling (`Rollout.logprobs`); the trainer's recomputation is not the policy that produced
# the data. With both in hand, the gradient can be reweighted by
# $w_t = \pi_\text{old}(a_t)/\pi_\text{rollout}(a_t)$, the importance weight that turns
# samples from $\pi_\text{rollout}$ into an estimate under $\pi_\text{old}$. Raw weights have
# unbounded variance (one tail token with $w = 50$ dominates a batch), so they are capped:
# **truncated IS** (TIS) clips $w$ at $C$; **masked IS** (MIS) drops tokens with $w > C$.
# At sequence level one weight $\exp\sum_t(\log\pi_\text{old} - \log\pi_\text{rollout})$ is
# shared by all tokens of a sequence (TRL's `vllm_importance_sampling_mode`; our cap is 2).
# The loss becomes $w_t \cdot \min(r_t\hat A_t, \text{clip}(r_t)\hat A_t)$: clipping still
# bounds the update, the weight fixes the denominator.

# %%
# | export minirl/algo/corrections.py
"""Corrections for the training–inference mismatch: truncated IS and vocabulary pruning.

`importance_sampling_weights` reweights each token by pi_old / pi_rollout, truncated or masked
at a cap, per token or per sequence (TRL's `vllm_importance_sampling_mode`); the loop calls it
when `importance_sampling_correction` is on. `vocabulary_keep_mask` and `pruned_log_softmax`
prune the low-probability tail identically on both sides. Simplified on purpose: only an upper
cap, and pruning by a min-p threshold from one side.
"""
import torch
from torch import Tensor

from minirl.config import IS_MODES
from minirl.runtime.logprob_checks import check_logprob_pair


def importance_sampling_weights(old_logps: Tensor, behavior_logps: Tensor, mask: Tensor,
                                mode: str = "token_truncate", cap: float = 2.0) -> Tensor:
    """Truncated / masked importance weights pi_old / pi_rollout, [B, C], detached.

    old_logps: [B, C] float, the trainer's recomputed log-probs of the sampled tokens.
    behavior_logps: [B, C] float, the rollout engine's log-probs of the same tokens.
    mask: [B, C] 0/1 completion mask (padding after EOS is 0).
    mode: "token_truncate" | "token_mask" | "sequence_truncate" | "sequence_mask".
      token_*: ratio_t = exp(old_t - behavior_t), one per token.
      sequence_*: ratio = exp(sum over the sequence's mask == 1 tokens of (old - behavior)),
      the same value broadcast to every token of that sequence.
      *_truncate: weight = min(ratio, cap). *_mask: weight = ratio if ratio <= cap else 0.
    cap: float > 0 (C in the TIS paper; TRL's vllm_importance_sampling_clip_max).
    Returns weights [B, C] in old_logps' dtype, 0 wherever mask == 0, with no gradient
    (they reweight the loss; they are not optimized). Masked positions never contribute to
    a sequence sum, even when their log-probs hold garbage or NaN.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode={mode!r}: use one of {IS_MODES}")
    if not cap > 0:
        raise ValueError(f"cap={cap}: the importance-weight cap must be > 0 (TIS uses 2 to 5)")
    check_logprob_pair(old_logps, behavior_logps, mask)
    # BEGIN SOLUTION
    valid = mask.bool()
    diff = torch.where(valid, old_logps.detach() - behavior_logps.detach(),
                       torch.zeros_like(old_logps))
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)                     # [B, 1]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return (weights * valid).to(old_logps.dtype)                  # [B, C]
    # END SOLUTION

# %% [markdown]
# Apply it to the FP8 rollout measured above. First what happens when the recomputation is
# substituted for the behaviour log-probs: every weight is exactly 1, and the mismatch
# vanishes from view while it is still in the data.

# %%
fp8 = pairs["float8_e4m3fn", 2.0]
substituted = importance_sampling_weights(fp8.trainer_logps, fp8.trainer_logps, fp8.mask)
print(f"behaviour log-probs replaced by the recomputation: weights in "
      f"[{substituted[fp8.mask.bool()].min():.3f}, {substituted[fp8.mask.bool()].max():.3f}] "
      "(blind)")
ratio = torch.exp(fp8.trainer_logps - fp8.behavior_logps)[fp8.mask.bool()]
print(f"{'mode':>18} | {'cap':>4} | {'mean w':>7} | {'min w':>6} | {'max w':>6} | tokens changed")
for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    for cap in (1.05, 2.0):
        w = importance_sampling_weights(fp8.trainer_logps, fp8.behavior_logps, fp8.mask, mode, cap)
        raw = importance_sampling_weights(fp8.trainer_logps, fp8.behavior_logps, fp8.mask, mode,
                                          1e9)
        v, r0 = w[fp8.mask.bool()], raw[fp8.mask.bool()]
        print(f"{mode:>18} | {cap:>4} | {v.mean():>7.4f} | {v.min():>6.3f} | {v.max():>6.3f} | "
              f"{((v - r0).abs() > 1e-9).double().mean():.2%}")

above, below = (ratio > 1).double().mean().item(), (ratio < 1).double().mean().item()
print(f"token ratios: {above:.1%} above 1, {below:.1%} below 1, median {ratio.median():.4f}, "
      f"mean {ratio.mean():.4f}, max {ratio.max():.3f}")
print(f"above the cap 2: {(ratio > 2).double().mean():.2%}, "
      f"above 1.05: {(ratio > 1.05).double().mean():.2%}")
bias = max(abs(ratio.median().item() - 1), abs(ratio.mean().item() - 1))
print(f"a systematic direction to correct: {'no' if bias < 0.01 else 'yes'} "
      f"(rule: median and mean within 1 % of 1; here {bias:.2%})")

fig, ax = plt.subplots(figsize=(6.5, 2.8))
ax.hist(ratio.log().numpy(), bins=60, color="C0")
ax.set(yscale="log", xlabel="log(π_old / π_rollout) per sampled token (FP8 rollout, T = 2)",
       ylabel="tokens", title="token importance ratios and the two caps tried above")
for cap, style in ((1.05, ":"), (2.0, "--")):
    ax.axvline(math.log(cap), color="red", lw=0.9, ls=style, label=f"cap {cap:g}: log {cap:g}")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The FP8 gap moves most token ratios by a few percent around 1: a cap of 2 touches only the
# tokens right of the dashed line (none or a handful per batch), a tight 1.05 every token right
# of the dotted one. The mask modes drop those tokens instead of capping them. The sequence
# modes multiply a completion's token ratios, so one bad token moves the whole sequence's
# weight: sequence-level weights are cut at least as often ("tokens changed" at 1.05).

# %% [markdown]
# Into the loop: notebook 01's step runs the corrections registered in `BEHAVIOUR_CORRECTIONS`
# between the experience and the advantages; this one weights each token when the config's
# `importance_sampling_correction` is on (`importance_sampling_mode`, `_cap`).

# %%
from minirl.train.step import BEHAVIOUR_CORRECTIONS  # noqa: E402  (notebook 01's hook)

print("behaviour corrections before this notebook's:", list(BEHAVIOUR_CORRECTIONS) or "none")

# %%
# | export minirl/train/step.py
from minirl.algo.corrections import importance_sampling_weights
from minirl.config import AlgorithmConfig
from minirl.data import Experience


def importance_weights(exp: Experience, algorithm: AlgorithmConfig) -> Experience:
    """Truncated IS weights pi_old / pi_rollout per token (`is_weights`), if the config asks."""
    if not algorithm.importance_sampling_correction:
        return exp
    ro = exp.rollout
    exp.is_weights = importance_sampling_weights(exp.old_logps, ro.logprobs, ro.completion_mask,
                                                 algorithm.importance_sampling_mode,
                                                 algorithm.importance_sampling_cap)       # [N, C]
    return exp


BEHAVIOUR_CORRECTIONS["importance_sampling"] = importance_weights

# %% [markdown]
# ### 4.2 Prune the tail, identically on both sides
#
# Section 2 showed that the tokens the rollout was sure of carry the smallest error. Dynamic
# vocabulary pruning removes the far tail from *both* distributions before anything is
# sampled or scored. The keep set is computed once, from one side (here the rollout's, with a
# min-p rule: keep every token whose probability is at least `min_p` times the top token's),
# and applied to both; each side renormalizes over the same kept tokens. A token outside the
# set can be neither sampled nor scored, so its wild ratio cannot reach the loss.

# %%
# | export minirl/algo/corrections.py
def vocabulary_keep_mask(logits: Tensor, min_p: float) -> Tensor:
    """Min-p keep set: True where softmax(logits) >= min_p * (the top token's probability).

    logits: [..., V] float (any leading shape). min_p: float in [0, 1]; 0 keeps everything,
    1 keeps only the most probable token(s). Returns a bool tensor of the same shape. The
    most probable token of every row is always kept, so no row is ever empty. Compute it
    from ONE side (the rollout's) and pass the same mask to `pruned_log_softmax` on both.
    """
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p}: use a value in [0, 1] (0 keeps the whole vocabulary)")
    # BEGIN SOLUTION
    probs = torch.softmax(logits.float(), dim=-1)
    return probs >= min_p * probs.max(dim=-1, keepdim=True).values
    # END SOLUTION


def pruned_log_softmax(logits: Tensor, keep: Tensor) -> Tensor:
    """log_softmax over the kept tokens only: [..., V] float32, -inf where keep is False."""
    if keep.shape != logits.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)} but logits has "
                         f"{tuple(logits.shape)}: pass the [..., V] mask from vocabulary_keep_mask "
                         "on logits of the same shape")
    return torch.log_softmax(logits.float().masked_fill(~keep, float("-inf")), dim=-1)


# %% [markdown]
# Measure it on the full distributions: at every completion position, compare all V entries
# of the FP8 rollout copy's distribution with the fp32 trainer's, before and after pruning
# with a keep set computed from the rollout side.

# %%
from minirl.algo.logprobs import completion_logits

rollout8 = HFEngine(model, tokenizer, dtype="float8_e4m3fn")
sample = rollout8.generate(prompts, SamplingConfig(num_generations=8, max_completion_length=4),
                           generator=torch.Generator().manual_seed(0))
args = (sample.input_ids, sample.attention_mask, sample.num_completion_tokens, 1.0)
with torch.no_grad():   # notebook 01's completion_logits: the distributions the tokens came from
    rollout_logits = completion_logits(rollout8.model, *args)          # [B, C, V]
    trainer_logits = completion_logits(model, *args)
rows = sample.completion_mask.bool()
full_r = torch.log_softmax(rollout_logits,
                           -1)[rows]                   # [N, V] every vocabulary entry
full_t = torch.log_softmax(trainer_logits, -1)[rows]
gap, p = (full_r - full_t).abs(), full_r.exp()
print("every vocabulary entry at every completion position (not only the sampled ones):")
print(f"{'rollout p':>17} | {'entries':>7} | {'mean |dlogp|':>12} | {'max |dlogp|':>11}")
for lo, hi in ((0, 1e-4), (1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 0.1), (0.1, 0.5), (0.5, 1.01)):
    m = (p >= lo) & (p < hi)
    if m.any():
        print(f"[{lo:<6g}, {min(hi, 1):>6g}) | {int(m.sum()):>7} | {gap[m].mean():>12.2e} | "
              f"{gap[m].max():>11.2e}")
print(f"\n{'min_p':>6} | {'kept':>6} | {'mass pruned':>11} | {'max |dlogp| kept':>16} | "
      f"{'mean |dlogp| kept':>17} | KL(rollout||trainer)")
for min_p in (0.0, 1e-3, 1e-2, 5e-2):
    keep = vocabulary_keep_mask(rollout_logits, min_p)
    lr, lt = pruned_log_softmax(rollout_logits, keep)[rows], pruned_log_softmax(trainer_logits,
                                                                                keep)[rows]
    k = keep[rows]
    diff = (lr - lt).masked_fill(~k, 0)
    kl = (lr.exp() * diff).sum(-1)
    mass = (1 - torch.softmax(rollout_logits, -1)[rows].masked_fill(~k, 0).sum(-1)).clamp(min=0)
    print(f"{min_p:>6g} | {k.float().mean():>6.1%} | {mass.mean():>11.2e} | "
          f"{diff.abs().max():>16.3f} | {diff.abs()[k].mean():>17.2e} | {kl.mean():.2e}")

# %% [markdown]
# Measured honestly, this tiny policy does not show the pattern pruning is built for: per
# entry the FP8 gap is about as large at p = 1e-4 as at p = 0.3, so pruning removes mass
# without shrinking the gap on what is kept. It pays off where the tail is huge and badly
# computed (a 150 k vocabulary in FP8). The mechanism is the point: one keep set, from one
# side, applied to both, so a pruned token never enters the data.

# %% [markdown]
# ### 4.3 Rollout Routing Replay (R3) for mixture-of-experts policies
#
# In a MoE layer a router scores every expert and each token goes to its top-k. When two
# experts' scores are nearly tied, a bf16 rollout and an fp32 trainer can pick different
# experts for the same token: the two sides run *different sub-networks*. R3 records the
# experts chosen during rollout and makes the training forward use the same ones; the router
# still computes its own probabilities for them, so it still learns. The tiny MoE policy
# (a `Qwen2MoeForCausalLM`: 8 experts, top-2, a shared expert), the router finder and the
# `RouteRecorder` (one record per router call, so it follows KV-cached generation) live in
# `minirl/runtime/moe_routes.py`; the replay is the idea.

# %%
# | export minirl/models/moe.py
"""Mixture-of-experts routing: Rollout Routing Replay (R3), and counting MoE parameters.

`replay_routes` makes a forward pass use recorded experts instead of its own top-k, with
routing weights from its own router probabilities at those experts, so the router keeps its
gradient. Building the tiny MoE policy, finding routers, recording routes and measuring
their agreement live in `minirl.runtime.moe_routes`.
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minirl.runtime.moe_routes import restore_forward, routers


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor):
    """Inside the block, every forward of `model` uses `routes` ([L, B, T, k]) as its experts.

    The routing weights are the model's own softmax(router logits) at the replayed experts
    (renormalized over the k when the router normalizes), so gradients still reach the
    router. Every forward inside must cover exactly the recorded [B, T] tokens.
    """
    found = routers(model)
    saved = [router.__dict__.get("forward") for router in found]
    if routes.dim() != 4 or routes.shape[0] != len(found):
        raise ValueError(f"routes has shape {tuple(routes.shape)}: "
                         f"expected [L={len(found)}, B, T, k]")
    for layer, router in enumerate(found):
        def replaying(hidden_states, _router=router, _routes=routes[layer]):
            hidden_states = hidden_states.reshape(-1, _router.weight.shape[1])
            index = _routes.reshape(-1, _routes.shape[-1]).to(hidden_states.device)     # [N, k]
            if index.shape[0] != hidden_states.shape[0]:
                raise ValueError(f"replay_routes: routes cover {index.shape[0]} tokens but this "
                                 f"forward has {hidden_states.shape[0]}; replay needs the recorded "
                                 "[B, T]")
            logits = F.linear(hidden_states, _router.weight)                             # [N, E]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, index)
            if getattr(_router, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index
        router.forward = replaying
    try:
        yield model
    finally:
        for router, previous in zip(found, saved, strict=True):
            restore_forward(router, previous)

# %% [markdown]
# `compare_routes` (`minirl/runtime/logprob_measure.py`) generates with a low-precision rollout
# copy recording its routes, recomputes in fp32 recording the trainer's, and once more
# replaying the rollout's. A short supervised warm start (notebook 00) first, since a MoE that
# has learnt something routes less randomly than a fresh one.

# %%
from minirl.models.policy import WarmStartConfig, warm_start
from minirl.runtime.logprob_measure import compare_routes
from minirl.runtime.moe_routes import build_moe_policy, routers

moe_model = build_moe_policy(tokenizer)
t0 = time.time()
warm_start(moe_model, tokenizer, task, WarmStartConfig(steps=0 if SMOKE else 30,
                                                       target_accuracy=None),
           progress=True)
print(f"MoE policy: {sum(p.numel() for p in moe_model.parameters()):,} parameters, "
      f"{len(routers(moe_model))} MoE layers, warm start {time.time() - t0:.0f} s")
print(f"{'rollout':>14} | {'route agreement':>15} | {'with R3':>7} | {'mean |dlogp|':>12} | "
      f"{'with R3':>9} | {'max |dlogp|':>11} | {'with R3':>9}")
route_rows = {}
for dtype in ("bfloat16", "float8_e4m3fn") if SMOKE else ("bfloat16", "float16", "float8_e4m3fn"):
    r = route_rows[dtype] = compare_routes(moe_model, tokenizer, prompts, rollout_dtype=dtype)
    print(f"{dtype:>14} | {r['route_agreement']:>15.2%} | {r['route_agreement_r3']:>7.2%} | "
          f"{r['mean_abs_delta']:>12.2e} | {r['mean_abs_delta_r3']:>9.2e} | "
          f"{r['max_abs_delta']:>11.2e} | {r['max_abs_delta_r3']:>9.2e}", flush=True)
shrinks = [d for d, r in route_rows.items() if r["max_abs_delta_r3"] < r["max_abs_delta"]]
print(f"R3 shrinks the largest |dlogp| for {len(shrinks)} of {len(route_rows)} rollout precisions "
      f"({', '.join(shrinks) or 'none'})")
print("route agreement with R3 is 100 %: "
      f"{'yes' if all(r['route_agreement_r3'] == 1.0 for r in route_rows.values()) else 'no'}")

# %% [markdown]
# Without replay, near-tied router scores flip under rounding and the two sides disagree on
# the expert set for a share of (layer, token) pairs. With R3 agreement is 100 % by
# construction and the largest gaps (tokens that went through another expert) shrink; what is
# left is ordinary precision error, which the earlier corrections handle.

# %% [markdown]
# ## 5. Does it matter for training?
#
# Two runs of the stage-1 loop with the same deliberately mismatched rollout (FP8 weight
# round-trip, computed in bf16) against the fp32 trainer: one as is, one with
# `importance_sampling_correction=True` (token TIS, cap 2). Training takes minutes, so it runs
# as the chapter script (`minirl/runtime/mismatch_runs.py` launches it and reads it back).

# %%
from minirl.runtime.mismatch_runs import chapter_training

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
training, runs = chapter_training(ROOT, smoke=SMOKE)   # chapters/02_mismatch.py, progress bars live
print(f"{'':>22} | {'no correction':>13} | {'TIS (cap 2)':>11}")
for key in training["no_correction"]:
    a, b = training["no_correction"][key], training["tis"][key]
    print(f"{key:>22} | {str(a) if not isinstance(a, float) else f'{a:.4f}':>13} | "
          f"{str(b) if not isinstance(b, float) else f'{b:.4f}':>11}")

# %%

def smooth(values, k=5):
    """Trailing mean over k steps."""
    windows = [values[max(0, i - k + 1):i + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


fig, axes = plt.subplots(2, 2, figsize=(7, 5))
axes = axes.ravel()
for name, metrics in runs.items():
    steps = [m for m in metrics if "reward" in m]
    xs = [m["step"] for m in steps]
    axes[0].plot(xs, smooth([m["reward"] for m in steps]), label=name)
    axes[1].plot(xs, [m["ratio/std"] for m in steps], label=name)
    axes[2].plot(xs, [m["ratio/max"] for m in steps], label=name)
    axes[3].plot(xs, [m.get("clip_ratio/region_mean", 0.0) for m in steps], label=name)
    over = sum(m["ratio/max"] > 2.0 for m in steps)
    print(f"{name:>13}: steps whose largest token ratio exceeds the cap 2: {over} of {len(steps)}; "
          f"median std {sorted(m['ratio/std'] for m in steps)[len(steps) // 2]:.3f}")
gap = abs(training["no_correction"]["reward_second_half"] - training["tis"]["reward_second_half"])
print(f"reward curves track each other: {'yes' if gap < 0.05 else 'no'} "
      f"(rule: second-half mean rewards within 0.05; they differ by {gap:.3f})")
axes[0].set(title="reward (5-step mean)", xlabel="step")
axes[1].set(title="std of π_old / π_rollout", xlabel="step")
axes[2].set(title="largest π_old / π_rollout", xlabel="step")
axes[2].axhline(2.0, color="red", lw=0.8, ls="--", label="TIS cap")
axes[3].set(title="PPO clip fraction", xlabel="step")
axes[0].legend()
axes[2].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Why the effect is small here. With one update per batch the PPO ratio is exactly 1 at the
# update, so the clip fraction is 0 in both runs: clipping never sees the mismatch (§1). It
# enters only through TIS's weights: the typical token's ratio is within a few percent of 1,
# but a batch's *largest* can pass the cap when a tail token is sampled (the spikes). TIS
# truncates exactly those tokens, so the runs see nearly the same gradients (one seed: read a
# gap in final accuracy as noise). The effect grows with what this scale lacks: long
# completions, a flatter policy, MoE routing flips, many updates per batch. Monitor the
# measurements, not the rewards: the loop's `logprob_diff_abs` and ratio spread are TRL's
# `sampling/sampling_logp_difference` and `sampling/importance_sampling_ratio`.

# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/02_mismatch.py`. Fill them in, then grade:
#
# ```
# python -m minirl.grade --only 02
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 2.1 | `clip_bounds` | 0.20 -> (0.16, 0.24) at ε = 0.2, epsilon_high, the cap at probability 1 |
# | 2.2 | `probability_buckets` | edges, counts, mean/max \|Δ log p\|, share outside, empty ones |
# | 2.3 | `stale_parameters` | a planted stale tensor; rounding within tolerance; missing names |
# | 2.4 | `importance_sampling_weights` | the four modes, the cap, masked positions, no gradient |
# | 2.5 | `vocabulary_keep_mask` | min-p threshold, the top token always kept, 0 keeps everything |
#
# Questions to think about (not graded): why does TIS cap only from above? Why can a
# sequence-level weight be far from 1 even when every token's weight is within 5 % of 1?
