# Generated from notebooks/01_single_process.py, notebooks/04_fsdp_lora.py, notebooks/05_generation_speed.py
# by tools/build.py -- edit the notebook, not this file.
"""The rollout-engine registry: a name maps to a factory, and the factory imports its backend.

Notebook 01 registers "hf" and "shared_prefix", notebook 04 "vllm", notebook 05 "paged".
"""

__all__ = ["runs_anywhere", "EngineEntry", "ENGINES", "register_engine", "check_engine",
           "build_engine", "build_hf", "build_shared_prefix", "build_vllm", "build_paged"]

from dataclasses import dataclass
from typing import Callable

from minirl.config import RLConfig
from minirl.runtime.validate import ConfigError
from minirl.runtime.vllm_check import vllm_problem


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


@register_engine("vllm", problem=vllm_problem)
def build_vllm(config: RLConfig, model, tokenizer, device, *, colocate: bool = False, prompts=(),
               **settings):
    """vLLM in this process (notebook 04). colocate: sleep after generating; prompts: the task's,
    which size max_model_len; settings: gpu_memory_utilization, max_num_batched_tokens."""
    from minirl.rollout.vllm import VLLMEngine  # noqa: PLC0415 (vLLM loads when built)
    from minirl.runtime.vllm_setup import task_model_len  # noqa: PLC0415

    context = getattr(model.config, "max_position_embeddings", None)
    new_tokens = config.sampling.max_completion_length
    length = task_model_len(tokenizer, prompts, new_tokens, context) if prompts else None
    return VLLMEngine(model, tokenizer, dtype=config.engine_dtype, device=device, colocate=colocate,
                      seed=config.run.seed, max_model_len=length, **settings)


@register_engine("paged")
def build_paged(config: RLConfig, model, tokenizer, device, **options):
    """Notebook 05's engine: paged KV cache, continuous batching, prefix caching; no options."""
    from minirl.rollout.engine.engine import PagedEngine  # noqa: PLC0415 (loads when built)
    return PagedEngine(model, tokenizer, config.engine_dtype, device=device)
