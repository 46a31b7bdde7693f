# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Per-token log-probabilities and entropies of completions, and masked reductions.

`completion_logprobs`: log π(y_t | x, y_<t) of each completion token, at the sampling temperature,
in float32. Simplified vs TRL's `_get_per_token_logps_and_entropies`: no vision inputs; logits
are cast to float32 before the temperature is applied (TRL divides first, in the model's dtype).
"""

__all__ = ["masked_sum", "masked_mean", "position_ids_from_mask", "selective_log_softmax",
           "entropy_from_logits", "completion_logits", "completion_logprobs"]

import torch
from torch import Tensor

from minirl.runtime.arg_checks import check_logit_args, check_same_shape


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1. values, mask: [B, T] (same shape)."""
    check_same_shape("masked_sum", values, mask)
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
    Position ids come from the mask, as `generate` derived them. num_generations=G > 1: rows
    i*G .. i*G+G-1 share one prompt, which then runs once (`shared_prefix_logits`, section 10).
    """
    check_logit_args(temperature, num_generations)
    C = num_completion_tokens
    if num_generations > 1:
        from minirl.runtime.prefix_sharing import shared_prefix_logits  # noqa: PLC0415 (it imports this module)
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
