# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
"""GSPO's case on a MoE policy: token-level vs sequence-level importance ratios under routing noise.

When a low-precision rollout and the fp32 trainer route some tokens to different experts, the
per-token ratio pi_trainer / pi_rollout of those tokens jumps. `ratio_spread` compares the
spread of token ratios exp(d_t) with GSPO's sequence ratios exp(mean_t d_t) (one per
completion, the length-normalized sequence likelihood ratio); `routing_ratio_spread`
measures both on a MoE policy, splits tokens by whether a route flipped, and repeats the
measurement with the rollout's routes replayed (R3).

Simplified on purpose: one rollout batch, the trainer in fp32, and a token counts as
"flipped" when any layer chose another expert set at the position that produced its logits.
"""

__all__ = ["ratio_spread", "routing_ratio_spread"]

import torch
from torch import Tensor

from minirl.algo.logprobs import masked_mean
from minirl.config import SamplingConfig
from minirl.diagnostics.mismatch import trainer_logprobs
from minirl.models.moe import RouteRecorder, replay_routes
from minirl.rollout.hf import HFEngine


def ratio_spread(trainer_logps: Tensor, rollout_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """Variance of token ratios exp(trainer - rollout) over real tokens, and of GSPO's sequence ratios
    exp(mean over each completion's tokens), with their largest deviation from 1. All [B, C]."""
    mask = mask.bool()
    diff = torch.where(mask, trainer_logps - rollout_logps, torch.zeros_like(trainer_logps))   # [B, C]
    token = torch.exp(diff[mask])                                                             # [tokens]
    rows = mask.any(-1)
    sequence = torch.exp(masked_mean(diff, mask.to(diff.dtype), dim=-1))[rows]               # [B']
    token_var, sequence_var = token.var().item(), sequence.var().item()
    return {"tokens": int(mask.sum()), "sequences": int(rows.sum()), "token_var": token_var,
            "sequence_var": sequence_var, "variance_ratio": token_var / max(sequence_var, 1e-30),
            "token_max_dev": (token - 1).abs().max().item(), "sequence_max_dev": (sequence - 1).abs().max().item()}


def routing_ratio_spread(model, tokenizer, prompts: list[str], rollout_dtype: str = "bfloat16",
                         num_generations: int = 8, max_new_tokens: int = 4, temperature: float = 1.0,
                         seed: int = 0) -> dict:
    """Sample with a `rollout_dtype` copy of the MoE `model` (recording its routes), recompute in fp32
    with the trainer's own routes and with the rollout's (R3); returns `ratio_spread` for each, the
    share of completion tokens whose route flipped, the token-ratio variance split by flip, and the flipped
    tokens' share of the token variance (their squared deviations from the mean of all tokens' ratios)."""
    rollout = HFEngine(model, tokenizer, dtype=rollout_dtype)          # HF generate: every call covers all rows
    with RouteRecorder(rollout.model) as recorder:
        batch = rollout.generate(prompts, SamplingConfig(num_generations, max_new_tokens, temperature),
                                 generator=torch.Generator().manual_seed(seed))
    rows, P, C = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    recorded = recorder.routes(rows)[:, :, :P + C]                             # [L, B, <=T, k]
    if recorded.shape[2] < P + C:                                              # the last token is never fed back
        recorded = torch.cat([recorded, recorded[:, :, -1:].expand(-1, -1, P + C - recorded.shape[2], -1)], 2)
    with RouteRecorder(model) as recorder:
        plain = trainer_logprobs(model, batch, "float32", temperature)        # [B, C]
    trainer_routes = recorder.routes(rows)                                     # [L, B, T, k]
    with replay_routes(model, recorded):
        replayed = trainer_logprobs(model, batch, "float32", temperature)
    same = (recorded.sort(-1).values == trainer_routes.sort(-1).values).all(-1).all(0)   # [B, T] every layer agrees
    # completion token c is scored by the logits at position P + c - 1; the route there decides it
    flipped = ~same[:, P - 1:P + C - 1] & batch.completion_mask.bool()          # [B, C]
    mask = batch.completion_mask
    ratios = torch.exp(plain - batch.logprobs)
    split = {name: (ratios[m].var().item() if m.sum() > 1 else float("nan"), int(m.sum()))
             for name, m in (("flipped", flipped), ("kept", mask.bool() & ~flipped))}
    squared = (ratios - ratios[mask.bool()].mean()) ** 2                      # [B, C] about the mean of all tokens
    return {"rollout_dtype": rollout_dtype, "flipped_share": flipped.sum().item() / max(mask.sum().item(), 1),
            "flipped_variance_share": squared[flipped].sum().item() / max(squared[mask.bool()].sum().item(), 1e-30),
            "token_var_flipped": split["flipped"][0], "tokens_flipped": split["flipped"][1],
            "token_var_kept": split["kept"][0], "tokens_kept": split["kept"][1],
            "plain": ratio_spread(plain, batch.logprobs, mask), "r3": ratio_spread(replayed, batch.logprobs, mask)}
