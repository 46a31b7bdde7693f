"""The paged forward pass's machinery, outside the lesson: padded groups, the in-place decode read,
the products, the rotary table, the cache writes, on-demand cache memory, and the model wrapper's bookkeeping.

Hand-written; notebook 05 (`minirl/rollout/engine/attention.py`) builds the step (`make_step`),
the gathered read (`gather_attention`) and the forward pass (`PagedModel.forward`) on top of it.
On a CPU in float32 each function below runs a C kernel of `paged_kernels.c` where one was
compiled (`paged_kernels.usable`), and torch's own kernels otherwise (a GPU, bf16, no compiler);
`queued` (from paged_kernels) lets a block of them run in one C call.

- `Group`, `Step`, `make_group`: a step's chunks grouped by query width and context length,
  padded to one width, with their causal masks (`make_step` lays the flat tokens out group by group).
- `Rows`, `decode_rows`, `decode_attention`: one query per sequence reads the cache in place. The
  C kernel reads each block of keys and values once for all the query heads sharing it; torch's
  way is `F.embedding_bag` (a gather fused with a weighted sum): keys are stored transposed within
  a block, `[head_dim, block_size]`, so bag (sequence, head, block) sums the block's rows k[:, d]
  with weights q[d] and gives its block_size scores; a second bag sums value rows with the
  attention probabilities. Nothing is copied; the block tables serve every layer of a step.
- `rotate`, `rms_norm`, `act_mul`: HF's rotary embedding, RMSNorm and SwiGLU middle, each one pass;
  `PagedModelBase.rotary` looks the rotary cos/sin up in a table built once (HF recomputes them
  from the positions at every call).
- `Linear`, `fused`: q/k/v as one product and gate/up as another, each weight kept in the layout
  its kernel reads fastest (`Linear`); `add_to` adds a product into the residual stream in place
  (the o and down projections fused with the residual additions).
- `PagedModelBase.write_cache`: the step's new keys and values into their slots, one call per layer.
- `zeros_on_demand`: the cache tensor as an anonymous mmap on a CPU, so unused blocks cost no RAM.
- `check_architecture`, `PagedModelBase`: which HF models run (Llama-style, full attention), and
  the wrapper that keeps the HF module's weights and parameter names, its fused products and the
  cache tensor [layers, 2, Hkv, num_blocks, block_size * head_dim].

Simplified vs vLLM: sequences of a prefill are padded to the longest in their group, with a mask,
and read through a gathered copy; the C kernels run on CPUs only (float32).
"""

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minirl.runtime import paged_kernels as kernels
from minirl.runtime.paged_kernels import queued  # noqa: F401 -- notebook 05's forward queues a decode step's kernels

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class Group:
    """Sequences attended together, padded to one query width Q; their tokens are the flat range start:stop."""

    start: int            # the group's first flat token
    stop: int             # one past its last
    q_index: Tensor | None  # [S, Q] long, into start:stop (padding repeats a real query); None when Q == 1
    valid: Tensor | None  # [S, Q] bool: a real query, not padding; None when Q == 1
    tables: Tensor        # [S, B] long: block tables padded with block 0 (masked out)
    mask: Tensor          # [S, 1, n_rep*Q, B*block_size] bool: key position visible to the query
    lengths: Tensor       # [S] long: each sequence's context after this step (positions its last query sees)


@dataclass
class Step:
    """One forward pass over T new tokens from several sequences, laid out group after group."""

    input_ids: Tensor     # [T] long
    positions: Tensor     # [T] long: position of each token in its sequence
    slots: Tensor         # [T] long: cache slot (block * block_size + offset) its key/value goes to
    groups: list[Group]
    logits_index: Tensor  # [R] long: flat tokens whose next-token logits are returned, in chunk order


def make_group(chunks: list, offsets: list[int], block_size: int, n_rep: int, device) -> Group:
    """The block tables, causal mask and (for chunks longer than 1) padded query index of one group.

    chunks: `Chunk`s (notebook 05) of one group; offsets: the flat index of each one's first token.
    """
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
    return Group(start, stop, q_index, valid, tables, mask, starts + lengths)


@dataclass
class Rows:
    """What a decode group's in-place read needs, for every layer of one step: the block tables and
    context lengths (the C kernel's), and the embedding bags' row indices (torch's, built on first use)."""

    tables: Tensor   # [S, B] long
    lengths: Tensor  # [S] long: sequence s sees positions 0 .. lengths[s] - 1
    num_heads: int
    n_rep: int
    num_blocks: int
    head_dim: int
    block_size: int
    bags: tuple | None = None


def decode_rows(g: Group, num_heads: int, n_rep: int, num_blocks: int, head_dim: int, block_size: int) -> Rows:
    """The Rows of a group of one-token chunks: query head h reads key head h // n_rep."""
    return Rows(g.tables, g.lengths, num_heads, n_rep, num_blocks, head_dim, block_size)


def embedding_bags(rows: Rows) -> tuple[Tensor, Tensor, Tensor]:
    """(keys [S*H*B, D], values [S*H, L], bias [S, 1, L]): rows of keys.view(-1, bs) for bag (sequence, head,
    block), rows of values.view(-1, D) for bag (sequence, head), 0 where a position is visible and -inf elsewhere."""
    if rows.bags is None:
        (S, B), H, D, bs = rows.tables.shape, rows.num_heads, rows.head_dim, rows.block_size
        device = rows.tables.device
        kv_head = torch.arange(H, device=device) // rows.n_rep                                       # [H]
        block = kv_head[None, :, None] * rows.num_blocks + rows.tables[:, None, :]                   # [S, H, B]
        keys = (block[..., None] * D + torch.arange(D, device=device)).view(-1, D)
        values = (block[..., None] * bs + torch.arange(bs, device=device)).view(S * H, -1)
        visible = torch.arange(B * bs, device=device)[None] < rows.lengths[:, None]                  # [S, L]
        bias = torch.zeros(S, 1, B * bs, device=device).masked_fill_(~visible[:, None], float("-inf"))
        rows.bags = (keys, values, bias)
    return rows.bags


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, rows: Rows, scale: float,
                     out: Tensor | None = None) -> Tensor:
    """One query per sequence over its cached keys and values, read in place. q: [S, H, D] -> out [S, H * D]
    (a new tensor, or `out`'s rows, contiguous).

    With the C kernel (float32 on a CPU, head_dim and block_size multiples of 16, at most 8 query heads
    per key head), `paged_kernels.c`'s decode_attention: each key and value read once per key head.
    Otherwise two embedding bags: scores[s, h, block b] = sum_d q[s, h, d] * keys[block, d, :], one
    bag per (s, h, b); out[s, h] = sum_t p[s, h, t] * values[slot t], one bag per (s, h). The
    softmax runs in float32.
    """
    S, H, D = q.shape
    if kernels.usable(q, q.stride(1) == D and q.stride(2) == 1 and D % 16 == 0 and keys.shape[-1] % 16 == 0
                      and H // keys.shape[0] <= 8 and (out is None or out.is_contiguous())):
        out = torch.empty(S, H * D) if out is None else out
        kernels.call("decode_attention", q, q.stride(0), keys, values, rows.tables, rows.lengths, out, S, H,
                     keys.shape[0], D, keys.shape[1], keys.shape[-1], rows.tables.shape[1], scale)
        return out
    bs = keys.shape[-1]
    bag_keys, bag_values, bias = embedding_bags(rows)
    B = bag_keys.shape[0] // (S * H)
    weights = (q[:, :, None].expand(S, H, B, D) * scale).view(-1, D)                           # [S*H*B, D]
    scores = F.embedding_bag(bag_keys, keys.reshape(-1, bs), per_sample_weights=weights, mode="sum")  # [S*H*B, bs]
    p = torch.softmax(scores.view(S, H, B * bs).float().add_(bias), -1).to(values.dtype)      # [S, H, L]
    read = F.embedding_bag(bag_values, values.reshape(-1, D), per_sample_weights=p.view(S * H, -1), mode="sum")
    return read.view(S, H * D) if out is None else out.copy_(read.view(S, H * D))


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary position embedding (HF's rotate-half convention), in place. x: [T, heads, D]; cos, signed_sin: [T, 1, D].

    HF computes x * cos + cat(-x2, x1) * sin; signed_sin = cat(-sin1, sin2) (`PagedModelBase.rotary`)
    turns that into x * cos + cat(x2, x1) * signed_sin, one fused multiply-add, written back into x
    (a view of the step's q/k/v product). Returns x.
    """
    T, heads, D = x.shape
    if kernels.usable(x, x.stride(1) == D and x.stride(2) == 1 and cos.is_contiguous() and signed_sin.is_contiguous()):
        kernels.call("rotate", x, x.stride(0), cos, signed_sin, T, heads, D)
        return x
    half = D // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), -1), signed_sin, out=x)


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
    """x @ weight.T + bias, in the layout that runs a decode step's few-row products fastest.

    On a CPU in float32 with the C kernels (and out_features a multiple of 32), the weight is
    kept packed in panels of 32 columns ([out / 32, in, 32], read by `paged_kernels.c`'s
    `linear`); elsewhere transposed ([in, out], contiguous) for one `torch.mm`/`addmm`. Measured
    at one thread on the 2-core x86 machine of benchmarks/README.md, 32 rows, each product's 8
    layers' weights in turn (as a decode step reads them), in alternating pairs: the panels ran the
    long-tail policy's products at 0.91-1.53x the speed of torch.mm on the transposed weight (the
    wide gate/up product fastest) and the 32 M shape's at 1.04-1.58x; at 512 rows at 0.93-1.06x.
    Same products, float rounding aside. `add_to(out, x)` adds
    x @ weight.T into `out` in place (a residual addition fused into the product).
    """

    PANEL = 32

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        out_features, in_features = weight.shape
        self.bias, self.out_features, self.panels, self.weight_t = bias, out_features, None, None
        if out_features % self.PANEL == 0 and kernels.usable(weight) and (bias is None or kernels.usable(bias)):
            panels = weight.t().reshape(in_features, -1, self.PANEL).transpose(0, 1)                # [out/32, in, 32]
            self.panels = panels.contiguous()
        else:
            self.weight_t = weight.t().contiguous()                                                 # [in, out]

    def __call__(self, x: Tensor) -> Tensor:
        if self.panels is not None:
            return self.run(x, torch.empty(x.shape[0], self.out_features), accumulate=0)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def add_to(self, out: Tensor, x: Tensor) -> Tensor:
        """out += x @ weight.T + bias, in place; returns out."""
        if self.panels is not None:
            return self.run(x, out, accumulate=1)
        out.addmm_(x, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)

    def run(self, x: Tensor, out: Tensor, accumulate: int) -> Tensor:
        if not x.is_contiguous():
            kernels.flush()                              # torch copies x: what queued calls write into it first
            x = x.contiguous()
        M, K = x.shape
        kernels.call("linear", x, self.panels, self.bias, out, M, K, self.out_features, accumulate)
        return out


def fused(*modules) -> Linear:
    """One Linear computing several nn.Linear modules on the same input, outputs side by side."""
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in modules]
    return Linear(weight, None if all(m.bias is None for m in modules) else torch.cat(biases))


def cache_index(slots: Tensor, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int) -> Tensor:
    """[T, 2, Hkv, D] long: where each element of the step's new keys and values goes in one layer's cache.

    A layer's cache is [2, Hkv, num_blocks, block_size * head_dim]: keys transposed within a block
    ([D, bs]), values not ([bs, D]); slot = block * block_size + offset. The same for every layer,
    so it is built once per step and each layer writes with one `put_` (PagedModelBase.write_cache).
    """
    D, bs = head_dim, block_size
    block, offset = (slots // bs)[:, None, None], (slots % bs)[:, None, None]               # [T, 1, 1]
    head = torch.arange(num_kv_heads, device=slots.device)[None, :, None]                  # [1, Hkv, 1]
    d = torch.arange(D, device=slots.device)                                                # [D]
    start = (head * num_blocks + block) * (bs * D)                                          # the block's first element
    keys = start + d * bs + offset
    values = start + num_kv_heads * num_blocks * bs * D + offset * D + d
    return torch.stack((keys, values), 1)


def rms_norm(x: Tensor, norm) -> Tensor:
    """An HF RMSNorm module applied to x [T, n]: in float32 the C kernel or torch's fused one (the same math),
    the module otherwise."""
    weight = norm.weight
    if kernels.usable(x, x.is_contiguous() and weight.dtype == torch.float32):
        out = torch.empty_like(x)
        kernels.call("rms_norm", x, weight, out, x.shape[0], x.shape[-1], norm.variance_epsilon)
        return out
    if x.dtype != torch.float32:
        return norm(x)                                   # HF rounds to the low precision before the weight
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def act_mul(act_fn, gate_up: Tensor) -> Tensor:
    """act_fn(gate) * up of a gated MLP, gate_up = [gate, up] along the last dim: [T, 2m] -> [T, m]."""
    T, m = gate_up.shape[0], gate_up.shape[-1] // 2
    if kernels.usable(gate_up, type(act_fn).__name__ in ("SiLU", "SiLUActivation") and gate_up.is_contiguous()):
        out = torch.empty(T, m)
        kernels.call("silu_mul", gate_up, out, T, m)
        return out
    gate, up = gate_up.chunk(2, -1)
    return act_fn(gate).mul_(up)


def zeros_on_demand(shape: tuple, dtype: torch.dtype, device) -> Tensor:
    """torch.zeros(shape), but on a CPU its memory is an anonymous mmap: the OS commits a page (zeroed)
    only when it is first touched, so blocks never handed out cost no RAM. The operating system's own
    paging, under the engine's; a GPU has none, so there it is plain torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)     # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class PagedModelBase(torch.nn.Module):
    """An HF Llama/Qwen2 causal LM and a paged KV cache; `PagedModel` (notebook 05) adds the forward pass.

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
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")    # Qwen3 norms q and k per head
        self.vocab_size = config.vocab_size
        self.cache: Tensor | None = None
        self.views: list[tuple[Tensor, Tensor]] = []      # cache_views of every layer, made once per cache
        self.block_size = 0
        self.rotary_table: tuple[Tensor, Tensor] | None = None
        self.where: tuple[Tensor, Tensor] | None = None   # (slots, cache_index(slots)) of the step being run
        self.refresh()

    def refresh(self) -> None:
        """(Re)build each layer's fused q/k/v, o, gate/up and down products from the HF modules' weights."""
        self.products = [dict(qkv=fused(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                              o=fused(layer.self_attn.o_proj),
                              gate_up=fused(layer.mlp.gate_proj, layer.mlp.up_proj), down=fused(layer.mlp.down_proj))
                         for layer in self.model.model.layers]

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, signed_sin) [T, 1, D] of HF's rotary embedding at `positions` (see `rotate`), looked up in a table.

        The table holds every position below a power of two >= the largest seen, computed by the HF
        module itself (each angle is one product, position x frequency, so a row of the table is
        what HF computes for that position). Rotary types that depend on the sequence length
        (dynamic scaling, longrope) are computed at every call instead, as HF does.
        """
        emb = self.model.model.rotary_emb
        kind = getattr(emb, "rope_type", "default")
        needed = int(positions.max()) + 1
        if "dynamic" in kind or kind == "longrope":
            return self.rotary_rows(positions)
        if self.rotary_table is None or self.rotary_table[0].shape[0] < needed:
            self.rotary_table = self.rotary_rows(torch.arange(1 << max(needed - 1, 255).bit_length(),
                                                              device=positions.device))
        cos, sin = self.rotary_table
        return cos[positions], sin[positions]

    def rotary_rows(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, signed_sin) [T, 1, D] from the HF rotary module."""
        p = next(self.model.parameters())
        cos, sin = self.model.model.rotary_emb(p[:1], positions[None])                  # [1, T, D] each
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)                          # signed, see rotate
        return cos[0, :, None].to(p.dtype), sin[0, :, None].to(p.dtype)

    def write_cache(self, layer: int, slots: Tensor, kv: Tensor) -> None:
        """Write the step's new keys and values kv [T, 2 * Hkv, D] of `layer` into their slots [T]: with the C
        kernel, or one `put_` through `cache_index` (built once per step, for every layer)."""
        T, D = kv.shape[0], self.head_dim
        if kernels.usable(kv, kv.stride(1) == D and kv.stride(2) == 1):
            keys, values = self.views[layer]
            kernels.call("write_kv", kv, kv.stride(0), slots, keys, values, T, self.num_kv_heads, D, keys.shape[1],
                         self.block_size)
            return
        if self.where is None or self.where[0] is not slots:
            self.where = (slots, cache_index(slots, self.num_kv_heads, self.cache.shape[3], self.block_size, D))
        self.cache[layer].put_(self.where[1], kv)

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` tokens holds: keys and values of every layer."""
        dtype = next(self.model.parameters()).dtype
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        p = next(self.model.parameters())
        self.cache = zeros_on_demand((self.num_layers, 2, self.num_kv_heads, num_blocks, block_size * self.head_dim),
                                     p.dtype, p.device)
        self.block_size, self.where = block_size, None
        Hkv, D = self.num_kv_heads, self.head_dim
        self.views = [(self.cache[i, 0].view(Hkv, num_blocks, D, block_size),
                       self.cache[i, 1].view(Hkv, num_blocks, block_size, D)) for i in range(self.num_layers)]

    def grow_cache(self, num_blocks: int) -> None:
        """A larger cache holding the old one's blocks under the same ids."""
        old = self.cache
        self.allocate_cache(num_blocks, self.block_size)
        self.cache[:, :, :, :old.shape[3]] = old

    def cache_views(self, layer: int) -> tuple[Tensor, Tensor]:
        """(keys [Hkv, NB, D, bs], values [Hkv, NB, bs, D]) of one layer: views of the cache."""
        return self.views[layer]
