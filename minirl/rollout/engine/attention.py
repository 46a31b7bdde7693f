# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""Attention through block tables over a paged KV cache, on a Hugging Face Llama/Qwen2 model.

`PagedModel` runs one engine step: a flat list of new tokens from many sequences at once
(whole prompts, prompt tails after a prefix-cache hit, single decode tokens, k+1 tokens to
verify), each with its position and the block table of its sequence. It takes the HF
model's weights (and keeps its parameter names, so `load_weights` takes the trainer's
names), its embeddings, RMSNorms, rotary frequencies and activation, and runs its own
forward pass: q/k/v as one product and gate/up as another (prepacked for oneDNN on x86 CPUs),
each layer writing the new keys and values into their slots of the paged cache, then every
query reading its sequence's keys and values through the block table.

Two ways to read: one query per sequence (decoding) reads the cache in place with
`F.embedding_bag` (keys stored transposed within each block, `[head_dim, block_size]`);
chunks of several queries (prefills, verification of drafts) gather their sequences' blocks
into a padded tensor (`index_select`) for `scaled_dot_product_attention`.

Simplified vs vLLM: no fused paged-attention kernel (embedding_bag reads every key once per
query head sharing it, where a kernel reads it once per key head); sequences are padded to
the longest in their group (decode rows apart from longer chunks, and by context length),
with a mask. Supports Llama-style models with full attention (Llama, Qwen2, Qwen3, Mistral
without a sliding window).
"""

__all__ = ["SUPPORTED", "Chunk", "Group", "Step", "BUCKET_TOKENS", "make_step", "make_group",
           "gather_attention", "Rows", "decode_rows", "decode_attention", "rotate",
           "check_architecture", "Linear", "fused", "rms_norm", "zeros_on_demand", "PagedModel"]

import math
import mmap
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


def gather_attention(q: Tensor, keys: Tensor, values: Tensor, g: Group, bias: Tensor, scale: float) -> Tensor:
    """Attention of group g's queries over their sequences' cached keys and values, gathered into a copy.

    q: [n, H, D] the group's flat queries (rotary applied); keys: [Hkv, NB, D, bs], values:
    [Hkv, NB, bs, D], already holding this step's keys and values; bias: [S, 1, n_rep*Q, L],
    0 where visible and -inf elsewhere. Returns [n, H * D].
    """
    n, H, D = q.shape
    Hkv, _, _, bs = keys.shape
    S, L = g.tables.shape[0], g.tables.shape[1] * bs
    if g.q_index is None:                                                                # one query per sequence
        Q, queries = 1, q.view(S, Hkv, H // Hkv, D)                                      # [S, Hkv, n_rep, D]
    else:
        Q = g.q_index.shape[1]
        queries = q[g.q_index].permute(0, 2, 1, 3).reshape(S, Hkv, H // Hkv * Q, D)      # [S, Hkv, n_rep*Q, D]
    blocks = g.tables.flatten()                                                          # [S * B]
    k = keys.index_select(1, blocks).transpose(2, 3).reshape(Hkv, S, L, D).transpose(0, 1)  # [S, Hkv, L, D]
    v = values.index_select(1, blocks).view(Hkv, S, L, D).transpose(0, 1)                # [S, Hkv, L, D]
    o = F.scaled_dot_product_attention(queries, k, v, attn_mask=bias, scale=scale)       # [S, Hkv, n_rep*Q, D]
    if g.q_index is None:
        return o.reshape(S, H * D)
    return o.reshape(S, H, Q, D).transpose(1, 2)[g.valid].reshape(-1, H * D)


@dataclass
class Rows:
    """A decode group's block tables as row indices of the caches, built once per step for every layer."""

    keys: Tensor     # [S*H*B, D] long: rows of keys.view(-1, bs), (key head, block, d) for (sequence, head, block)
    values: Tensor   # [S*H, L] long: rows of values.view(-1, D), (key head, block, offset) for (sequence, head)
    bias: Tensor     # [S, 1, L] float32: 0 where the key position is visible, -inf elsewhere


def decode_rows(g: Group, num_heads: int, n_rep: int, num_blocks: int, head_dim: int, block_size: int) -> Rows:
    """The Rows of a group of one-token chunks: query head h reads key head h // n_rep."""
    S, B = g.tables.shape
    device = g.tables.device
    kv_head = torch.arange(num_heads, device=device) // n_rep                                   # [H]
    block = kv_head[None, :, None] * num_blocks + g.tables[:, None, :]                          # [S, H, B]
    keys = (block[..., None] * head_dim + torch.arange(head_dim, device=device)).view(-1, head_dim)
    values = (block[..., None] * block_size + torch.arange(block_size, device=device)).view(S * num_heads, -1)
    bias = torch.zeros(S, 1, B * block_size, device=device).masked_fill_(~g.mask[:, :, 0], float("-inf"))
    return Rows(keys, values, bias)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, rows: Rows, scale: float) -> Tensor:
    """One query per sequence over its cached keys and values, read in place. q: [S, H, D] -> [S, H * D].

    scores[s, h, block b] = sum_d q[s, h, d] * keys[block, d, :], one embedding bag per
    (s, h, b); out[s, h] = sum_t p[s, h, t] * values[slot t], one bag per (s, h). The softmax
    runs in float32.
    """
    S, H, D = q.shape
    bs = keys.shape[-1]
    B = rows.keys.shape[0] // (S * H)
    weights = (q[:, :, None].expand(S, H, B, D) * scale).view(-1, D)                          # [S*H*B, D]
    scores = F.embedding_bag(rows.keys, keys.reshape(-1, bs), per_sample_weights=weights, mode="sum")  # [S*H*B, bs]
    p = torch.softmax(scores.view(S, H, B * bs).float() + rows.bias, -1).to(values.dtype)      # [S, H, L]
    out = F.embedding_bag(rows.values, values.reshape(-1, D), per_sample_weights=p.view(S * H, -1), mode="sum")
    return out.view(S, H * D)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary position embedding (HF's rotate-half convention). x: [T, heads, D]; cos, signed_sin: [T, 1, D].

    HF computes x * cos + cat(-x2, x1) * sin; signed_sin = cat(-sin1, sin2) (built once per
    step) turns that into x * cos + cat(x2, x1) * signed_sin, one fused multiply-add.
    """
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), -1), signed_sin)


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


class Linear:
    """x @ weight.T + bias, the weight prepacked once for oneDNN on x86 CPUs (vLLM's CPU backend does the same).

    Prepacking saves repacking the weight at every call, which is a large share of a small-batch
    product. Elsewhere (CUDA, other CPUs) it is F.linear. Both agree to float rounding.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight, self.bias, self.onednn = weight, bias, False
        if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and \
                torch.backends.mkldnn.is_available():
            try:                                                  # kept only if it computes what F.linear does
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)     # 64: a typical batch size
                probe = torch.linspace(-1, 1, weight.shape[1], dtype=weight.dtype)[None]
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                if torch.allclose(got.float(), F.linear(probe, weight, bias).float(), rtol=1e-2, atol=1e-3):
                    self.weight, self.onednn = packed, True
            except (RuntimeError, AttributeError, NotImplementedError):       # no x86 oneDNN: plain products
                pass

    def __call__(self, x: Tensor) -> Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fused(*modules) -> Linear:
    """One Linear computing several nn.Linear modules on the same input, outputs side by side."""
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in modules]
    return Linear(weight, None if all(m.bias is None for m in modules) else torch.cat(biases))


def rms_norm(x: Tensor, norm) -> Tensor:
    """An HF RMSNorm module applied to x: torch's fused kernel in float32 (the same math), the module otherwise."""
    if x.dtype != torch.float32:
        return norm(x)                                   # HF rounds to the low precision before the weight
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def zeros_on_demand(shape: tuple, dtype: torch.dtype, device) -> Tensor:
    """torch.zeros(shape), but on a CPU its memory is an anonymous mmap: the OS commits a page (zeroed)
    only when it is first touched, so blocks never handed out cost no RAM. The operating system's own
    paging, under the engine's; a GPU has none, so there it is plain torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)     # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class PagedModel(torch.nn.Module):
    """An HF Llama/Qwen2 causal LM whose attention reads and writes a paged KV cache.

    The wrapped `model` keeps its weights and its parameter names (so `load_weights` takes
    the trainer's names); `refresh()` rebuilds the fused projections from them and must follow
    any change of the weights. The cache, allocated by `allocate_cache` in the model's dtype,
    is [layers, 2, Hkv, num_blocks, block_size * head_dim]: per layer, keys viewed as [Hkv, NB,
    D, bs] (transposed within a block) and values as [Hkv, NB, bs, D] (see `cache_views`).
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
        self.block_size = 0
        self.refresh()

    def refresh(self) -> None:
        """(Re)build each layer's fused q/k/v, o, gate/up and down products from the HF modules' weights."""
        self.products = [dict(qkv=fused(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                              o=fused(layer.self_attn.o_proj),
                              gate_up=fused(layer.mlp.gate_proj, layer.mlp.up_proj), down=fused(layer.mlp.down_proj))
                         for layer in self.model.model.layers]

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` tokens holds: keys and values of every layer."""
        dtype = next(self.model.parameters()).dtype
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        p = next(self.model.parameters())
        self.cache = zeros_on_demand((self.num_layers, 2, self.num_kv_heads, num_blocks, block_size * self.head_dim),
                                     p.dtype, p.device)
        self.block_size = block_size

    def grow_cache(self, num_blocks: int) -> None:
        """A larger cache holding the old one's blocks under the same ids."""
        old = self.cache
        self.allocate_cache(num_blocks, self.block_size)
        self.cache[:, :, :, :old.shape[3]] = old

    def cache_views(self, layer: int) -> tuple[Tensor, Tensor]:
        """(keys [Hkv, NB, D, bs], values [Hkv, NB, bs, D]) of one layer: views of the cache."""
        Hkv, NB = self.cache.shape[2], self.cache.shape[3]
        return (self.cache[layer, 0].view(Hkv, NB, self.head_dim, self.block_size),
                self.cache[layer, 1].view(Hkv, NB, self.block_size, self.head_dim))

    @torch.no_grad()
    def forward(self, step: Step) -> Tensor:
        """Run `step`; returns logits [R, V] in float32 for the tokens in step.logits_index."""
        inner = self.model.model
        T, H, Hkv, D = step.input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = inner.embed_tokens(step.input_ids)                                           # [T, hidden]
        cos, sin = inner.rotary_emb(x, step.positions[None])                             # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]                                      # [T, 1, D]: all heads
        sin = torch.cat((-sin[..., :D // 2], sin[..., D // 2:]), -1)                     # signed, see rotate
        # once per step, for every layer: decode groups' row indices, other groups' additive masks
        plans = [decode_rows(g, H, self.n_rep, self.cache.shape[3], D, self.block_size) if g.q_index is None else
                 torch.zeros(g.mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~g.mask, float("-inf"))
                 for g in step.groups]
        blocks, offsets = step.slots // self.block_size, step.slots % self.block_size     # [T] each
        for i, (layer, products) in enumerate(zip(inner.layers, self.products, strict=True)):
            attn = layer.self_attn
            qkv = products["qkv"](rms_norm(x, layer.input_layernorm))                   # [T, (H + 2 Hkv) D]
            qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)                              # q and k, rotated together
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            if hasattr(attn, "q_norm"):                                                  # Qwen3
                qk = torch.cat([attn.q_norm(qk[:, :H]), attn.k_norm(qk[:, H:])], 1)
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            keys, values = self.cache_views(i)
            keys[:, blocks, :, offsets] = k                                              # [T, Hkv, D] into their slots
            values.view(Hkv, -1, D).index_copy_(1, step.slots, v.transpose(0, 1))
            scale = getattr(attn, "scaling", D ** -0.5)
            outs = [decode_attention(q[g.start:g.stop], keys, values, plan, scale) if g.q_index is None else
                    gather_attention(q[g.start:g.stop], keys, values, g, plan, scale)
                    for g, plan in zip(step.groups, plans, strict=True)]
            x = x + products["o"](outs[0] if len(outs) == 1 else torch.cat(outs))        # [T, hidden]
            gate, up = products["gate_up"](rms_norm(x, layer.post_attention_layernorm)).chunk(2, -1)
            x = x + products["down"](layer.mlp.act_fn(gate) * up)
        h = inner.norm(x[step.logits_index])                                             # [R, hidden]
        return self.model.lm_head(h).float()                                             # [R, V]
