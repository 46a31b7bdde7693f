# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Attention through block tables over a paged KV cache, on a Hugging Face Llama/Qwen2 model.

`PagedModel` runs one engine step: new tokens of many sequences at once, each written into its
cache slot, each query reading its own sequence's keys and values through its block table.
Groups, masks, the in-place decode read and fused products: `minirl.runtime.paged_ops`.
"""

__all__ = ["Chunk", "BUCKET_TOKENS", "make_step", "gather_attention", "PagedModel"]

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minirl.runtime import paged_ops as ops


@dataclass
class Chunk:
    """What one sequence computes in a step: `tokens` at positions start .. start+len-1.

    block_table must already cover position start + len(tokens) - 1. num_logits: how many
    of the chunk's last positions need next-token logits (1 to sample, k+1 to verify k
    drafts, 0 for a prefill that samples nothing).
    """

    tokens: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1


BUCKET_TOKENS = 64   # rows whose contexts differ by less than this share one padded attention call


def make_step(chunks: list[Chunk], block_size: int, n_rep: int, device) -> ops.Step:
    """Flatten `chunks` into one Step: ids, positions, cache slots, attention groups, logit rows.

    A query at position p of a sequence sees key positions 0..p of the same sequence (causal),
    all of them read through the sequence's block table. Chunks are grouped for attention by
    query width (decode rows of one token apart from longer chunks) and by context length in
    buckets of BUCKET_TOKENS, so that a short sequence is not padded to the longest one. The
    flat tokens are laid out group by group, so each group's queries are one contiguous range.
    """
    def key(i):
        c = chunks[i]
        return len(c.tokens) > 1, (c.start + len(c.tokens) - 1) // BUCKET_TOKENS

    ids, positions, slots, first = [], [], [], {}
    members: dict[tuple, list[int]] = {}
    for i in sorted(range(len(chunks)), key=key):
        c = chunks[i]
        first[i] = len(ids)
        members.setdefault(key(i), []).append(i)
        pos = range(c.start, c.start + len(c.tokens))
        ids += c.tokens
        positions += pos
        slots += [c.block_table[p // block_size] * block_size + p % block_size for p in pos]
    ends = {i: first[i] + len(c.tokens) for i, c in enumerate(chunks)}
    logits_index = [t for i, c in enumerate(chunks) for t in range(ends[i] - c.num_logits, ends[i])]
    groups = [ops.make_group([chunks[i] for i in m], [first[i] for i in m], block_size, n_rep,
                             device) for m in members.values()]

    def as_long(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return ops.Step(as_long(ids), as_long(positions), as_long(slots), groups, as_long(logits_index))


def gather_attention(q: Tensor, keys: Tensor, values: Tensor, g: ops.Group, bias: Tensor,
                     scale: float) -> Tensor:
    """Attention of group g's queries over their sequences' cached keys and values, gathered.

    q: [n, H, D] the group's flat queries (rotary applied); keys: [Hkv, NB, D, bs], values:
    [Hkv, NB, bs, D], already holding this step's keys and values; bias: [S, 1, n_rep*Q, L],
    0 where visible and -inf elsewhere. Returns [n, H * D].
    """
    n, H, D = q.shape
    Hkv, _, _, bs = keys.shape
    S, L = g.tables.shape[0], g.tables.shape[1] * bs
    if g.q_index is None:                                               # one query per sequence
        Q, queries = 1, q.view(S, Hkv, H // Hkv, D)                     # [S, Hkv, n_rep, D]
    else:
        Q = g.q_index.shape[1]
        queries = q[g.q_index].permute(0, 2, 1, 3).reshape(S, Hkv, H // Hkv * Q, D)
    blocks = g.tables.flatten()                                         # [S * B]
    k = keys.index_select(1, blocks).transpose(2, 3).reshape(Hkv, S, L, D).transpose(0, 1)
    v = values.index_select(1, blocks).view(Hkv, S, L, D).transpose(0, 1)   # [S, Hkv, L, D]
    o = F.scaled_dot_product_attention(queries, k, v, attn_mask=bias, scale=scale)
    if g.q_index is None:
        return o.reshape(S, H * D)
    return o.reshape(S, H, Q, D).transpose(1, 2)[g.valid].reshape(-1, H * D)


class PagedModel(ops.PagedModelBase):
    """An HF Llama/Qwen2 causal LM whose attention reads and writes a paged KV cache."""

    @torch.no_grad()
    def forward(self, step: ops.Step) -> Tensor:
        """Run `step`; returns logits [R, V] in float32 for the tokens in step.logits_index."""
        inner = self.model.model
        T, H, Hkv, D = step.input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = inner.embed_tokens(step.input_ids)                              # [T, hidden]
        cos, sin = self.rotary(step.positions)                              # [T, 1, D]: all heads
        # once per step, for every layer: decode groups' block tables, other groups' masks
        plans = [ops.decode_rows(g, H, self.n_rep, self.cache.shape[3], D, self.block_size)
                 if g.q_index is None else
                 torch.zeros_like(g.mask, dtype=x.dtype).masked_fill_(~g.mask, -torch.inf)
                 for g in step.groups]
        # a step of decode rows runs nothing but C kernels: queued, then run in one C call (see above)
        with ops.queued(not self.qk_norm and all(g.q_index is None for g in step.groups)):
            for i, (layer, products) in enumerate(zip(inner.layers, self.products, strict=True)):
                attn = layer.self_attn
                qkv = products["qkv"](ops.rms_norm(x, layer.input_layernorm)).view(T, H + 2 * Hkv, D)
                qk = qkv[:, :H + Hkv]                                       # rotated together
                if self.qk_norm:                                            # Qwen3: q, k normed per head
                    qk.copy_(torch.cat([attn.q_norm(qk[:, :H]), attn.k_norm(qk[:, H:])], 1))
                ops.rotate(qk, cos, sin)                                    # in place
                self.write_cache(i, step.slots, qkv[:, H:])                 # keys, values into their slots
                keys, values = self.cache_views(i)
                q, scale = qkv[:, :H], getattr(attn, "scaling", D ** -0.5)
                out = x.new_empty(T, H * D)                                 # every group's rows
                for g, plan in zip(step.groups, plans, strict=True):
                    if g.q_index is None:
                        ops.decode_attention(q[g.start:g.stop], keys, values, plan, scale, out=out[g.start:g.stop])
                    else:
                        out[g.start:g.stop] = gather_attention(q[g.start:g.stop], keys, values, g, plan, scale)
                products["o"].add_to(x, out)                                # x += o(attention)
                h = ops.rms_norm(x, layer.post_attention_layernorm)
                gate_up = products["gate_up"](h)                            # [T, 2 * intermediate]
                products["down"].add_to(x, ops.act_mul(layer.mlp.act_fn, gate_up))   # x += down(act(gate) * up)
        h = ops.rms_norm(x[step.logits_index], inner.norm)                  # [R, hidden]
        return self.model.lm_head(h).float()                                # [R, V]
