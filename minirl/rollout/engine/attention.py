# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Attention through block tables over a paged KV cache, on a Hugging Face Llama/Qwen2 model.

`PagedModel` runs one engine step: a flat list of new tokens from many sequences at once
(whole prompts, prompt tails after a prefix-cache hit, single decode tokens, k+1 tokens to
verify), each with its position and the block table of its sequence. It reuses the HF
model's own modules for everything but attention: the embeddings, the RMSNorms, the rotary
frequencies, the q/k/v/o projections and the MLP. Attention is ours: each layer writes the
new keys and values into their slots of the paged cache, then every query reads its
sequence's keys and values back through the block table.

Simplified vs vLLM: the gather through the block table is a torch indexing copy
(`index_select` of the sequence's blocks) followed by `scaled_dot_product_attention`, where
vLLM's paged-attention kernel reads the blocks in place; sequences are padded to the longest
in their group (decode rows apart from longer chunks, and by context length), with a
boolean mask. Supports Llama-style
models with full attention (Llama, Qwen2, Qwen3, Mistral without a sliding window).
"""

__all__ = ["SUPPORTED", "Chunk", "Group", "Step", "BUCKET_TOKENS", "make_step", "make_group",
           "paged_attention", "rotate", "check_architecture", "PagedModel"]

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


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


@dataclass
class Group:
    """Sequences attended together, padded to one query width Q; their tokens are the flat range start:stop."""

    start: int            # the group's first flat token
    stop: int             # one past its last
    q_index: Tensor | None  # [S, Q] long, into start:stop (padding repeats a real query); None when Q == 1
    valid: Tensor | None  # [S, Q] bool: a real query, not padding; None when Q == 1
    tables: Tensor        # [S, B] long: block tables padded with block 0 (masked out)
    mask: Tensor          # [S, 1, n_rep*Q, B*block_size] bool: key position visible to the query


@dataclass
class Step:
    """One forward pass over T new tokens from several sequences, laid out group after group."""

    input_ids: Tensor     # [T] long
    positions: Tensor     # [T] long: position of each token in its sequence
    slots: Tensor         # [T] long: cache slot (block * block_size + offset) its key/value goes to
    groups: list[Group]
    logits_index: Tensor  # [R] long: flat tokens whose next-token logits are returned, in chunk order


BUCKET_TOKENS = 64   # rows whose contexts differ by less than this share one padded attention call


def make_step(chunks: list[Chunk], block_size: int, n_rep: int, device) -> Step:
    """Flatten `chunks` into one Step: ids, positions, cache slots, attention groups, logit rows.

    A query at position p of a sequence sees key positions 0..p of the same sequence (causal),
    all of them read through the sequence's block table. Chunks are grouped for attention by
    query width (decode rows of one token apart from longer chunks) and by context length in
    buckets of BUCKET_TOKENS, so that a short sequence is not padded to the longest one. The
    flat tokens are laid out group by group (a linear layer does not care about the order), so
    each group's queries are one contiguous range and its output needs no scatter.
    """
    key = lambda i: (len(chunks[i].tokens) > 1, (chunks[i].start + len(chunks[i].tokens) - 1) // BUCKET_TOKENS)  # noqa
    order = sorted(range(len(chunks)), key=key)
    ids, positions, slots, first = [], [], [], {}
    members: dict[tuple, list[int]] = {}
    for i in order:
        c = chunks[i]
        first[i] = len(ids)
        members.setdefault(key(i), []).append(i)
        pos = range(c.start, c.start + len(c.tokens))
        ids += c.tokens
        positions += pos
        slots += [c.block_table[p // block_size] * block_size + p % block_size for p in pos]
    logits_index = [t for i, c in enumerate(chunks)
                    for t in range(first[i] + len(c.tokens) - c.num_logits, first[i] + len(c.tokens))]
    groups = [make_group([chunks[i] for i in group], [first[i] for i in group], block_size, n_rep, device)
              for group in members.values()]
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)   # noqa: E731
    return Step(as_long(ids), as_long(positions), as_long(slots), groups, as_long(logits_index))


def make_group(chunks: list[Chunk], offsets: list[int], block_size: int, n_rep: int, device) -> Group:
    """The block tables, causal mask and (for chunks longer than 1) padded query index of one group."""
    S = len(chunks)
    Q = max(len(c.tokens) for c in chunks)
    B = max(-(-(c.start + len(c.tokens)) // block_size) for c in chunks)     # blocks the longest context spans
    start, stop = offsets[0], offsets[-1] + len(chunks[-1].tokens)
    lengths = torch.tensor([len(c.tokens) for c in chunks], device=device)                 # [S]
    starts = torch.tensor([c.start for c in chunks], device=device)                       # [S]
    j = torch.arange(Q, device=device)                                                    # [Q]
    last = torch.minimum(j[None], lengths[:, None] - 1)                                   # [S, Q]: padding repeats
    q_index = valid = None
    if Q > 1:
        valid = j[None] < lengths[:, None]                                                # [S, Q]
        q_index = torch.tensor(offsets, device=device)[:, None] - start + last            # [S, Q]
    tables = torch.tensor([c.block_table[:B] + [0] * (B - len(c.block_table)) for c in chunks], device=device)
    key_pos = torch.arange(B * block_size, device=device)                                 # [L]
    mask = key_pos[None, None] <= (starts[:, None] + last)[:, :, None]                    # [S, Q, L]
    mask = mask[:, None].expand(S, n_rep, Q, B * block_size).reshape(S, 1, n_rep * Q, B * block_size)
    return Group(start, stop, q_index, valid, tables, mask)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, groups: list[Group]) -> Tensor:
    """Causal attention of every query over its own sequence's cached keys and values.

    q: [T, H, D] (rotary applied); k_cache, v_cache: [Hkv, num_blocks, block_size, D], already
    holding this step's keys and values. Returns [T, H * D]. Grouped-query attention without
    copying keys per query head: the n_rep = H / Hkv query heads that share a key head are
    stacked along the query axis ([S, Hkv, n_rep * Q, D]), as HF does for decoding.
    """
    T, H, D = q.shape
    Hkv, _, bs, _ = k_cache.shape
    outs = []
    for g in groups:
        S, L = g.tables.shape[0], g.tables.shape[1] * bs
        mine = q[g.start:g.stop]                                                            # [n, H, D]
        if g.q_index is None:                                                               # one query per sequence
            Q, queries = 1, mine.view(S, Hkv, H // Hkv, D)                                  # [S, Hkv, n_rep, D]
        else:
            Q = g.q_index.shape[1]
            queries = mine[g.q_index].permute(0, 2, 1, 3).reshape(S, Hkv, H // Hkv * Q, D)  # [S, Hkv, n_rep*Q, D]
        blocks = g.tables.flatten()                                                         # [S * B]
        keys = k_cache.index_select(1, blocks).view(Hkv, S, L, D).transpose(0, 1)          # [S, Hkv, L, D]
        values = v_cache.index_select(1, blocks).view(Hkv, S, L, D).transpose(0, 1)        # [S, Hkv, L, D]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask)         # [S, Hkv, n_rep*Q, D]
        if g.q_index is None:
            outs.append(o.reshape(S, H * D))
        else:
            outs.append(o.reshape(S, H, Q, D).transpose(1, 2)[g.valid].reshape(-1, H * D))
    return outs[0] if len(outs) == 1 else torch.cat(outs)                                  # [T, H * D]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (HF's rotate-half convention). x: [T, heads, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def check_architecture(model) -> None:
    """Raise ValueError unless `model` is a Llama-style causal LM with full attention that PagedModel can run."""
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    inner = getattr(model, "model", None)
    if kind not in SUPPORTED or inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"PagedModel: model_type={kind!r} ({type(model).__name__}) is not supported; the paged "
                         f"engine runs Llama-style decoders ({', '.join(SUPPORTED)}): use the 'hf' engine for others")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if getattr(config, "use_sliding_window", False) or set(layer_types) != {"full_attention"}:
        raise ValueError(f"PagedModel: {kind} with sliding-window attention (layer_types={sorted(set(layer_types))}) "
                         "is not supported; the paged cache keeps every position")


class PagedModel(torch.nn.Module):
    """An HF Llama/Qwen2 causal LM whose attention reads and writes a paged KV cache.

    The wrapped `model` keeps its weights and its parameter names (so `load_weights` takes
    the trainer's names); the cache is [layers, 2, num_blocks, block_size, Hkv, D] in the
    model's dtype, allocated by `allocate_cache`, laid out [layers, 2, Hkv, num_blocks,
    block_size, D] so that gathering a sequence's blocks copies whole contiguous blocks.
    """

    def __init__(self, model):
        super().__init__()
        check_architecture(model)
        self.model = model
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.n_rep = self.num_heads // self.num_kv_heads
        self.vocab_size = config.vocab_size
        self.cache: Tensor | None = None

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` tokens holds: keys and values of every layer."""
        dtype = next(self.model.parameters()).dtype
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        p = next(self.model.parameters())
        self.cache = torch.zeros(self.num_layers, 2, self.num_kv_heads, num_blocks, block_size, self.head_dim,
                                 dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def forward(self, step: Step) -> Tensor:
        """Run `step`; returns logits [R, V] in float32 for the tokens in step.logits_index."""
        inner = self.model.model
        T = step.input_ids.shape[0]
        x = inner.embed_tokens(step.input_ids)                                           # [T, hidden]
        cos, sin = inner.rotary_emb(x, step.positions[None])                             # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]                                      # [T, 1, D]: all heads
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(T, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(T, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(T, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):                                                  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            qk = rotate(torch.cat([q, k], 1), cos, sin)                                  # both in one pass
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            k_cache, v_cache = self.cache[i, 0], self.cache[i, 1]                        # [Hkv, NB, bs, D]
            k_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, step.slots, k.transpose(0, 1))
            v_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, step.slots, v.transpose(0, 1))
            x = x + attn.o_proj(paged_attention(q, k_cache, v_cache, step.groups))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = inner.norm(x[step.logits_index])                                             # [R, hidden]
        return self.model.lm_head(h).float()                                             # [R, V]
