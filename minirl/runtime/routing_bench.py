"""Measuring GSPO's case on a MoE policy: token and sequence ratios under routing noise, with and without R3.

Hand-written (a measurement harness; notebook 08 section 4 teaches the two ratios, in
`minirl.diagnostics.routing.ratio_spread`, and notebook 02 the route recorder and route replay it uses).

`routing_ratio_spread(model, tokenizer, prompts, rollout_dtype)` samples completions with a low-precision
copy of a MoE policy while recording its routes, recomputes their log-probabilities in fp32 twice (with the
trainer's own routes, and with the rollout's routes replayed: R3), and returns `ratio_spread` of each, the
share of completion tokens whose route flipped (a token counts as flipped when any layer chose another
expert set at the position that produced its logits), the token-ratio variance split by flip, and the
flipped tokens' share of the token variance.

`ratio_level_runs(moe, tokenizer, runs, steps)` is notebook 08's training comparison: one RL run per entry
of `runs` (name -> RLConfig settings, e.g. token-level ratios against GSPO's sequence-level ones), each from
a copy of the MoE with an fp8 rollout, two updates per batch and truncated importance sampling against the
rollout; it prints TRL's and minirl's TIS defaults (the runs name their mode, so neither decides them) and
a table of each run's loss type, held-out accuracy, mean reward, clipped share and gradient norm.

Simplified on purpose: one rollout batch, the trainer in fp32.
"""
import torch

from minirl.config import SamplingConfig
from minirl.diagnostics.mismatch import trainer_logprobs
from minirl.diagnostics.routing import ratio_spread
from minirl.models.moe import replay_routes
from minirl.rollout.hf import HFEngine
from minirl.runtime.moe_routes import RouteRecorder


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


def ratio_level_runs(moe, tokenizer, runs: dict[str, dict], steps: int, progress: bool = False) -> dict:
    """Train a copy of `moe` per entry of `runs`; print the TIS defaults and a table; return name -> metrics."""
    import copy
    import statistics
    from dataclasses import fields

    from trl import GRPOConfig

    from minirl.config import AlgorithmConfig, RLConfig
    from minirl.train.run import train

    trl, ours = ({f.name: f.default for f in fields(c)} for c in (GRPOConfig, AlgorithmConfig))
    print(f"TIS defaults: TRL {trl['vllm_importance_sampling_mode']!r} (cap "
          f"{trl['vllm_importance_sampling_clip_max']}), minirl {ours['importance_sampling_mode']!r} "
          f"(cap {ours['importance_sampling_cap']})")
    results = {}
    print(f"{'ratio level':>15} | {'loss_type':>9} | {'accuracy: start, middle, end':>28} | "
          f"{'reward':>6} | {'clipped':>7} | {'grad norm':>9}")
    for name, settings in runs.items():
        config = RLConfig.from_flat(steps=steps, prompts_per_step=16, num_iterations=2,
                                    eval_every=max(1, steps // 2), rollout_dtype="float8_e4m3fn",
                                    importance_sampling_correction=True, **settings)
        metrics = results[name] = train(config, copy.deepcopy(moe), tokenizer, progress=progress)
        rows = [m for m in metrics if "reward" in m]
        accuracy = " ".join(f"{m['accuracy']:.3f}" for m in metrics if "accuracy" in m)
        print(f"{name:>15} | {config.algorithm.loss_type:>9} | {accuracy:>28} | "
              f"{statistics.mean(m['reward'] for m in rows):>6.3f} | "
              f"{statistics.mean(m['clip_ratio/region_mean'] for m in rows):>7.3f} | "
              f"{statistics.mean(m['grad_norm'] for m in rows):>9.2f}")
    return results
