# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The vLLM engine behind the rollout protocol: paged KV cache, prefix caching, sleep mode, in-place weight loads.

Written against vLLM's documented offline API as TRL's colocate mode uses it: one `vllm.LLM`
per training process (`distributed_executor_backend="external_launcher"` under torchrun),
prefix caching on, log-probs after the temperature (`logprobs_mode="processed_logprobs"`),
`SamplingParams(n=G, logprobs=0, seed=...)` per prompt, `sleep(level=2)` after generating and
`wake_up(tags=...)` before loading weights and before generating, weights streamed into the
engine's model with its own `load_weights` (it maps Hugging Face names onto vLLM's fused
layers), and `reset_prefix_cache()` after every push.

Needs vLLM and a CUDA GPU (`pip install -r requirements-gpu.txt`); CI has neither, so only
the tests marked `vllm` run it. Simplified vs TRL: tensor parallel size 1, no server mode,
no LoRA adapters inside vLLM (push merged weights).
"""

__all__ = ["import_vllm", "VLLMEngine"]

import os
import socket
import tempfile
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import VersionMismatchError, check_request, check_tokenizer, draw_seed, make_rollout
from minirl.rollout.colocated import prompt_seed
from minirl.utils.validate import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_vllm():
    """The vllm module, or ConfigError saying how to get it (and that it needs a CUDA GPU)."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError("rollout", "vllm", f"vLLM is not installed ({err}); on a CUDA machine run "
                                             "pip install -r requirements-gpu.txt, or use --rollout minirl") from None
    if not torch.cuda.is_available():
        raise ConfigError("rollout", "vllm", "vLLM's engine needs a CUDA GPU and this machine has none; use "
                                             "--rollout minirl")
    return vllm


class VLLMEngine:
    """A vLLM `LLM` in this process, holding version `version` of the policy.

    model, tokenizer: the policy to start from (saved to a temporary directory that vLLM
    loads); dtype: vLLM's compute dtype; colocate: sleep after generating, wake before
    loading weights and before generating; gpu_memory_utilization: the share of the GPU
    vLLM may take for weights and KV cache (the trainer needs the rest).
    """

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", device=None, *, colocate: bool = True,
                 gpu_memory_utilization: float = 0.3, seed: int = 0, max_model_len: int | None = None):
        vllm = import_vllm()
        check_tokenizer(tokenizer)
        self.tokenizer, self.dtype, self.colocate = tokenizer, dtype, colocate
        self.names = list(model.state_dict())
        self.dir = tempfile.mkdtemp(prefix="minirl-vllm-")
        model.save_pretrained(self.dir)
        tokenizer.save_pretrained(self.dir)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)                # external_launcher reads torchrun's variables
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        self.llm = vllm.LLM(model=self.dir, tokenizer=self.dir, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                            enable_sleep_mode=colocate, logprobs_mode="processed_logprobs",
                            distributed_executor_backend="external_launcher",
                            max_model_len=max_model_len or getattr(model.config, "max_position_embeddings", None))
        self.SamplingParams = vllm.SamplingParams
        self.version, self.ready, self.sleeping = 0, True, set()   # sleeping: the tags vLLM has released

    def _wake(self, tags: tuple[str, ...]) -> None:
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            self.llm.wake_up(tags=tags)
            self.sleeping -= set(tags)

    def _model(self):
        """The nn.Module inside vLLM's worker (TRL's path to it in colocate mode)."""
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """G samples per prompt with the sampled tokens' log-probs (after temperature); rows i*G .. i*G+G-1
        continue prompts[i]. With a generator, each prompt samples from `prompt_seed(s, prompt)`, s drawn
        from it, so a batch's samples do not depend on how it is split over ranks."""
        check_request(self, prompts, sampling, expected_version)
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep, or the last load_weights did not "
                               "complete); push the trainer's weights before generating")
        self._wake(("weights", "kv_cache"))
        G, C, tok = sampling.num_generations, sampling.max_completion_length, self.tokenizer
        seed = draw_seed(generator)
        ids = tok(prompts, add_special_tokens=False)["input_ids"]
        params = [self.SamplingParams(n=G, temperature=sampling.temperature, max_tokens=C, logprobs=0,
                                      seed=None if seed is None else prompt_seed(seed, p)) for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        rows = [(p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for p, out in zip(ids, outputs) for c in out.outputs]                   # N = B * G rows
        if self.colocate:
            self.sleep()
        P, width = max(len(p) for p, _, _ in rows), max(1, max(len(t) for _, t, _ in rows))
        pad = tok.pad_token_id
        prompt_ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p, _, _ in rows])               # [N, P]
        prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _, _ in rows])
        completion_ids = torch.tensor([list(t) + [pad] * (width - len(t)) for _, t, _ in rows])       # [N, C]
        logprobs = torch.tensor([list(lp) + [0.0] * (width - len(lp)) for _, _, lp in rows])
        return make_rollout(tok, prompts, G, prompt_ids, prompt_mask, completion_ids, logprobs, self.version)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream the trainer's tensors (Hugging Face names) into vLLM's model in place; then reset the prefix cache.

        Raises VersionMismatchError for an older version, ValueError for an unknown name or
        names missing at the end (after which the engine refuses to generate until a full push).
        """
        if version < self.version:
            raise VersionMismatchError(f"load_weights(version={version}) but the vLLM engine holds version "
                                       f"{self.version}: refusing to go back to older weights")
        self._wake(("weights",))                              # the KV cache stays released until generate
        model, seen, known = self._model(), set(), set(self.names)
        self.ready = False
        for name, tensor in named_tensors:
            if name not in known:
                raise ValueError(f"VLLMEngine.load_weights(version={version}): unexpected tensor {name!r}; push "
                                 "the policy's tensors under their Hugging Face names")
            model.load_weights([(name, tensor)])
            seen.add(name)
        missing = [n for n in self.names if n not in seen]
        if missing:
            raise ValueError(f"VLLMEngine.load_weights(version={version}): {len(missing)} tensors never pushed "
                             f"(first: {missing[0]}); push all of them")
        self.llm.reset_prefix_cache()                         # cached prefixes belong to the old weights
        self.version, self.ready = version, True

    def named_weights(self):
        raise NotImplementedError("vLLM keeps its weights fused inside its worker (qkv_proj, gate_up_proj); compare "
                                  "log-probs instead (notebook 02) to check a vLLM sync")

    def sleep(self) -> None:
        """Discard weights and KV cache (vLLM sleep level 2); the next push refills the weights."""
        if not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping = {"weights", "kv_cache"}
            self.ready = False                                # level 2 discarded the weights

    def wake_up(self) -> None:
        self._wake(("weights", "kv_cache"))

    def greedy_completions(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy completions as text (for held-out accuracy), from the weights the engine holds."""
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep or half-loaded); push the weights first")
        self._wake(("kv_cache",))
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        params = self.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return [self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]
