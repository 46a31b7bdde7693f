# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""Model FLOPs utilization (MFU): the FLOPs a step's work needs over what the device could do.

Model FLOPs count what the batch needs (notebook 09, section 3): work an implementation
repeats or wastes lowers MFU. Simplified vs PaLM's and veRL's counters: attention counted
causally, the input embedding not counted, the lengths the step's means. The shape and the
peak come from `minirl.runtime.mfu_inputs`.
"""

__all__ = ["TRAINER_STAGES", "ROLLOUT_STAGES", "forward_flops", "group_forward_flops",
           "training_flops", "generation_flops", "mfu", "step_flops", "MFUReport", "run_mfu"]

from dataclasses import dataclass, field

from minirl.runtime.mfu_inputs import FlopShape

TRAINER_STAGES = ("reference", "advantages", "update", "update_critic")
ROLLOUT_STAGES = ("generate",)


def forward_flops(params: float, layers: int, attn_dim: int, seq_len: float,
                  sequences: float) -> float:
    """FLOPs of one forward pass over `sequences` causal sequences of `seq_len` tokens each.

    params: weights a token is multiplied by (N); layers: L; attn_dim: query heads x head dim (A).
    Per token, 2 N (a multiply and an add per weight). Attention, per layer and per
    (query, key) pair: QK^T costs 2 A and AV costs 2 A. Token t (1-based) attends to t keys
    (itself and the tokens before it), so a sequence of T tokens has T (T + 1) / 2 pairs.
    Returns sequences x (2 N T + 2 L A T (T + 1)), a float (seq_len may be a mean).
    """
    return sequences * (2 * params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1))


def group_forward_flops(params: float, layers: int, attn_dim: int, prompt_len: float,
                        completion_len: float, group_size: int, groups: float) -> float:
    """One forward over `groups` groups of `group_size` completions sharing a prompt, the
    prompt counted once.

    Per group: F(P) for the prompt, and per completion F(P + C) - F(P) (its C tokens attend
    to the prompt and to each other), with F = forward_flops of one sequence.
    """
    def one(length):
        return forward_flops(params, layers, attn_dim, length, 1)
    prompt, whole = one(prompt_len), one(prompt_len + completion_len)
    return groups * (prompt + group_size * (whole - prompt))


def training_flops(params: float, layers: int, attn_dim: int, prompt_len: float,
                   completion_len: float, group_size: int, groups: float) -> float:
    """An update's model FLOPs: the forward and a backward costing two forwards (6 N per token)."""
    return 3 * group_forward_flops(params, layers, attn_dim, prompt_len, completion_len,
                                   group_size, groups)


def generation_flops(params: float, layers: int, attn_dim: int, prompt_len: float,
                     completion_len: float, group_size: int, groups: float) -> float:
    """KV-cached sampling: the prompt once per group, then C - 1 fed-back tokens per completion
    (the last is sampled from the previous forward and never fed back)."""
    return group_forward_flops(params, layers, attn_dim, prompt_len,
                               max(completion_len - 1.0, 0.0), group_size, groups)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """FLOPs / (peak FLOP/s x seconds): the share of the device's arithmetic the work used."""
    return flops / (peak_flops * seconds) if seconds > 0 and peak_flops > 0 else float("nan")


def step_flops(record: dict, config: dict, shape: FlopShape) -> dict[str, float]:
    """One step's model FLOPs for the rollout and the trainer, and the trainer's hardware FLOPs
    (with recomputation).

    record: a step record with `tokens/prompt` and `tokens/completion` (the batch's); config:
    the run's flat settings. The trainer runs forwards without gradients for the reference
    (beta > 0), pi_old (several iterations, the IS correction, or PPO's KL reward) and the
    critic's values (PPO), then num_iterations actor updates and, for PPO, a critic update.
    With LoRA the frozen weights get no gradient: an actor update costs two forwards, not
    three (the adapters' own FLOPs are not counted).
    """
    groups, group_size = config["prompts_per_step"], config["num_generations"]
    rows = groups * group_size
    batch = (record["tokens/prompt"] / rows, record["tokens/completion"] / rows, group_size, groups)
    shape_args = (shape.params, shape.layers, shape.attn_dim)
    forward = group_forward_flops(*shape_args, *batch)
    ppo = config["algo"] == "ppo"
    needs_old = (config["num_iterations"] > 1 or config["importance_sampling_correction"]
                 or (ppo and config["beta"] > 0))
    no_grad = int(config["beta"] > 0) + int(needs_old) + int(ppo)
    updates = config["num_iterations"] + int(ppo)
    actor_update = 2 * forward if config.get("lora_rank") else training_flops(*shape_args, *batch)
    critic_update = int(ppo) * training_flops(*shape_args, *batch)
    trainer = no_grad * forward + config["num_iterations"] * actor_update + critic_update
    recompute = updates * forward if config.get("gradient_checkpointing") else 0.0
    return {"rollout": generation_flops(*shape_args, *batch), "trainer": trainer,
            "trainer_hardware": trainer + recompute}


@dataclass
class MFUReport:
    """Trainer and rollout MFU of a run (None where it cannot be computed; `partial` says why)."""

    trainer: float | None
    rollout: float | None
    trainer_hardware: float | None = None    # HFU: with gradient checkpointing's recomputation
    flops_per_step: dict = field(default_factory=dict)  # trainer, rollout, trainer_hardware: means
    seconds: dict = field(default_factory=dict)         # trainer, rollout: totals over the run
    peak: dict = field(default_factory=dict)            # trainer, rollout: (FLOP/s, how found)
    partial: list[str] = field(default_factory=list)


def run_mfu(records: list[dict], config: dict, shape: FlopShape, peak_trainer: float,
            peak_rollout: float, world_size: int = 1,
            rollout_world_size: int | None = None) -> MFUReport:
    """MFU of the trainer and the rollout over a run's step records (peaks in FLOP/s per device).

    world_size: devices the times were measured across (their FLOPs are the whole batch's);
    rollout_world_size: the rollout's, where it differs (stage 6's pools; default world_size).
    Records without `tokens/prompt` (written before notebook 09 added it) count the
    completions from `completion_length` and the prompts as 0 tokens: a lower bound, said
    in `partial`.
    """
    partial, totals = [], {"rollout": 0.0, "trainer": 0.0, "trainer_hardware": 0.0}
    rows = config["prompts_per_step"] * config["num_generations"]
    old = [r for r in records if "tokens/prompt" not in r]
    if old:
        partial.append(f"{len(old)} record(s) carry no tokens/prompt (written before notebook "
                       "09): their prompts count as 0 tokens, so MFU is a lower bound")
    for record in records:
        if "tokens/prompt" not in record:
            record = {"tokens/prompt": 0,
                      "tokens/completion": record.get("completion_length", 0.0) * rows}
        for key, value in step_flops(record, config, shape).items():
            totals[key] += value
    seconds = {
        "trainer": sum(r.get(f"time/{s}", 0.0) for r in records for s in TRAINER_STAGES),
        "rollout": sum(r.get(f"time/{s}", 0.0) for r in records for s in ROLLOUT_STAGES)}
    peaks = {"trainer": peak_trainer * world_size,
             "rollout": peak_rollout * (rollout_world_size or world_size)}
    result = {k: mfu(totals[k], seconds[k], peaks[k]) if seconds[k] > 0 else None
              for k in ("trainer", "rollout")}
    hardware = (mfu(totals["trainer_hardware"], seconds["trainer"], peaks["trainer"])
                if seconds["trainer"] else None)
    n = max(1, len(records))
    return MFUReport(result["trainer"], result["rollout"], hardware,
                     {k: v / n for k, v in totals.items()}, seconds, partial=partial)
