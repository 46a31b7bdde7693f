# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""Per-token log-probabilities and entropies of completions, and masked reductions.

Everything an RL loss needs from a forward pass: `completion_logprobs` runs the model over
left-padded prompt + completion and returns log π(y_t | x, y_<t) for each completion token,
at the sampling temperature, in float32.

Simplified vs TRL's `_get_per_token_logps_and_entropies`: no micro-batching of the forward
pass and no vision inputs; logits are cast to float32 before the temperature is applied
(TRL divides first, in the model's dtype), which only matters for bf16 models and is the
more accurate order.
"""

import torch
from torch import Tensor


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


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens under `model`.

    input_ids, attention_mask: [B, P+C], a left-padded prompt followed by the completion.
    Returns (logps [B, C] float32, entropy [B, C] or None). Position ids come from the mask,
    exactly as `generate` derived them when it sampled, so rollout and trainer agree.
    """
    if temperature <= 0:
        raise ValueError(f"completion_logprobs: temperature={temperature} must be > 0")
    C = num_completion_tokens
    position_ids = position_ids_from_mask(attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=C + 1).logits                      # [B, C+1, V]
    logits = logits[:, :-1].float() / temperature                      # [B, C, V]: position t predicts t+1
    logps = selective_log_softmax(logits, input_ids[:, -C:])           # [B, C]
    return logps, (entropy_from_logits(logits) if with_entropy else None)
