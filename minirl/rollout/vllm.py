# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The vLLM engine behind the rollout protocol, on vLLM's offline API as TRL's colocate mode has it.

Simplified vs TRL: tensor parallel size 1, no server mode, no LoRA adapters inside vLLM.
"""

__all__ = ["VLLMEngine"]

from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, draw_seed
from minirl.runtime.prompt_seeds import prompt_seed
from minirl.runtime.push_checks import refuse_older
from minirl.runtime.vllm_setup import PushStream, VLLMSupport, padded_rollout


class VLLMEngine(VLLMSupport):
    """A vLLM `LLM` in this process, holding version `version` of the policy; colocate: sleep after
    generating. Building it (`LLM(...)`, sized): `minirl/runtime/vllm_setup.py`."""

    def generate(self, prompts: list[str], sampling: SamplingConfig,
                 expected_version: int | None = None, generator: torch.Generator | None = None
                 ) -> Rollout:
        """G samples per prompt with the sampled tokens' log-probs (after temperature), each prompt
        seeded by `prompt_seed`: a batch's samples do not depend on how it is split over ranks."""
        check_request(self, prompts, sampling, expected_version)
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep, or the last load_weights "
                               "did not complete); push the trainer's weights before generating")
        G, C, tok = sampling.num_generations, sampling.max_completion_length, self.tokenizer
        ids = self._prompt_ids(prompts, C)
        self._wake(("weights", "kv_cache"))
        seed = draw_seed(generator)
        seeds = [None if seed is None else prompt_seed(seed, p) for p in prompts]
        params = [self.SamplingParams(n=G, temperature=sampling.temperature, max_tokens=C,
                                      logprobs=0, seed=s) for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        rows = [(p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                   strict=True)])
                for p, out in zip(ids, outputs, strict=True) for c in out.outputs]      # B * G rows
        if self.colocate:
            self.sleep()
        return padded_rollout(tok, prompts, G, rows, self.version)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream the trainer's tensors (Hugging Face names) into vLLM; reset the prefix cache."""
        refuse_older(version, self.version, "the vLLM engine")
        self._wake(("weights",))                              # the KV cache waits for generate
        self.ready = False
        stream = PushStream(named_tensors, set(self.names), version)
        self._push(stream)
        stream.check_complete(self.names)
        self.llm.reset_prefix_cache()                         # cached prefixes: the old weights
        self.version, self.ready = version, True
