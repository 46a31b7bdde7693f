"""One token per row and its behaviour log-prob: the sampling step every hand-written decoding loop shares.

HF `generate` (HFEngine) and vLLM sample inside their own code; minirl's own loops (the
shared-prefix engine, which notebook 07's in-flight producer also runs, and the paged engine
of notebook 05 and its speculative verifier) call `sample_tokens`, so a behaviour log-prob
means the same thing in every engine: log_softmax(logits / temperature) at the sampled token.

Simplified: plain sampling (no top-k, top-p or repetition penalty), which is what the RL
loss assumes.
"""

__all__ = ["sample_tokens"]

import torch
from torch import Tensor


def sample_tokens(logits: Tensor, temperature: float | Tensor,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One token per row from softmax(logits / temperature); temperature 0 picks the argmax.

    logits: [R, V] (upcast to float32); temperature: a float, or [R] per row. Returns
    (tokens [R] long, logprobs [R] float32), logprobs = log_softmax(logits / temperature)
    at the token (at temperature 1 for greedy rows). `generator` draws the samples (the
    global RNG when None); greedy rows draw too, so a row's temperature never shifts the
    random stream of the others.
    """
    logits = logits.float()                                                              # [R, V]
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(logits.shape[0])  # [R]
    greedy = t == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, t)[:, None], -1)        # [R, V]
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)           # [R]
    tokens = torch.where(greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
