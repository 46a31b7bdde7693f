"""The wrong versions of exercises 5.3 and 5.4, each with one flaw switched on (not an exercise itself)."""

import torch

from minirl.rollout.engine.blocks import block_hash


def match(tokens, block_size, table, chained=True, last_rule=True, compare=True, stop=True):
    """match_prefix; chained=False hashes blocks alone, last_rule=False may match the last token's block,
    compare=False trusts a hash hit, stop=False matches on after a gap."""
    blocks, parent = [], None
    n = (len(tokens) - 1) // block_size if last_rule else len(tokens) // block_size
    for i in range(n):
        chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent if chained else None, chunk)
        hit = table.get(parent)
        if hit is None or (compare and hit[1] != chunk):
            if stop:
                break
            continue
        blocks.append(hit[0])
    return blocks


def accept(p, q, draft, generator=None, rule="right", run="leading", residual="p - q", bonus="p_{k+1}"):
    """accept_draft; rule "p >= q" or "q / p", run "any" (not the leading run), residual "p", bonus "p_k"
    (the index clamped into q's k positions) or "p_{k+1} - q_k" (q clamped, not padded with zeros) are the flaws."""
    S, k = draft.shape
    p_d = p[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_d = q.gather(2, draft[..., None]).squeeze(2)
    u = torch.rand(S, k, generator=generator)
    kept = {"right": u * q_d < p_d, "p >= q": p_d >= q_d, "q / p": u * p_d < q_d}[rule]
    accepted = kept.long().cumprod(1).sum(1) if run == "leading" else kept.long().sum(1)
    rows = torch.arange(S)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    dist = p[rows, accepted] if residual == "p" else (p[rows, accepted] - q_pad[rows, accepted]).clamp(min=0)
    last = accepted.clamp(max=k - 1)                                       # a position q has
    if bonus == "p_k":                            # rejected: max(0, p_a - q_a); all kept: p_k instead of p_{k+1}
        dist = torch.where((accepted == k)[:, None], p[rows, last], dist)
    elif bonus == "p_{k+1} - q_k":
        dist = (p[rows, accepted] - q[rows, last]).clamp(min=0)
    return accepted, torch.multinomial(dist / dist.sum(1, keepdim=True), 1, generator=generator).squeeze(1)
