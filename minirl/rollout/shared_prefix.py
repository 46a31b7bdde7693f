"""The shared-prefix engine: prefill each prompt once, repeat its KV cache G times, sample in a plain loop.

The G completions of a GRPO group all begin with the same prompt; HF `generate` over the
B * G repeated prompts computes that prompt G times. This engine computes it once, repeats
the cache, and decodes the N = B * G rows token by token with nothing but a softmax and a
multinomial draw per step: about twice as fast as `HFEngine` on the tiny policy (notebook
01, section 10.2), for the same distribution.

Its loop is the one decoding loop of minirl's in-process engines: notebook 07's in-flight
weight updates run it with a hook (`before_forward`) that may load new weights between two
decoding steps, instead of a loop of their own.

Simplified: plain sampling only (softmax(logits / temperature), no top-k / top-p, no
repetition penalty or other `generation_config` processors); the model's cache must support
`batch_repeat_interleave` (HF's DynamicCache does).
"""

__all__ = ["SharedPrefixEngine", "sample_shared_prefix"]

import torch
from torch import Tensor

from minirl.algo.logprobs import position_ids_from_mask
from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, draw_seed, make_rollout
from minirl.rollout.hf import HFEngine
from minirl.rollout.sampling import sample_tokens
from minirl.runtime.prefix_sharing import CACHE_ARG


class SharedPrefixEngine(HFEngine):
    """HFEngine's copy and checks, with the prefill shared by each prompt's G samples.

    `generate` also takes `before_forward`: a callable run before every forward pass (the
    prefill and each decoding step), which may load new weights into the engine
    (notebook 07's in-flight updates; the Rollout then carries the engine's version at the end).
    """

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None, before_forward=None) -> Rollout:
        check_request(self, prompts, sampling, expected_version)
        prompt_ids, prompt_mask, completion_ids, logprobs = self.sample(prompts, sampling, draw_seed(generator),
                                                                        before_forward)
        return make_rollout(self.tokenizer, prompts, sampling.num_generations, prompt_ids, prompt_mask,
                            completion_ids, logprobs, self.version)

    def sample(self, prompts: list[str], sampling: SamplingConfig, seed: int | None, before_forward=None):
        tok, G = self.tokenizer, sampling.num_generations
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sampler = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        completion_ids, logprobs = sample_shared_prefix(
            self.model, enc.input_ids, enc.attention_mask, G, sampling.max_completion_length, sampling.temperature,
            tok.eos_token_id, tok.pad_token_id, sampler, before_forward)                  # [N, C] each
        return (enc.input_ids.repeat_interleave(G, 0), enc.attention_mask.repeat_interleave(G, 0),
                completion_ids, logprobs)


@torch.no_grad()
def sample_shared_prefix(model, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int, max_new_tokens: int,
                         temperature: float, eos_token_id: int, pad_token_id: int,
                         generator: torch.Generator | None = None, before_forward=None) -> tuple[Tensor, Tensor]:
    """Sample G completions per prompt with a KV cache, prefilling each prompt once.

    prompt_ids, prompt_mask: [B, P], each prompt once, left-padded. Rows i*G .. i*G+G-1 of
    the result continue prompt i. Each step samples from softmax(logits.float() / temperature)
    with torch.multinomial (using `generator`, or the global RNG when None); a row that has
    emitted EOS gets pad_token_id from then on; the loop stops when every row has emitted EOS
    or after max_new_tokens. Returns (completion_ids [N, C] long, logprobs [N, C] float32),
    C <= max_new_tokens, where logprobs are log_softmax(logits.float() / temperature) at the
    sampled tokens: the behaviour log-probs (also at pad positions; the caller masks them).
    before_forward: None, or a callable run before each of the C forward passes (the prefill,
    whose logits give token 0, and the step that gives each later token); it may load new
    weights into `model` in place. The KV cache of earlier tokens is kept as it was computed.
    """
    G = num_generations
    if before_forward is not None:
        before_forward()
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, CACHE_ARG)
    cache.batch_repeat_interleave(G)                                           # [B, ...] -> [N, ...]
    logits = out.logits[:, -1].repeat_interleave(G, 0)                         # [N, V]
    mask = prompt_mask.repeat_interleave(G, 0)                                 # [N, P], grows by one per step
    position = mask.sum(1, keepdim=True) - 1                                   # [N, 1] the last prompt token's
    unfinished = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        token, logp = sample_tokens(logits, temperature, generator)            # [N] each
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        logprobs.append(logp)                                                  # [N]
        unfinished = unfinished & (token != eos_token_id)
        if not unfinished.any() or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        position = position + 1
        if before_forward is not None:
            before_forward()                                                   # e.g. newer weights (notebook 07)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                       use_cache=True, **{CACHE_ARG: cache}).logits[:, -1]     # [N, V]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)                    # [N, C] each
