"""TRL's GRPOConfig names in a `--config` file: a YAML written for TRL runs on minirl's chapters as is.

Hand-written (it teaches nothing). `translate` turns the settings of a YAML file into the chapter's
own, before the parser types and checks them (runtime/cli.py's ConfigFileParser calls it):

- a setting the chapter has under the same name (`learning_rate`, `num_generations`, `beta`,
  `loss_type`, `seed`, ...) is the chapter's, unchanged;
- a TRL name for one of the chapter's settings is renamed (`max_steps` -> `steps`, `save_steps` ->
  `checkpoint_every`, `lora_r` -> `lora_rank`, `use_vllm: true` -> `rollout_engine: vllm`, ...), and
  TRL's batch (`per_device_train_batch_size` x `gradient_accumulation_steps` x ranks completions,
  `num_generations` per prompt) becomes the chapter's `prompts_per_step`; TRL's switch
  `log_completions: true` becomes 4 rows per logged step (`num_completions_to_print` rows when set);
- a TRL setting this chapter does not use (LoRA in chapter 01, `logging_steps`, `report_to`, ...) is
  ignored, and one line on stderr names every such setting (others at TRL's defaults are counted);
- a TRL setting set to a value no chapter can honour (`top_p: 0.9`, `mask_truncated_completions:
  true`, `vllm_mode: server`, ...) is refused, with the reason and the fix.
`TRL_DEFAULTS` are the GRPOConfig defaults a run on the user's data takes where nothing was set
(`training_cli.data_defaults`). TRL's defaults are read from `trl.GRPOConfig` itself, imported only
when the file names a setting outside the tables below (a `GRPOConfig(...).to_dict()` dump names all 191).
"""

from __future__ import annotations

import dataclasses
import enum
import math

LOG_COMPLETIONS_ON = 4    # rows per logged step for TRL's `log_completions: true` (num_completions_to_print: that many)
TRL_RENAMED = {           # TRL's name -> the chapter's setting of the same meaning
    "max_steps": "steps", "save_steps": "checkpoint_every", "save_total_limit": "keep_checkpoints",
    "eval_steps": "eval_every", "output_dir": "out", "model_name_or_path": "model", "dataset_name": "dataset",
    "reward_funcs": "reward", "lora_r": "lora_rank", "activation_checkpointing": "gradient_checkpointing",
    "dataset_train_split": None,
}
WHY_IGNORED = {       # TRL's setting -> why a chapter without it can run on regardless
    "logging_steps": "minirl logs every step",
    "logging_strategy": "minirl logs every step",
    "report_to": "this chapter writes metrics.jsonl only",
    "log_completions": "this chapter trains nothing",
    "max_prompt_length": "prompts are never cut",
    "use_peft": "this chapter trains every weight; LoRA: chapter 04",
    "bf16": "this chapter computes in --dtype (mixed precision: chapter 04)",
    "fp16": "this chapter computes in --dtype",
    "gradient_checkpointing": "this chapter does not checkpoint activations; chapter 04 does",
    "activation_checkpointing": "this chapter does not checkpoint activations; chapter 04 does",
    "eval_strategy": "the held-out accuracy is measured every --eval-every steps",
    "num_train_epochs": "minirl runs --steps steps",
    "lr_scheduler_type": "this chapter keeps the learning rate constant",
    "warmup_ratio": "this chapter keeps the learning rate constant",
    "lr_scheduler_kwargs": "not used",
    "warmup_steps": "this chapter keeps the learning rate constant",
}
# TRL 1.16's GRPOConfig defaults that a run on the user's data (--dataset) takes where the user set nothing
# (minirl.runtime.training_cli.data_defaults); the embedded task keeps the chapter's own, tuned for it.
# tests/test_config_file.py compares them with trl.GRPOConfig's.
TRL_DEFAULTS = {"max_completion_length": 512, "learning_rate": 1e-6, "seed": 42, "lr_scheduler_type": "linear",
                "warmup_steps": 0.0}
REFUSED = {           # TRL's setting -> (the value every chapter has, why, as a sentence)
    "mask_truncated_completions": (False, "minirl trains on truncated completions as they are"),
    "vllm_mode": ("colocate", "minirl runs vLLM inside the training process (colocate); no vLLM server"),
    "top_p": (1.0, "minirl samples from the whole distribution (top_p 1)"),
    "top_k": (0, "minirl samples from the whole distribution (top_k 0)"),
    "min_p": (None, "minirl samples from the whole distribution"),
    "repetition_penalty": (1.0, "minirl samples without a repetition penalty"),
}
# The fields of trl.GRPOConfig 1.16 (requirements.txt's pin; tests/test_config_file.py compares): a name
# outside them and outside the chapter's settings is a typo, refused without importing TRL.
GRPO_FIELDS = frozenset("""
    accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2
    adam_epsilon auto_find_batch_size average_tokens_across_devices batch_eval_metrics beta bf16
    bf16_full_eval cache_implementation cast_lm_head_to_fp32 chat_template_kwargs data_seed
    dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
    dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend
    ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug
    deepspeed delta disable_dropout disable_tqdm do_eval do_predict do_train ds3_gather_for_generation
    enable_jit_checkpoint entropy_coef entropy_coef_delta entropy_coef_max entropy_coef_min entropy_target
    epsilon epsilon_high eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start eval_steps
    eval_strategy eval_use_gather_object fp16 fp16_full_eval fsdp fsdp_config full_determinism
    generation_batch_size generation_kwargs gradient_accumulation_steps gradient_checkpointing
    gradient_checkpointing_kwargs greater_is_better hub_always_push hub_model_id hub_private_repo
    hub_revision hub_strategy hub_token ignore_data_skip importance_sampling_level include_for_metrics
    include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
    liger_kernel_config load_best_model_at_end local_rank log_completions log_completions_hub_repo log_level
    log_level_replica log_multimodal log_on_each_node log_unique_prompts logging_first_step
    logging_nan_inf_filter logging_steps logging_strategy loss_type lr_scheduler_kwargs lr_scheduler_type
    mask_truncated_completions max_completion_length max_grad_norm max_steps max_tool_calling_iterations
    metric_for_best_model min_p model_init_kwargs multi_objective_aggregation neftune_noise_alpha
    num_completions_to_print num_generations num_generations_eval num_iterations num_train_epochs
    off_policy_mask_threshold optim optim_args optim_target_modules output_dir pad_to_multiple_of
    parallelism_config per_device_eval_batch_size per_device_train_batch_size prediction_loss_only project
    push_to_hub ref_model_mixup_alpha ref_model_sync_steps remove_unused_columns repetition_penalty
    report_to restore_callback_states_from_checkpoint resume_from_checkpoint reward_weights
    router_aux_loss_coef run_name sapo_temperature_neg sapo_temperature_pos save_on_each_node
    save_only_model save_steps save_strategy save_total_limit scale_rewards seed shuffle_dataset
    skip_memory_metrics steps_per_generation sync_ref_model temperature tf32 top_entropy_quantile top_k
    top_p torch_compile torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id
    trackio_space_id trackio_static_space_id train_sampling_strategy transformers_continuous_batching_config
    trust_remote_code use_adaptive_entropy use_bias_correction_kl use_cache use_cpu use_liger_kernel
    use_transformers_continuous_batching use_transformers_paged use_vllm vespo_k_neg vespo_k_pos
    vespo_lambda_neg vespo_lambda_pos vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port
    vllm_importance_sampling_cap vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min
    vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_max_model_length vllm_mode
    vllm_model_impl vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
    vllm_structured_outputs_regex vllm_tensor_parallel_size warmup_steps weight_decay
""".split())


class TRLConfigError(ValueError):
    """A TRL setting no chapter can honour: the message names it, its value, why, and the fix."""


def translate(data: dict, settings: set[str], world_size: int = 1) -> tuple[dict, list[str]]:
    """({chapter setting: value}, [ignored settings, as "name=value (why)"]) for a config file's mapping.

    `settings`: the chapter's setting names. A name neither the chapter's nor TRL's is kept as it is,
    for the parser to refuse with its nearest names. Raises TRLConfigError.
    """
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    ours = {k: v for k, v in data.items() if k in settings}
    if isinstance(ours.get("report_to"), list):              # TRL's to_dict() writes a list: [] is none
        trackers = [t for t in ours["report_to"] if t != "none"]
        if len(trackers) > 1:
            raise TRLConfigError(f"report_to: {trackers}: minirl reports to one tracker at a time; keep one")
        ours["report_to"] = trackers[0] if trackers else "none"
    if isinstance(ours.get("log_completions"), bool):        # TRL's switch; ours: rows per logged step
        shown = data.get("num_completions_to_print")
        ours["log_completions"] = (shown or LOG_COMPLETIONS_ON) if ours["log_completions"] else 0
    if isinstance(ours.get("lora_target_modules"), list):    # TRL writes a list; the flag takes q_proj,v_proj
        ours["lora_target_modules"] = ",".join(map(str, ours["lora_target_modules"]))
    trl = {k: v for k, v in data.items() if k not in settings}
    ignored: list[str] = []

    def put(name: str, value, trl_name: str) -> None:
        if name in ours and ours[name] != value:
            raise TRLConfigError(f"{trl_name}: {value!r} and {name}: {ours[name]!r} set the same thing; keep one")
        ours[name] = value

    def ignore(name: str, why: str | None = None) -> None:
        ignored.append(f"{name}={_show(trl[name])} ({why or WHY_IGNORED.get(name, 'not used here')})")

    if trl.get("dataset_config") and "dataset" in settings and trl.get("dataset_name"):   # TRL's ScriptArguments
        trl["dataset_name"] = f"{trl['dataset_name']}:{trl.pop('dataset_config')}"
    _batch(trl, ours, settings, world_size, put)
    for name in list(trl):
        value = trl[name]
        if name in ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                    "steps_per_generation"):
            continue                                        # done by _batch
        if name == "num_completions_to_print" and "log_completions" in settings:
            del trl[name]                                   # with log_completions, above (None: TRL's "all")
            continue
        if name in REFUSED:
            honoured, why = REFUSED[name]
            if value != honoured:
                raise TRLConfigError(f"{name}: {_show(value)}: {why}; remove it or set it to {_show(honoured)}")
        elif name == "max_steps" and value is not None and value < 0:
            ignore(name, "TRL then trains num_train_epochs epochs; minirl runs --steps steps: set max_steps")
        elif name in ("save_total_limit", "eval_steps") and value is None:
            continue                                        # TRL's "not set"
        elif name == "save_strategy":
            if value == "no" and "checkpoint_every" in settings:
                put("checkpoint_every", 0, name)
            elif value not in ("steps", "no"):
                raise TRLConfigError(f"save_strategy: {value!r}: minirl has no epochs; use steps with save_steps")
        elif name == "eval_strategy":
            if value not in ("no", "steps"):
                raise TRLConfigError(f"eval_strategy: {value!r}: minirl has no epochs; use steps with eval_steps")
            if value == "no":
                ignore(name)
        elif name == "use_vllm":
            if value and "rollout_engine" in settings:
                put("rollout_engine", "vllm", name)
            elif value:
                ignore(name, "this chapter has no --rollout-engine")
        elif name == "use_peft" and "lora_rank" in settings:
            put("lora_rank", int(trl.get("lora_r", 16)) if value else 0, name)
        elif name in ("lora_r", "lora_alpha", "lora_target_modules", "lora_dropout"):
            if not trl.get("use_peft", False) or "lora_rank" not in settings:
                pass                                        # inactive in TRL too, or said once by use_peft
            elif name == "lora_alpha":
                put("lora_alpha", float(value), name)
            elif name == "lora_target_modules" and value is not None:
                put("lora_target_modules", value if isinstance(value, str) else ",".join(value), name)
            elif name == "lora_dropout" and value:
                raise TRLConfigError(f"lora_dropout: {value!r}: minirl's adapters have no dropout (the packed "
                                     "update assumes a forward pass without it); set it to 0")
        elif name in ("bf16", "fp16") and "mixed_precision" in settings:
            if value:
                put("mixed_precision", name, name)
        elif name in ("gradient_checkpointing", "activation_checkpointing") and "gradient_checkpointing" in settings:
            put("gradient_checkpointing", bool(value), name)
        elif name == "warmup_ratio" and "warmup_steps" in settings:
            if value:
                put("warmup_steps", float(value), name)      # transformers 5: a warmup_steps below 1 is a ratio
        elif name in TRL_RENAMED and TRL_RENAMED[name] in settings:
            put(TRL_RENAMED[name], value, name)
        elif name in WHY_IGNORED or name in TRL_RENAMED:
            if value not in (None, False, [], "none", "no"):
                ignore(name)
        else:
            continue                                        # judged against TRL's defaults below
        del trl[name]
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                 "steps_per_generation"):
        trl.pop(name, None)
    ignored += _at_defaults(trl, ours)
    return ours, ignored


def _batch(trl: dict, ours: dict, settings: set[str], world_size: int, put) -> None:
    """TRL's batch as the chapter's prompts_per_step: P x A x ranks completions (or generation_batch_size),
    num_generations of them per prompt."""
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
            "steps_per_generation")
    if not any(trl.get(k) is not None for k in keys) or "prompts_per_step" not in settings:
        return
    per_device, accumulation = trl.get("per_device_train_batch_size", 8), trl.get("gradient_accumulation_steps", 1)
    steps_per_generation = trl.get("steps_per_generation") or accumulation
    if steps_per_generation != accumulation:
        raise TRLConfigError(f"steps_per_generation: {steps_per_generation}: minirl makes one optimizer step per "
                             f"generation batch (num_iterations repeats it); set it to gradient_accumulation_steps")
    completions = trl.get("generation_batch_size") or per_device * accumulation * world_size
    generations = ours.get("num_generations", trl.get("num_generations", 8))
    if completions % generations:
        raise TRLConfigError(f"per_device_train_batch_size: {per_device}: {per_device} x {accumulation} "
                             f"(gradient_accumulation_steps) x {world_size} rank(s) = {completions} completions do "
                             f"not make whole groups of num_generations={generations}; make it a multiple")
    put("prompts_per_step", completions // generations, "per_device_train_batch_size")


def _at_defaults(rest: dict, ours: dict) -> list[str]:
    """Refuse a TRL setting left in `rest` whose value is not TRL's default; [] or one "N more at TRL's defaults"."""
    if not rest:
        return []
    unknown = {k: v for k, v in rest.items() if k not in GRPO_FIELDS}
    ours.update(unknown)                                    # neither ours nor TRL's: the parser names it
    if len(unknown) == len(rest):
        return []
    defaults = trl_defaults()
    changed = {k: v for k, v in rest.items() if k in GRPO_FIELDS and not defaults[k] == v}
    for name, value in changed.items():
        raise TRLConfigError(f"{name}: {value!r}: minirl has no such setting (TRL's default is "
                             f"{_show(defaults[name])}); remove it, or set it to the default")
    quiet = len(rest) - len(unknown)
    return [f"{quiet} more at TRL's defaults"] if quiet else []


def _same(value, default) -> bool:
    if isinstance(default, (list, tuple)) or isinstance(value, (list, tuple)):
        return list(value or []) == list(default or [])
    if isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isclose(value, default)
    return value == default


_DEFAULTS: dict | None = None


def trl_defaults() -> dict:
    """{field: default} of trl.GRPOConfig, as its to_dict() writes them (the raw default, or what the class
    fills in on a CPU: to_dict() of GRPOConfig(use_cpu=True, bf16=False, report_to="none"))."""
    global _DEFAULTS
    if _DEFAULTS is None:
        import warnings  # noqa: PLC0415

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl import GRPOConfig  # noqa: PLC0415 (heavy: only for a file that names TRL's settings)

            made = GRPOConfig(output_dir="trainer_output", use_cpu=True, bf16=False, report_to="none").to_dict()
        raw = {}
        for f in dataclasses.fields(GRPOConfig):
            if f.default is not dataclasses.MISSING:
                raw[f.name] = f.default.value if isinstance(f.default, enum.Enum) else f.default
            elif f.default_factory is not dataclasses.MISSING:
                raw[f.name] = f.default_factory()
        _DEFAULTS = {k: _Either(raw.get(k, made.get(k)), made.get(k, raw.get(k))) for k in set(raw) | set(made)}
    return _DEFAULTS


@dataclasses.dataclass
class _Either:
    """TRL's default for a field: the class's, or what __post_init__ made of it."""

    raw: object
    made: object

    def __eq__(self, other) -> bool:
        return _same(other, self.raw) or _same(other, self.made)

    def __repr__(self) -> str:
        return repr(self.raw)


def _show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
