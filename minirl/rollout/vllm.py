# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The vLLM engine behind the rollout protocol: paged KV cache, prefix caching, sleep mode, in-place weight loads.

Written against vLLM's offline API as TRL's colocate mode uses it: one `vllm.LLM` per
training process (`distributed_executor_backend="external_launcher"` under torchrun), prefix
caching on, log-probs after the temperature, `SamplingParams(n=G, logprobs=0, seed=...)` per
prompt, `sleep(level=2)` after generating, and `reset_prefix_cache()` after every push.
Weights go in through vLLM's public `collective_rpc("reload_weights")` (the tensors passed
as an iterator: the external launcher runs the worker in this process, so nothing is
copied), or, where it is missing or refuses before taking a tensor, the internal chain TRL
uses (`weight_api` says which). Sizing, start-up, memory and sleep: `minirl/runtime/vllm_setup.py`.

Simplified vs TRL: tensor parallel size 1, no server mode, no LoRA adapters inside vLLM.
"""

__all__ = ["VLLMEngine"]

import os
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import VersionMismatchError, check_request, check_tokenizer, draw_seed
from minirl.runtime.prompt_seeds import prompt_seed
from minirl.runtime.vllm_setup import (
    INTERNAL_API,
    PUBLIC_API,
    PushStream,
    VLLMSupport,
    free_port,
    import_vllm,
    padded_rollout,
    start_llm,
    vllm_settings,
)


class VLLMEngine(VLLMSupport):
    """A vLLM `LLM` in this process, holding version `version` of the policy.

    model, tokenizer: the policy to start from (written to a temporary directory that vLLM
    loads, then removed); dtype: vLLM's compute dtype ("auto": bfloat16); colocate: sleep
    after generating, wake before loading weights and before generating;
    gpu_memory_utilization: the share of the GPU vLLM may take; max_model_len: the longest
    prompt plus completion (None: the model's context; see `task_model_len`);
    max_num_batched_tokens: tokens per scheduler step (at least max_model_len).
    """

    def __init__(self, model, tokenizer, dtype: str = "auto", device=None, *, colocate: bool = True,
                 gpu_memory_utilization: float = 0.3, seed: int = 0, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 4096):
        dtype, max_model_len = vllm_settings(model, dtype, gpu_memory_utilization, max_model_len,
                                             max_num_batched_tokens)
        vllm = import_vllm()
        check_tokenizer(tokenizer)
        self.tokenizer, self.dtype, self.colocate, self.max_model_len = tokenizer, dtype, colocate, max_model_len
        self.device = torch.device(device if device is not None else "cuda")
        self.names = list(model.state_dict())
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)                # external_launcher reads torchrun's variables
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        free_before = self._free_bytes()
        self.llm = start_llm(vllm, model, tokenizer, dtype=dtype, seed=seed, enable_sleep_mode=colocate,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             max_num_batched_tokens=max(max_num_batched_tokens, max_model_len or 0))
        self.held = max(0, free_before - self._free_bytes())   # weights, KV cache, CUDA graphs: vLLM's
        self.SamplingParams = vllm.SamplingParams
        self.weight_api = PUBLIC_API if callable(getattr(self.llm, "collective_rpc", None)) else INTERNAL_API
        self.version, self.ready, self.sleeping = 0, True, set()   # sleeping: the tags vLLM has released

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """G samples per prompt with the sampled tokens' log-probs (after temperature); rows i*G .. i*G+G-1
        continue prompts[i]. With a generator, each prompt samples from `prompt_seed(s, prompt)`, s drawn
        from it, so a batch's samples do not depend on how it is split over ranks."""
        check_request(self, prompts, sampling, expected_version)
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep, or the last load_weights did not "
                               "complete); push the trainer's weights before generating")
        G, C, tok = sampling.num_generations, sampling.max_completion_length, self.tokenizer
        ids = self._prompt_ids(prompts, C)
        self._wake(("weights", "kv_cache"))
        seed = draw_seed(generator)
        params = [self.SamplingParams(n=G, temperature=sampling.temperature, max_tokens=C, logprobs=0,
                                      seed=None if seed is None else prompt_seed(seed, p)) for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        rows = [(p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
                for p, out in zip(ids, outputs, strict=True) for c in out.outputs]                   # N = B * G rows
        if self.colocate:
            self.sleep()
        return padded_rollout(tok, prompts, G, rows, self.version)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream the trainer's tensors (Hugging Face names) into vLLM's model in place; then reset the prefix cache.

        Raises VersionMismatchError for an older version, ValueError for an unknown name or
        names missing at the end (after which the engine refuses to generate until a full push).
        """
        if version < self.version:
            raise VersionMismatchError(f"load_weights(version={version}) but the vLLM engine holds version "
                                       f"{self.version}: refusing to go back to older weights")
        self._wake(("weights",))                              # the KV cache stays released until generate
        self.ready = False
        stream = PushStream(named_tensors, set(self.names), version)
        self._push(stream)
        missing = [n for n in self.names if n not in stream.seen]
        if missing:
            raise ValueError(f"VLLMEngine.load_weights(version={version}): {len(missing)} tensors never pushed "
                             f"(first: {missing[0]}); push all of them")
        self.llm.reset_prefix_cache()                         # cached prefixes belong to the old weights
        self.version, self.ready = version, True
