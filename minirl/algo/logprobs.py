# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Per-token log-probabilities and entropies of completions, and masked reductions.

Everything an RL loss needs from a forward pass: `completion_logprobs` runs the model over
left-padded prompt + completion and returns log π(y_t | x, y_<t) for each completion token,
at the sampling temperature, in float32. With `num_generations=G` it computes the prompt
shared by each group of G consecutive rows once (`shared_prefix_logits`): same values up to
float rounding, same gradients, less work. TRL runs every row's prompt.

For a long-tailed batch `MicroBatchedLogprobs` scores the rows in micro-batches of similar
completion length (`micro_batches`), each padded only to its own longest completion, with
every group's prompt still computed once (`PromptCache`): the update then costs about the
real tokens, not rows x the longest completion.

Simplified vs TRL's `_get_per_token_logps_and_entropies`: micro-batches are sized by tokens
and grouped by length rather than fixed row counts; no vision inputs; logits are cast to
float32 before the temperature is applied (TRL divides first, in the model's dtype), which
only matters for bf16 models and is the more accurate order.
"""

__all__ = ["masked_sum", "masked_mean", "position_ids_from_mask", "selective_log_softmax",
           "entropy_from_logits", "completion_logits", "completion_logprobs", "CACHE_ARG",
           "group_prompts", "shared_prefix_logits", "micro_batches", "PromptCache",
           "MicroBatchedLogprobs"]

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from minirl.data import Rollout


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1. values, mask: [B, T] (same shape)."""
    if values.shape != mask.shape:
        raise ValueError(f"masked_sum: values {tuple(values.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape [B, T]")
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over the positions where `mask` is 1.

    values, mask: [B, T]; mask is 0 on prompt and padding tokens. dim=None averages over
    every unmasked token of the batch, dim=-1 gives one mean per row [B]. An all-masked row
    (an empty completion) averages to 0 instead of NaN: its denominator is clamped to 1.
    """
    mask = mask.to(values.dtype)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token counted from the first real token: [B, T] long.

    With left padding a prompt's first token sits at column 3, say, but must get position 0,
    as it does in `generate`. Padding positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log softmax(logits)[..., index] without building the full log-softmax tensor.

    logits: [B, T, V] float; index: [B, T] long token ids in [0, V).
    Returns [B, T] with out[b, t] = logits[b, t, index[b, t]] - logsumexp(logits[b, t, :]),
    in the dtype of `logits`. Every value is <= 0, and exp(out) summed over all V choices
    of index at one position would be 1.
    """
    chosen = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) at each position: [B, T, V] -> [B, T], in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def completion_logits(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                      temperature: float = 1.0, num_generations: int = 1) -> Tensor:
    """The next-token distributions the last `num_completion_tokens` tokens were drawn from.

    input_ids, attention_mask: [B, P+C], a left-padded prompt followed by the completion.
    Returns logits / temperature, [B, C, V] float32, where [:, t] predicts completion token t.
    Position ids come from the mask, exactly as `generate` derived them when it sampled, so
    rollout and trainer agree. num_generations=1 runs one forward pass over every row.
    num_generations=G > 1 says that rows i*G .. i*G+G-1 share one prompt (the rollout's
    order); each prompt then runs once (`shared_prefix_logits`, section 11), with the same
    result up to float rounding.
    """
    if temperature <= 0:
        raise ValueError(f"completion_logprobs: temperature={temperature} must be > 0")
    if num_generations < 1:
        raise ValueError(f"completion_logprobs: num_generations={num_generations} must be >= 1 (1: no sharing)")
    C = num_completion_tokens
    if num_generations > 1:
        logits = shared_prefix_logits(model, input_ids, attention_mask, C, num_generations)   # [B, C, V]
    else:
        position_ids = position_ids_from_mask(attention_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=C + 1).logits[:, :-1]              # [B, C, V]: position t predicts t+1
    return logits.float() / temperature                                 # [B, C, V]


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, with_entropy: bool = False,
                        num_generations: int = 1) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens under `model`.

    input_ids, attention_mask: [B, P+C] as for `completion_logits`, which computes the
    distributions. Returns (logps [B, C] float32, entropy [B, C] or None).
    """
    logits = completion_logits(model, input_ids, attention_mask, num_completion_tokens,
                               temperature, num_generations)            # [B, C, V]
    logps = selective_log_softmax(logits, input_ids[:, -num_completion_tokens:])   # [B, C]
    return logps, (entropy_from_logits(logits) if with_entropy else None)


# the forward argument and output field holding the KV cache: `cache` since transformers 5.2x
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def group_prompts(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int) -> tuple[Tensor, Tensor]:
    """Each group's prompt once: rows 0, G, 2G, ... of prompt_ids, prompt_mask [N, P] -> [B, P] each.

    Raises ValueError if N is not a multiple of G or if the rows of a group have different
    prompts (ids or mask): a Rollout's layout, G consecutive completions per prompt, is required.
    """
    (N, P), G = prompt_ids.shape, num_generations
    if N % G:
        raise ValueError(f"shared_prefix_logits: {N} rows are not groups of num_generations={G}; pass "
                         "B * num_generations rows, or num_generations=1 (no sharing)")
    firsts = prompt_ids[::G], prompt_mask[::G]                                            # [B, P] each
    for name, full, first in zip(("input_ids", "attention_mask"), (prompt_ids, prompt_mask), firsts, strict=True):
        if not torch.equal(full.view(-1, G, P), first[:, None].expand(-1, G, P)):
            raise ValueError(f"completion_logprobs: num_generations={G} but the rows of a group have different "
                             f"prompts ({name} differs in the first {P} columns): pass G consecutive completions "
                             "per prompt (a Rollout's order), or num_generations=1")
    return firsts


def shared_prefix_logits(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                         num_generations: int) -> Tensor:
    """The logits that predict the last C tokens, computing each group's shared prompt once.

    input_ids, attention_mask: [N, P+C], N = B * G rows in groups of G = num_generations
    consecutive rows that have the same prompt (identical first P columns of ids and mask, as
    a Rollout lays them out); prompts left-padded, completions right-padded.
    Returns logits [N, C, V] in the model's dtype, where [:, t] predicts completion token t:
    the same values (up to float rounding) and gradients as the rows' logits[:, P-1:-1] from
    one forward pass with position ids from the mask, for about 1/G of the prompt's compute.
    Needs a model whose cache supports `batch_repeat_interleave` (HF DynamicCache).
    Raises ValueError if N is not a multiple of G, if there is no prompt column, or if the rows
    of a group have different prompts.
    """
    T, G, C = input_ids.shape[1], num_generations, num_completion_tokens
    P = T - C
    if P < 1 or C < 1:
        raise ValueError(f"shared_prefix_logits: num_completion_tokens={C} leaves no prompt/completion in "
                         f"{T} columns; need 1 <= num_completion_tokens < {T}")
    prompt_ids, prompt_mask = group_prompts(input_ids[:, :P], attention_mask[:, :P], G)   # [B, P]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].repeat_interleave(G, 0)                                    # [N, 1, V]
    if C == 1:
        return first
    cache = getattr(out, CACHE_ARG)
    cache.batch_repeat_interleave(G)                                                      # [B, ...] -> [N, ...]
    positions = position_ids_from_mask(attention_mask)[:, P:-1]                           # [N, C-1]
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=positions,
                 use_cache=False, **{CACHE_ARG: cache}).logits                            # [N, C-1, V]
    return torch.cat([first, rest], 1)                                                    # [N, C, V]


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped by completion length into micro-batches of at most `max_tokens` padded completion tokens.

    lengths[i]: row i's completion tokens (the sum of its mask). Rows are taken longest first;
    a micro-batch is as wide as its first row and takes the next rows while rows x width stays
    within max_tokens, so each is padded only to its own longest completion. A row longer than
    max_tokens gets a micro-batch of its own. max_tokens=0: one micro-batch of every row (the
    padded path). Returns each micro-batch's row indices in ascending order; ties are broken by
    index, so the plan is deterministic.
    """
    if max_tokens < 0:
        raise ValueError(f"micro_batches: max_tokens={max_tokens} must be >= 0 (0: one micro-batch)")
    if max_tokens == 0:
        return [list(range(len(lengths)))]
    batches, width = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = max(lengths[i], 1)
    return [sorted(rows) for rows in batches]


class PromptCache:
    """Each group's prompt run once for a batch scored in micro-batches; its outputs are leaves that collect gradient.

    prompt_ids, prompt_mask: [B, P], each group's prompt once (a Rollout's rows 0, G, 2G, ...).
    The prompt pass runs without gradient. Every layer's keys and values ([B, kv_heads, P, d])
    and the logits at the last position ([B, 1, V]) are kept as leaves (requires_grad when
    `requires_grad`). `logits` scores rows against them; `backward` runs the pass again with
    gradient and backpropagates what the micro-batches' backward passes left in the leaves'
    .grad. Assumes a deterministic forward (no dropout, as in Qwen2 and Llama) and an HF
    DynamicCache (`.layers[i].keys / .values`).
    """

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, requires_grad: bool = True):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        with torch.no_grad():
            last, kv = self._run()
        self.last = last.requires_grad_(requires_grad)                                    # [B, 1, V]
        self.kv = [(k.requires_grad_(requires_grad), v.requires_grad_(requires_grad)) for k, v in kv]

    def _run(self):
        out = self.model(input_ids=self.prompt_ids, attention_mask=self.prompt_mask, use_cache=True,
                         position_ids=position_ids_from_mask(self.prompt_mask), logits_to_keep=1)
        return out.logits[:, -1:], [(layer.keys, layer.values) for layer in getattr(out, CACHE_ARG).layers]

    def logits(self, input_ids: Tensor, attention_mask: Tensor, prompt_of: Tensor,
               num_completion_tokens: int) -> Tensor:
        """The logits predicting the last C tokens of n rows, row i continuing prompt `prompt_of[i]`.

        input_ids, attention_mask: [n, P+C] (the rows' prompt columns, then C completion columns);
        prompt_of: [n] long in [0, B). Returns [n, C, V] in the model's dtype, as shared_prefix_logits.
        """
        P, C = self.prompt_ids.shape[1], num_completion_tokens
        first = self.last[prompt_of]                                                      # [n, 1, V]
        if C == 1:
            return first
        cache = DynamicCache(ddp_cache_data=[(k[prompt_of], v[prompt_of]) for k, v in self.kv])   # [n, ...]
        rest = self.model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], use_cache=False,
                          position_ids=position_ids_from_mask(attention_mask)[:, P:-1],
                          **{CACHE_ARG: cache}).logits                                    # [n, C-1, V]
        return torch.cat([first, rest], 1)                                                # [n, C, V]

    def backward(self) -> None:
        """The prompt pass again, with gradient, backpropagating the gradient the micro-batches left on its outputs."""
        leaves = [self.last] + [t for pair in self.kv for t in pair]
        if all(t.grad is None for t in leaves):
            return                                                                        # no backward ran
        last, kv = self._run()
        outputs = [last] + [t for pair in kv for t in pair]
        pairs = [(out, leaf.grad) for out, leaf in zip(outputs, leaves, strict=True) if leaf.grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


class MicroBatchedLogprobs:
    """The log-probs of a Rollout's completions, one micro-batch (a list of rows, from `micro_batches`) at a time.

    `self(k)` returns micro-batch k's (logps [n_k, w_k] float32, entropy or None), w_k its width:
    its longest completion, at least 2 columns when the prompt is shared (so that every
    micro-batch makes one completion pass, whatever its rows), at most the rollout's C.
    Its prompts are computed:
      - without sharing (share_prompt False or num_generations 1): with each row, one pass;
      - sharing, one micro-batch of every row: `shared_prefix_logits` over the whole batch;
      - sharing, several micro-batches: once for all of them (`PromptCache`, made at the first
        call); then call `backward()` after the micro-batches' backward passes.
    Values equal one pass over the padded batch up to float rounding; so do the gradients.
    """

    def __init__(self, model, rollout: Rollout, plan: list[list[int]], temperature: float = 1.0,
                 share_prompt: bool = True, requires_grad: bool = True):
        if temperature <= 0:
            raise ValueError(f"MicroBatchedLogprobs: temperature={temperature} must be > 0")
        self.model, self.rollout, self.temperature, self.requires_grad = model, rollout, temperature, requires_grad
        self.share = share_prompt and rollout.num_generations > 1
        self.ids, self.mask = rollout.input_ids, rollout.attention_mask                          # [N, P+C]
        lengths, C = rollout.completion_mask.sum(1), rollout.num_completion_tokens                 # [N]
        device = rollout.completion_ids.device
        self.rows = [torch.as_tensor(rows, dtype=torch.long, device=device) for rows in plan]
        self.widths = [min(C, max(int(lengths[rows].max()), 2 if self.share else 1)) for rows in self.rows]
        self.prompts = None

    def __len__(self) -> int:
        return len(self.rows)

    def tokens(self) -> int:
        """Completion tokens the micro-batches compute, padding included: sum of rows x width."""
        return sum(len(rows) * width for rows, width in zip(self.rows, self.widths, strict=True))

    def __call__(self, k: int, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        ro, rows, w = self.rollout, self.rows[k], self.widths[k]
        P, G = ro.prompt_ids.shape[1], ro.num_generations
        ids, mask = self.ids[rows, :P + w], self.mask[rows, :P + w]                             # [n, P+w]
        if self.share and len(self.rows) > 1:
            if self.prompts is None:
                self.prompts = PromptCache(self.model, *group_prompts(ro.prompt_ids, ro.prompt_mask, G),
                                           self.requires_grad)
            logits = self.prompts.logits(ids, mask, rows // G, w).float() / self.temperature   # [n, w, V]
        else:
            logits = completion_logits(self.model, ids, mask, w, self.temperature, G if self.share else 1)
        logps = selective_log_softmax(logits, ids[:, -w:])                                      # [n, w]
        return logps, (entropy_from_logits(logits) if with_entropy else None)

    def backward(self) -> None:
        """With a PromptCache: backpropagate through the prompts what the micro-batches' backward passes left."""
        if self.prompts is not None:
            self.prompts.backward()
