# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""The rollout engine of stage 1: sampling with a KV cache, on its own copy of the policy.

`HFRollout` holds a copy of the policy (optionally in a lower precision), samples G
completions per prompt, and returns a `Rollout` with the completions, masks, the sampled
tokens' log-probs as the engine computed them, and the policy version that produced them.
Two engines sample the same distribution: "hf" calls HF `generate` on B * G rows (every
forward pass covers all rows, which notebook 02's MoE route recorder relies on);
"shared_prefix" prefills each prompt once, repeats its KV cache G times and samples in a
plain loop (`sample_shared_prefix`), about twice as fast for small models. HFRollout
defaults to "hf"; the loop uses "shared_prefix" (`GRPOConfig.rollout_engine`).

Simplified vs TRL: TRL samples with the training model itself (no copy, no version); vLLM
rollouts in TRL/veRL live in another process. We keep a separate copy so that step 4 of the
loop, synchronize, is real and checkable: `load_weights(state_dict, version)` and
`generate(..., expected_version=v)`. The float8 mode only simulates an FP8 rollout on a CPU:
weights are round-tripped through float8_e4m3fn with one scale per tensor and computed in
bfloat16.
"""

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from minirl.algo.logprobs import CACHE_ARG, position_ids_from_mask, selective_log_softmax

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
ROLLOUT_ENGINES = ("shared_prefix", "hf")


class VersionMismatchError(RuntimeError):
    """The rollout engine holds other weights than the loop expects."""


@dataclass
class Rollout:
    """G consecutive completions per prompt (generation order), N = B * G rows."""

    prompt_ids: Tensor        # [N, P] left-padded
    prompt_mask: Tensor       # [N, P]
    completion_ids: Tensor    # [N, C] right-padded
    completion_mask: Tensor   # [N, C] 1 up to and including the first EOS
    logprobs: Tensor          # [N, C] float32 behaviour log-probs, as the rollout engine computed them
    completions: list[str]    # N decoded completions (special tokens removed)
    prompts: list[str]        # N prompts (each repeated G times)
    version: int              # the policy version that generated them

    @property
    def input_ids(self) -> Tensor:       # [N, P+C]
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def attention_mask(self) -> Tensor:  # [N, P+C]
        return torch.cat([self.prompt_mask, self.completion_mask], 1)

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_ids.shape[1]


def completion_mask_from_ids(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """[N, C] long mask: 1 for every token up to and including the first EOS, 0 after it.

    A completion that never emits EOS (truncated at max_new_tokens) keeps all C tokens.
    """
    is_eos = completion_ids == eos_token_id                                    # [N, C]
    C = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(is_eos[:, 0], C, dtype=torch.long))
    return (torch.arange(C, device=completion_ids.device)[None] <= first[:, None]).long()


def _fp8_round_trip(weight: Tensor) -> Tensor:
    """Quantize a weight matrix to float8_e4m3fn with one per-tensor scale, back to bfloat16."""
    scale = weight.detach().abs().max().float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return ((weight.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def check_tokenizer(tokenizer) -> None:
    """Raise a clear error for a tokenizer the rollout cannot batch with."""
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer.pad_token is None: batched generation needs a pad token; "
                         "set tokenizer.pad_token = tokenizer.eos_token (what TRL does) or add one")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.eos_token is None: completions need an end-of-sequence token")


class HFRollout:
    """The rollout engine's own copy of the policy, sampling with a KV cache.

    engine="shared_prefix": each prompt is prefilled once and its cache repeated G times, then
    a plain multinomial loop (`sample_shared_prefix`). engine="hf" (the default): HF `generate`
    over the B * G repeated prompts. Both sample from softmax(logits / temperature) with no top-k / top-p and
    record the same behaviour log-probs; for one seed they draw the same random numbers in the
    same order, so their samples agree wherever the two computations round alike (section 10).
    """

    def __init__(self, model, tokenizer, dtype: str = "float32", device=None, engine: str = "hf"):
        if dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"HFRollout: dtype={dtype!r}; use one of {ROLLOUT_DTYPES}")
        if engine not in ROLLOUT_ENGINES:
            raise ValueError(f"HFRollout: engine={engine!r}; use one of {ROLLOUT_ENGINES}")
        check_tokenizer(tokenizer)
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.padding_side = "left"      # prompts end at the same column
        self.dtype = dtype
        self.engine = engine
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        compute = torch.bfloat16 if dtype == "float8_e4m3fn" else getattr(torch, dtype)
        self.model = copy.deepcopy(model).to(self.device, compute).eval()
        self.version = 0
        self.load_weights(model.state_dict(), version=0)

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Synchronize: copy `state_dict` into the rollout copy (cast to its dtype), set `version`."""
        if self.dtype == "float8_e4m3fn":
            state_dict = {k: _fp8_round_trip(v) if v.dim() >= 2 else v for k, v in state_dict.items()}
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)   # copy_ casts to the copy's dtype
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, max_new_tokens: int, temperature: float = 1.0,
                 expected_version: int | None = None, generator: torch.Generator | None = None) -> Rollout:
        """Sample `num_generations` completions per prompt; rows i*G .. i*G+G-1 belong to prompts[i].

        Sampling is plain multinomial at `temperature` (no top-k / top-p). With a `generator`,
        the sampling seed is drawn from it (one draw, whatever the engine), so the completions
        depend on the generator alone and the global RNG is left as it was; without one, the
        global RNG samples. Generation stops when every row has emitted EOS or after
        `max_new_tokens`; after its EOS a row gets pad tokens (masked out).
        Raises VersionMismatchError if `expected_version` is given and differs from `version`.
        """
        if expected_version is not None and expected_version != self.version:
            raise VersionMismatchError(
                f"rollout holds policy version {self.version} but the loop expected version "
                f"{expected_version}: call load_weights(state_dict, version={expected_version}) "
                "(sync_weights) before generating")
        if not prompts:
            raise ValueError("generate: prompts is empty")
        if temperature <= 0:
            raise ValueError(f"generate: temperature={temperature} must be > 0 (sampling)")
        if num_generations < 1 or max_new_tokens < 1:
            raise ValueError(f"generate: num_generations={num_generations} and max_new_tokens={max_new_tokens} "
                             "must both be >= 1")
        tok, G = self.tokenizer, num_generations
        repeated = [p for p in prompts for _ in range(G)]
        seed = None if generator is None else int(torch.randint(2**62, (1,), generator=generator,
                                                                device=generator.device))
        if self.engine == "shared_prefix":
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            sampler = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
            completion_ids, logprobs = sample_shared_prefix(
                self.model, enc.input_ids, enc.attention_mask, G, max_new_tokens, temperature,
                tok.eos_token_id, tok.pad_token_id, sampler)                              # [N, C] each
            prompt_ids = enc.input_ids.repeat_interleave(G, 0)                             # [N, P]
            prompt_mask = enc.attention_mask.repeat_interleave(G, 0)
        else:
            enc = tok(repeated, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                out = self.model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                          max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                          eos_token_id=tok.eos_token_id, output_logits=True,
                                          return_dict_in_generate=True)
            prompt_ids, prompt_mask = enc.input_ids, enc.attention_mask                   # [N, P]
            completion_ids = out.sequences[:, prompt_ids.shape[1]:]                       # [N, C]
            logits = torch.stack(out.logits, 1).float() / temperature                     # [N, C, V]
            logprobs = selective_log_softmax(logits, completion_ids)                      # [N, C]
        completion_mask = completion_mask_from_ids(completion_ids, tok.eos_token_id)      # [N, C]
        completions = tok.batch_decode(completion_ids * completion_mask + tok.pad_token_id * (1 - completion_mask),
                                       skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask,
                       logprobs * completion_mask, completions, repeated, self.version)


@torch.no_grad()
def sample_shared_prefix(model, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int, max_new_tokens: int,
                         temperature: float, eos_token_id: int, pad_token_id: int,
                         generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Sample G completions per prompt with a KV cache, prefilling each prompt once.

    prompt_ids, prompt_mask: [B, P], each prompt once, left-padded. Rows i*G .. i*G+G-1 of
    the result continue prompt i. Each step samples from softmax(logits.float() / temperature)
    with torch.multinomial (using `generator`, or the global RNG when None); a row that has
    emitted EOS gets pad_token_id from then on; the loop stops when every row has emitted EOS
    or after max_new_tokens. Returns (completion_ids [N, C] long, logprobs [N, C] float32),
    C <= max_new_tokens, where logprobs are log_softmax(logits.float() / temperature) at the
    sampled tokens: the behaviour log-probs (also at pad positions; the caller masks them).
    """
    G = num_generations
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
        scores = logits.float() / temperature                                  # [N, V]
        token = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)   # [N]
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        logprobs.append(selective_log_softmax(scores, token))                  # [N]
        unfinished = unfinished & (token != eos_token_id)
        if not unfinished.any() or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                       use_cache=True, **{CACHE_ARG: cache}).logits[:, -1]     # [N, V]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)                    # [N, C] each
