"""Exercise 5.4, wrong: keeps a draft token whenever p >= q (deterministic: the target's distribution is lost)."""

import torch

EXERCISE = "5.4"


def accept_draft(p, q, draft, generator=None):
    rule = "p >= q"
    run, residual = "leading", "p - q"
    S, k = draft.shape
    p_d = p[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_d = q.gather(2, draft[..., None]).squeeze(2)
    u = torch.rand(S, k, generator=generator)
    kept = {"right": u * q_d < p_d, "p >= q": p_d >= q_d, "q / p": u * p_d < q_d}[rule]
    accepted = kept.long().cumprod(1).sum(1) if run == "leading" else kept.long().sum(1)
    rows = torch.arange(S)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    dist = p[rows, accepted] if residual == "p" else (p[rows, accepted] - q_pad[rows, accepted]).clamp(min=0)
    return accepted, torch.multinomial(dist / dist.sum(1, keepdim=True), 1, generator=generator).squeeze(1)
