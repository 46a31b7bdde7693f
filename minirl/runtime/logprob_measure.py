"""Measuring the mismatch: sample with a rollout engine, recompute with the trainer, keep both, aligned.

Hand-written (a measurement harness). Notebook 02 shows the two calls it makes (the rollout
engine's `generate`, which records the behaviour log-probs, and the trainer's recomputation
`trainer_logprobs`), then uses these to repeat them across precisions and temperatures:
`measure_logprobs` returns a `LogprobPair` of [B, C] tensors whose `stats()` and `buckets()` are
notebook 02's `mismatch_stats` and `probability_buckets`; `compare_routes` does the same for a
mixture-of-experts policy, recording the rollout's expert routes and recomputing without and with
Rollout Routing Replay (`minirl.models.moe.replay_routes`).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.models.moe import replay_routes
from minirl.rollout.hf import HFEngine
from minirl.runtime.moe_routes import RouteRecorder, route_agreement


@dataclass
class LogprobPair:
    """The same sampled tokens scored by the rollout engine and by the trainer. All [B, C]."""

    trainer_logps: Tensor
    behavior_logps: Tensor
    mask: Tensor
    completion_ids: Tensor
    rollout_dtype: str
    train_dtype: str

    def stats(self, low: float = 0.8, high: float = 1.25) -> dict[str, float]:
        from minirl.diagnostics.mismatch import mismatch_stats  # noqa: PLC0415 (it imports this module)

        return mismatch_stats(self.trainer_logps, self.behavior_logps, self.mask, low, high)

    def buckets(self, edges: tuple[float, ...] | None = None) -> list[dict]:
        from minirl.diagnostics.mismatch import PROBABILITY_EDGES, probability_buckets  # noqa: PLC0415

        return probability_buckets(self.trainer_logps, self.behavior_logps, self.mask, edges or PROBABILITY_EDGES)


def measure_logprobs(model, tokenizer, prompts: list[str], rollout_dtype: str = "bfloat16",
                     train_dtype: str = "float32", num_generations: int = 8, max_new_tokens: int = 4,
                     temperature: float = 1.0, seed: int = 0, rollout=None) -> LogprobPair:
    """Sample with a rollout engine in `rollout_dtype`, recompute in `train_dtype`; both log-probs.

    model: the trainer's policy (an HF causal LM). rollout: an HFEngine to use as it is
    (its own dtype and version); when None a fresh HFEngine(model, tokenizer, rollout_dtype)
    is built, so it holds exactly the trainer's weights. Returns a LogprobPair of [B*G, C].
    """
    from minirl.diagnostics.mismatch import trainer_logprobs  # noqa: PLC0415 (it imports this module)

    device = next(model.parameters()).device
    if rollout is None:
        rollout = HFEngine(model, tokenizer, dtype=rollout_dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    batch = rollout.generate(prompts, SamplingConfig(num_generations, max_new_tokens, temperature),
                             generator=generator)
    trainer = trainer_logprobs(model, batch, train_dtype, temperature)
    return LogprobPair(trainer, batch.logprobs.float(), batch.completion_mask, batch.completion_ids,
                       getattr(rollout, "dtype", rollout_dtype), train_dtype)


def compare_routes(model, tokenizer, prompts: list[str], rollout_dtype: str = "bfloat16",
                   num_generations: int = 8, max_new_tokens: int = 4, temperature: float = 1.0,
                   seed: int = 0) -> dict[str, float]:
    """Route agreement and log-prob gap between a rollout copy and the fp32 trainer, without and with R3.

    Returns route_agreement / route_agreement_r3 (share of (layer, token) top-k sets that match
    the rollout's, over real prompt and completion tokens) and mean/max |delta log p| of the
    sampled tokens without (`mean_abs_delta`) and with replay (`mean_abs_delta_r3`).
    """
    from minirl.diagnostics.mismatch import mismatch_stats, trainer_logprobs  # noqa: PLC0415

    rollout = HFEngine(model, tokenizer, dtype=rollout_dtype, device=next(model.parameters()).device)
    with RouteRecorder(rollout.model) as recorder:
        batch = rollout.generate(prompts, SamplingConfig(num_generations, max_new_tokens, temperature),
                                 generator=torch.Generator().manual_seed(seed))
    rows = batch.prompt_ids.shape[0]
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)           # [B, T]
    total = attention.shape[1]
    recorded = recorder.routes(rows)[:, :, :total]                                     # [L, B, <=T, k]
    if recorded.shape[2] < total:   # the last token is never fed back during generation
        pad = recorded[:, :, -1:].expand(-1, -1, total - recorded.shape[2], -1)
        recorded = torch.cat([recorded, pad], dim=2)                                   # [L, B, T, k]
    compare = attention.clone()
    compare[:, -1] = 0                                   # its route was never recorded: do not score it
    with RouteRecorder(model) as recorder:
        plain = trainer_logprobs(model, batch, "float32", temperature)
    trainer_routes = recorder.routes(rows)
    with replay_routes(model, recorded), RouteRecorder(model) as recorder:
        replayed = trainer_logprobs(model, batch, "float32", temperature)
    replay_routes_seen = recorder.routes(rows)
    before = mismatch_stats(plain, batch.logprobs.float(), batch.completion_mask)
    after = mismatch_stats(replayed, batch.logprobs.float(), batch.completion_mask)
    return dict(route_agreement=route_agreement(recorded, trainer_routes, compare),
                route_agreement_r3=route_agreement(recorded, replay_routes_seen, compare),
                mean_abs_delta=before["mean_abs_delta"], mean_abs_delta_r3=after["mean_abs_delta"],
                max_abs_delta=before["max_abs_delta"], max_abs_delta_r3=after["max_abs_delta"],
                share_outside=before["share_outside"], share_outside_r3=after["share_outside"])
