# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""The source's symptom table as rules, and which of them fire for a run's measurements.

A value the run did not record is None ("not measured") and never fires. Applying the rules
to a run directory is `minirl.runtime.diagnosis_report.diagnose`.
"""

__all__ = ["Rule", "RULES", "rules_that_fire"]

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One row of the source's symptom table."""

    name: str
    symptom: str
    measures: str
    threshold: float
    above: bool              # fires when the value is above the threshold (False: below)
    source_threshold: str    # as the source's table states it
    direction: str           # what the source says to try, in our words
    unit: str = "share"      # how values print: "share" (0-1, as %), "ratio" (x.xx) or "count"


RULES = (
    Rule("slow_rollout", "slow rollout", "generation's share of the run's time", 0.80, True,
         "more than 80 % of total time",
         "add rollout devices, enable prefix caching, raise the batch size, or deploy the "
         "rollout separately"),
    Rule("slow_sync", "slow weight synchronization", "the weight sync's share of the run's time",
         0.05, True, "more than 5 %",
         "synchronize only LoRA adapters, pack the NCCL transfers, or synchronize less often"),
    Rule("heavy_communication", "heavy cross-device communication",
         "collectives' share of the run's time (all-reduce, all-gather, ...)", 0.10, True,
         "all-reduce/all-gather over 10 %",
         "more micro-batches, gradient accumulation, or a different parallel partition"),
    Rule("activation_oom", "activation out of memory", "out-of-memory errors the run recorded",
         0.0, True, "CUDA out of memory during training",
         "enable gradient checkpointing, shorten the maximum sequence length, or shrink the batch",
         "count"),
    Rule("expert_imbalance", "expert load imbalance",
         "the hottest expert's (or rank's) load over the coldest's", 2.0, True,
         "some GPUs at 90 % while others are near 30 %",
         "add an expert-balancing loss and adjust the routing or the expert-parallel placement",
         "ratio"),
    Rule("stragglers", "stragglers", "the longest completion over the mean, per step, averaged",
         2.0, True, "the longest sequence determines the batch time (no number given)",
         "bucket sequences by length, or group them by predicted length", "ratio"),
    Rule("low_mfu", "low MFU", "the lower of the trainer's and the rollout's MFU", 0.30, False,
         "below 30 % MFU",
         "inspect communication, data loading and rollout waiting in the time decomposition"),
)


def rules_that_fire(measured: dict[str, float | None],
                    rules: tuple[Rule, ...] = RULES) -> list[str]:
    """The names of the rules that fire, in the order of `rules`.

    measured: rule name -> measured value, or None when the run did not record it (a rule
    missing from `measured` is not measured either). A rule with above=True fires when its
    value is strictly greater than its threshold; with above=False, strictly less. A value
    that is not measured (None) or not a number (NaN) never fires. Values and thresholds are
    in the same units (shares 0-1, not percent).
    """
    fired = []
    for rule in rules:
        value = measured.get(rule.name)
        if value is None or math.isnan(value):
            continue
        if (value > rule.threshold) if rule.above else (value < rule.threshold):
            fired.append(rule.name)
    return fired
