"""A rank's engine and a rank's record for notebook 04's `minirl.parallel.spmd`: plumbing around the SPMD step.

Hand-written. `build_rank_engine` builds this rank's engine through the engine registry: an
engine that colocates itself (vLLM's sleep mode: the `Colocated` protocol) is used as built;
an in-process one is wrapped in `ColocatedEngine` (and `SeedPerPrompt` with
`--seed-per-prompt`). `sync_due` says which steps push with `--sync-every K`, and the others
push a `KeepWeights`. `rank_records` gathers what each rank measured on its own share: the
mean of the ranks' per-reward means (equal shares), the reward errors, each rank's stage times.
"""

import math

from minirl.config import RLConfig
from minirl.rollout.base import Colocated
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.registry import build_engine
from minirl.runtime.prompt_seeds import SeedPerPrompt
from minirl.sync.base import SyncReport


def build_rank_engine(config: RLConfig, pconfig, model, tokenizer, device, prompts=()):
    """This rank's engine holding a copy of `model` (version 0), built by the engine registry, colocated.

    An engine that colocates itself (vLLM's sleep mode: the `Colocated` protocol) is used as
    built; an in-process one is wrapped in `ColocatedEngine` (and `SeedPerPrompt`).
    prompts: the task's, which size vLLM's max_model_len (the model's context without them)."""
    engine = build_engine(config, model, tokenizer, device, colocate=pconfig.colocate, prompts=tuple(prompts),
                          gpu_memory_utilization=pconfig.vllm_gpu_memory_utilization,
                          max_num_batched_tokens=pconfig.vllm_max_num_batched_tokens)
    if isinstance(engine, Colocated):
        return engine
    if pconfig.seed_per_prompt:
        engine = SeedPerPrompt(engine)
    return ColocatedEngine(engine, colocate=pconfig.colocate, adapter_only=pconfig.resolved_sync_mode == "adapter")


def rank_records(record: dict, group) -> dict:
    """The record's per-rank numbers made global (every rank calls it: a collective).

    `rewards/<name>`: the mean of the ranks' means (a rank whose rows all returned None, NaN, left out);
    what reward functions logged with TRL's `log_metric` (`log_metric_counts` names them): the mean over
    every rank's values, as TRL sums and counts them over its processes."""
    counts = record.get("log_metric_counts", {})
    local = {k: v for k, v in record.items() if k.startswith(("time/", "rewards/")) or k in counts
             or k in ("reward_errors", "log_metric_counts")}
    everyone = group.gather_objects(local)
    out = {}
    for key in local:
        if key.startswith("rewards/"):
            means = [r[key] for r in everyone if key in r and not math.isnan(r[key])]
            out[key] = sum(means) / len(means) if means else math.nan
    names = dict.fromkeys(n for r in everyone for n in r.get("log_metric_counts", {}))
    if names:
        totals = {n: sum(r[n] * r["log_metric_counts"][n] for r in everyone if n in r.get("log_metric_counts", {}))
                  for n in names}
        counts = {n: sum(r.get("log_metric_counts", {}).get(n, 0) for r in everyone) for n in names}
        out |= {n: totals[n] / counts[n] for n in names} | {"log_metric_counts": counts}
    out["reward_errors"] = sum(r.get("reward_errors", 0) for r in everyone)
    out["time_by_rank"] = [{k: v for k, v in r.items() if k.startswith("time/")} for r in everyone]
    return out


class KeepWeights:
    """The sync of a step that does not synchronize: it moves nothing and reports the version the engine
    holds, so the next batch is generated, checked and logged as the older policy it is."""

    def push(self, named_weights, engine, version: int) -> SyncReport:
        return SyncReport(engine.version, 0, 0, 0.0)


def sync_due(step: int, pconfig, config: RLConfig) -> bool:
    """Whether step `step` (1, 2, ...) pushes: every `sync_every`-th, and always the steps that evaluate
    (the engine's copy is measured), checkpoint (a resume refills the engine) or end the run."""
    run = config.run
    return (step % pconfig.sync_every == 0 or step == run.steps
            or bool(run.eval_every and step % run.eval_every == 0)
            or bool(run.checkpoint_every and step % run.checkpoint_every == 0))
