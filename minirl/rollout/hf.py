"""The Hugging Face `generate` engine: sampling with a KV cache, on its own copy of the policy.

`HFEngine` holds a copy of the policy (optionally in a lower precision) and samples G
completions per prompt with HF `generate` over the B * G repeated prompts: every forward
pass covers all rows (notebook 02's MoE route recorder relies on that). It returns a
`Rollout` with the completions, masks, the sampled tokens' log-probs as the engine computed
them, and the policy version that produced them.

Simplified vs TRL: TRL samples with the training model itself (no copy, no version); vLLM
rollouts in TRL and veRL live in another process. We keep a separate copy so that step 4 of
the loop, synchronize, is real and checkable. The float8 mode only simulates an FP8 rollout
on a CPU: weights are round-tripped through float8_e4m3fn with one scale per tensor and
computed in bfloat16.
"""

__all__ = ["fp8_round_trip", "DTYPES", "HFEngine"]

import copy
from typing import Iterable

import torch
from torch import Tensor

from minirl.algo.logprobs import selective_log_softmax
from minirl.config import ROLLOUT_DTYPES, SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, check_tokenizer, draw_seed, make_rollout
from minirl.runtime.validate import check_choice


def fp8_round_trip(weight: Tensor) -> Tensor:
    """Quantize a weight matrix to float8_e4m3fn with one per-tensor scale, back to bfloat16."""
    scale = weight.detach().abs().max().float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return ((weight.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}   # what a copy computes in


class HFEngine:
    """HF `generate` over B * G rows, on the engine's own copy of the policy.

    Samples from softmax(logits / temperature) with no top-k and no top-p, and records the
    behaviour log-probs from the very logits it sampled from. dtype: the copy's precision
    ("float8_e4m3fn" simulates FP8 weights, computing in bfloat16).
    """

    def __init__(self, model, tokenizer, dtype: str = "float32", device=None):
        check_choice("rollout_dtype", dtype, ROLLOUT_DTYPES)
        check_tokenizer(tokenizer)
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.padding_side = "left"      # prompts end at the same column
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        compute = torch.bfloat16 if dtype == "float8_e4m3fn" else DTYPES[dtype]
        self.model = copy.deepcopy(model).to(self.device, compute).eval()
        self.version = 0
        self.load_weights(model.state_dict().items(), version=0)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Synchronize: copy every named tensor into the engine's copy (cast to its dtype); set `version`.

        Raises ValueError naming the tensors that are missing, unexpected or of the wrong
        shape, before anything is copied: half a synchronization is worse than none.
        """
        state = dict(named_tensors)
        if self.dtype == "float8_e4m3fn":
            state = {k: fp8_round_trip(v) if v.dim() >= 2 else v for k, v in state.items()}
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        reshaped = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if missing or unexpected or reshaped:
            raise ValueError(f"{type(self).__name__}.load_weights(version={version}): missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shape {reshaped[:3]} (of {len(own)} tensors); "
                             "push all of the policy's tensors under the names of its state_dict")
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)     # copy_ casts to the copy's dtype
        self.version = version

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The engine's copy of the weights by state_dict name (what the stale-parameter check compares)."""
        return self.model.state_dict().items()

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """sampling.num_generations completions per prompt; rows i*G .. i*G+G-1 belong to prompts[i].

        A row stops at its EOS (then pad tokens, masked out); generation stops when every row
        has stopped or after max_completion_length tokens. See `RolloutEngine.generate`.
        """
        check_request(self, prompts, sampling, expected_version)
        G = sampling.num_generations
        prompt_ids, prompt_mask, completion_ids, logprobs = self.sample(prompts, sampling, draw_seed(generator))
        return make_rollout(self.tokenizer, prompts, G, prompt_ids, prompt_mask, completion_ids, logprobs,
                            self.version)

    def sample(self, prompts: list[str], sampling: SamplingConfig, seed: int | None):
        """(prompt_ids [N, P], prompt_mask [N, P], completion_ids [N, C], logprobs [N, C]) from HF generate."""
        tok, G = self.tokenizer, sampling.num_generations
        repeated = [p for p in prompts for _ in range(G)]
        enc = tok(repeated, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(**enc, do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=sampling.max_completion_length, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, output_logits=True,
                                      return_dict_in_generate=True)
        completion_ids = out.sequences[:, enc.input_ids.shape[1]:]                       # [N, C]
        logits = torch.stack(out.logits, 1).float() / sampling.temperature               # [N, C, V]
        return enc.input_ids, enc.attention_mask, completion_ids, selective_log_softmax(logits, completion_ids)
