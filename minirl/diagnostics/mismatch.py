# Generated from notebooks/02_mismatch.py by tools/build.py -- edit the notebook, not this file.
"""Training–inference mismatch: the PPO ratio, measured log-prob gaps, and a diagnosis.

The rollout engine (HF generate with a KV cache, in bf16/fp16/fp8) and the trainer (a full
forward in fp32) compute different probabilities for the same tokens from the same weights.
This module measures that gap token by token (`measure_logprobs`, `mismatch_stats`,
`probability_buckets`) and runs the source's four diagnosis steps as one call
(`diagnose_mismatch`). Simplified on purpose: production systems (veRL, TRL with vLLM, slime)
log the same quantities from a separate inference server; here the rollout engine is an HF
copy in the same process, so every difference comes from precision and computation path.
"""

__all__ = ["ppo_ratio", "clip_bounds", "mismatch_stats", "PROBABILITY_EDGES",
           "probability_buckets", "trainer_logprobs", "diagnose_mismatch"]

import copy

import torch
from torch import Tensor

from minirl.algo.logprobs import completion_logprobs
from minirl.rollout.hf import DTYPES, HFEngine
from minirl.runtime.logprob_checks import check_logprob_pair
from minirl.runtime.logprob_measure import compare_routes, measure_logprobs
from minirl.runtime.mismatch_report import MismatchReport, worst_tokens
from minirl.runtime.moe_routes import routers
from minirl.runtime.sync_checks import check_synchronization, dtype_name


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
    low = old_probs * (1.0 - epsilon)
    high = torch.clamp(old_probs * (1.0 + epsilon_high), max=1.0)
    return low, high


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
