# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Generation speed: a paged engine, built and measured claim by claim
#
# **By the end of this notebook you can** say where the time and the memory of generation
# go (most of an RL step when completions are long), and build in plain PyTorch what production
# engines do about it: a **paged KV cache** (vLLM's PagedAttention), **continuous batching**,
# **prefix caching**, a **radix-tree cache** (SGLang) and **speculative decoding**. Together they
# make `PagedEngine`, a rollout engine the training loop uses with one flag. The source's table:
#
# | technique | problem | principle | typical benefit |
# |---|---|---|---|
# | PagedAttention | contiguous KV allocation fragments memory: 50–70 % utilization | fixed-size blocks allocated on demand | 95 %+ utilization, 2–4× larger batches |
# | continuous batching | static batches wait for their slowest sequence | admit a new sequence as soon as one ends | 5–10× throughput |
# | speculative decoding | decoding has low compute density | a small draft proposes, the large model verifies in parallel | 2–3× |
# | prefix caching | G responses to one prompt recompute the prefix | hash and reuse the prompt's KV cache | 70–80 % of prefix compute saved at G = 8 |
#
# We build each row, check that it computes exactly what HF `generate` computes, and measure
# each claim; where a CPU and a tiny model give another figure than a GPU, we say why in numbers.

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import os
import statistics

import matplotlib.pyplot as plt
import torch

from minirl.runtime.generation_display import draw_blocks, draw_timeline, pct, show
from minirl.runtime.notebook import add_to_class  # adds a method to a class of an earlier cell

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
torch.set_num_threads(1)                       # small matrices: one thread is steadier
torch.manual_seed(0)

# %% [markdown]
# ## 0. Two policies to measure on
#
# The embedded policy (notebook 00, about 1 M parameters) answers two-digit sums in at most
# 4 tokens: too short for most questions here. So we add a larger policy with random weights
# on purpose: with near-uniform logits over a 70-token vocabulary each step emits EOS with a
# probability of a few percent, so completion lengths have the long tail of an RL batch, made
# by the model itself. It and the few-shot prompts live in `minirl/runtime/workloads.py`.

# %%
from minirl.models.policy import load_default_policy
from minirl.runtime.workloads import (
    LongTailConfig,
    build_long_tail_policy,
    few_shot_prompts,
    load_long_tail_policy,
)

policy, policy_tok, _ = load_default_policy(progress=False)
big, big_tok, _ = load_long_tail_policy()
for name, model in (("embedded", policy), ("long-tail", big)):
    c = model.config
    print(f"{name:>9}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"{c.num_hidden_layers} layers, {c.num_attention_heads} query / "
          f"{c.num_key_value_heads} key-value heads, vocabulary {c.vocab_size}")
PROMPTS = few_shot_prompts(4 if SMOKE else 16, length=64)
B, G, MAX_NEW = len(PROMPTS), 4 if SMOKE else 8, 48 if SMOKE else 256
print(f"long-tail workload: {B} prompts x G={G}, at most {MAX_NEW} new tokens; a prompt:\n"
      f"{PROMPTS[0]!r}")

# %% [markdown]
# The result first: the finished engine against HF `generate` on two of these prompts (one
# call each, so a noisy figure; section 10 repeats it). The timing harness lives in
# `minirl/runtime/engine_measure.py`, as do all the measurements below; we only call it.

# %%
from minirl.config import SamplingConfig
from minirl.runtime.engine_measure import versus_hf

sampling = SamplingConfig(num_generations=G, max_completion_length=MAX_NEW)
first = versus_hf(big, big_tok, PROMPTS[:2], sampling, repeats=1)
print(f"PagedEngine {first['tokens_per_s']['paged']:.0f} tokens/s, "
      f"HF generate {first['tokens_per_s']['hf']:.0f}: {first['speedup']:.2f}x in tokens/s, "
      f"{first['finish_speedup']:.2f}x in time to finish the batch;\nprompt tokens prefilled: "
      f"{first['paged_counts']['prefill_tokens']:.0f} vs HF's {first['hf_prefill_tokens']}")

# %% [markdown]
# ## 1. Where generation's memory goes: the KV cache, and blocks
#
# Decoding a token attends to every earlier token of its sequence, so an engine keeps each
# token's keys and values for every layer: 2 × layers × key-value heads × head size numbers.
# How long a sequence gets is only known when it ends.

# %%
def kv_bytes_per_token(config, bytes_per_number: int) -> int:
    """Bytes of keys and values one token holds in the cache, over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * bytes_per_number


from transformers import Qwen2Config

qwen7b = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4)
rows = [("embedded (fp32)", kv_bytes_per_token(policy.config, 4)),
        ("long-tail (fp32)", kv_bytes_per_token(big.config, 4)),
        ("Qwen2.5-7B shape (bf16)", kv_bytes_per_token(qwen7b, 2))]
show([(n, f"{b:,} B", f"{b * 4096 / 2**20:,.1f} MiB") for n, b in rows],
     ("model", "KV per token", "one 4k-token sequence"))

# %% [markdown]
# The simplest allocation reserves a contiguous slab for each sequence's maximum length
# (prompt + `max_tokens`) when it starts; most sequences end long before, and the rest of
# the slab sits empty. PagedAttention allocates like virtual memory instead: the cache is a
# pool of fixed-size **blocks** (16 tokens in vLLM); a sequence owns a **block table** listing
# its blocks in order and takes a new block only when its last one is full, so it never holds
# more than `block_size - 1` empty slots. Exercise 5.1 is `grow_table`, the on-demand rule.

# %%
# | export minirl/rollout/engine/blocks.py
"""Paged KV memory: fixed-size blocks, a free list, reference counts and content hashes.

A sequence owns a block table and gets a new block only when its last one is full (vLLM's
PagedAttention). Shared blocks are reference-counted. Simplified vs vLLM: one pool on one
device, no swapping to CPU memory, no copy-on-write (only full blocks are shared).
"""

from collections import OrderedDict
from typing import Callable

from minirl.runtime.cache_upkeep import PoolUpkeep


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` token slots: ceil(num_tokens / block_size); 0 for 0 tokens."""
    return -(-num_tokens // block_size)


def grow_table(table: list[int], num_tokens: int, block_size: int, take: Callable[[], int]) -> int:
    """Append blocks to a sequence's block table until it has room for `num_tokens` tokens.

    table: the sequence's block ids, in order (block i holds positions i*block_size ..
    (i+1)*block_size - 1); take(): hands out one free block id (for example BlockPool.allocate).
    Blocks are taken only when needed: a table that already covers num_tokens slots is left
    as it is (it never shrinks here). Returns the number of blocks appended.
    """
    # BEGIN SOLUTION
    added = 0
    while len(table) * block_size < num_tokens:
        table.append(take())
        added += 1
    return added
    # END SOLUTION

# %% [markdown]
# A full block can be found again by its content: its hash chains its tokens with the hash of
# the block before, so equal hashes stand for equal prefixes (section 7). The pool keeps a
# reference count per block and a free list, least recently freed first.

# %%
# | export minirl/rollout/engine/blocks.py
def block_hash(parent: int | None, tokens) -> int:
    """The hash of one full block: its tokens, chained with the hash of the block before it.

    Chaining makes a block's hash stand for the whole prefix up to its end, so two sequences
    share block i only if they agree on every token up to the end of block i. Python's hash
    of a tuple of ints is deterministic across runs (only str/bytes hashes are salted).
    """
    return hash((parent, *tokens))


class BlockPool(PoolUpkeep):
    """num_blocks blocks, each with a reference count; the free ones in least-recently-freed order.

    allocate() hands out the free block freed longest ago (ref count 1); retain(b) adds a
    holder (taking b off the free list if it was free: a cache hit on a freed block);
    release(b) drops one and frees b at 0. Callbacks in `on_reuse` hear about a free block
    being handed out again, so that a cache forgets the content it is about to lose.
    `num_free`, `num_used`, `grow` and `check`: `minirl.runtime.cache_upkeep`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} and block_size={block_size} "
                             "must both be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse: list[Callable[[int], None]] = []

    def allocate(self) -> int:
        """A free block with reference count 1; RuntimeError if none is free."""
        if not self.free:
            raise RuntimeError(f"BlockPool: all {self.num_blocks} blocks are in use")
        block, _ = self.free.popitem(last=False)        # the one freed longest ago
        for forget in self.on_reuse:
            forget(block)
        self.ref[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of `block` (a sequence sharing it, or a cache keeping it)."""
        if self.ref[block] == 0:
            del self.free[block]                 # a freed block brought back: its content is intact
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at 0 the block joins the free list (content kept until reused)."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"BlockPool.release({block}): a double free")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

# %% [markdown]
# Three sequences of 5, 9 and 3 tokens in a pool of 12 blocks of 4 slots; then the first
# grows by 4 tokens and the second ends. A sequence's blocks need not be adjacent: its table
# alone says where its tokens are.

# %%
pool = BlockPool(num_blocks=12, block_size=4)
tables = {"A": [], "B": [], "C": []}
for name, length in (("A", 5), ("B", 9), ("C", 3)):
    grow_table(tables[name], length, 4, pool.allocate)
fig, axes = plt.subplots(2, 1, figsize=(7, 2.6))
draw_blocks(axes[0], pool, tables, f"tables {tables}; free {list(pool.free)}")
grow_table(tables["A"], 9, 4, pool.allocate)           # A grows to 9 tokens: one more block
for b in tables.pop("B"):                              # B ends: its blocks go back to the free list
    pool.release(b)
draw_blocks(axes[1], pool, tables, f"A grew to 9 tokens, B ended: {tables}; free {list(pool.free)}")
plt.tight_layout()
plt.show()
pool.check()
assert pool.num_used == sum(len(t) for t in tables.values())

# %% [markdown]
# ## 2. Attention through block tables
#
# An engine step flattens the work of many sequences into one list of new tokens: whole
# prompts, prompt tails, single decode tokens. Each token has a position in its sequence and
# a **slot** in the cache, `block_table[position // block_size] * block_size + position %
# block_size`. Every layer writes the step's keys and values into their slots, then each query
# reads its own sequence's keys and values back through the block table.
#
# vLLM reads the blocks in place, inside its attention kernel. Plain PyTorch has no attention
# kernel that takes a block table, so the clear way is to **gather**: copy a sequence's blocks
# into a padded tensor (`index_select`) and call `scaled_dot_product_attention` with a causal
# mask. For a decode step (one query per sequence) the copy triples the bytes attention moves,
# so the engine then reads in place: on a CPU with a C compiler, a small kernel of our own
# (`minirl/runtime/paged_kernels.c`, vLLM's idea: each key read once for all the query heads
# sharing it), otherwise `F.embedding_bag` (a gather fused with a weighted sum). That read, the
# padded groups and masks, the products, the cache writes and the model wrapper's bookkeeping
# live in `minirl/runtime/paged_ops.py`; here we write the step (`make_step`: a `Chunk` per
# sequence flattened into ids, positions, slots and attention groups), the gathered read and
# the forward pass.

# %%
# | export minirl/rollout/engine/attention.py
"""Attention through block tables over a paged KV cache, on a Hugging Face Llama/Qwen2 model.

`PagedModel` runs one engine step: new tokens of many sequences at once, each written into its
cache slot, each query reading its own sequence's keys and values through its block table.
Groups, masks, the in-place decode read and fused products: `minirl.runtime.paged_ops`.
"""

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

# %% [markdown]
# The gathered read, for one group of sequences padded together. Grouped-query attention costs
# no copy: the n_rep query heads sharing a key head are stacked along the query axis.

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The forward pass of one `Step` (`PagedModelBase` keeps the HF module's weights, the fused
# products and the cache): per layer, q/k/v as one product, rotary, the new keys and values
# written into their slots, the two reads, the MLP.
#
# A step of decode rows runs nothing but our C kernels, ten per layer. Called one by one, each
# costs microseconds of Python and torch bookkeeping, made slower by the kernel before it, whose
# stream of weights pushed Python's own data out of the caches. So such a step **queues** them
# (`ops.queued`) and runs the queue in one C call at the end of the block: the CPU's counterpart of
# kernels launched onto a CUDA stream, or of the CUDA graph vLLM replays for a decode step. The
# rule that comes with it: inside the block, torch must not touch what a queued kernel writes (an
# op taking torch's path runs the queue first). Steps with a prefill, or with Qwen3's q/k norms,
# use torch between the kernels and run call by call.

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The test that matters: three prompts prefilled through tables of 16-token blocks (the gathered
# read), then each decodes its last token (the in-place read); the logits must equal a plain HF
# forward pass's, and the two reads must agree on the same queries.

# %%
from minirl.runtime.paged_ops import decode_attention, decode_rows

with torch.no_grad():
    for name, model, tok in (("embedded", policy, policy_tok), ("long-tail", big, big_tok)):
        texts = few_shot_prompts(3, length=20 if name == "embedded" else 60)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        paged = PagedModel(model)
        paged.allocate_cache(30, 16)
        tbl = [list(range(10 * i, 10 * i + 10)) for i in range(3)]
        prefill = [Chunk(x[:-1], 0, t) for x, t in zip(ids, tbl, strict=True)]
        paged(make_step(prefill, 16, paged.n_rep, "cpu"))
        decode = make_step([Chunk(x[-1:], len(x) - 1, t) for x, t in zip(ids, tbl, strict=True)], 16,
                           paged.n_rep, "cpu")
        diff = (paged(decode) - torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids]))
        keys, values = paged.cache_views(0)
        reads = 0.0
        for g in decode.groups:                          # the same queries, read both ways
            q = torch.randn(g.stop - g.start, paged.num_heads, paged.head_dim)
            bias = torch.zeros(g.mask.shape).masked_fill_(~g.mask, float("-inf"))
            rows = decode_rows(g, paged.num_heads, paged.n_rep, 30, paged.head_dim, 16)
            gap = (decode_attention(q, keys, values, rows, 0.125)
                   - gather_attention(q, keys, values, g, bias, 0.125))
            reads = max(reads, gap.abs().max().item())
        print(f"{name:>9}: max |paged - HF| over {diff.numel()} logits = {diff.abs().max():.2e}; "
              f"in place vs gathered read: {reads:.1e}")
        assert diff.abs().max() < 1e-4 and reads < 1e-5

# %% [markdown]
# ## 3. The scheduler: continuous batching
#
# A static batcher runs a batch until its longest sequence ends; a sequence that ended early
# keeps its row as padding (HF `generate` does this with a GRPO batch). Continuous batching
# (Orca, vLLM) decides anew at every step, which `schedule` does:
#
# 1. every running sequence gets one decode token, and a new block if its last is full; if no
#    block is free, the most recently admitted sequence is **preempted**: its blocks are freed
#    and it goes back to the front of the queue, to recompute later (vLLM's default);
# 2. waiting sequences are **admitted** in order while the admission rule allows (exercise
#    5.2); their prefills run in the same forward pass as the decodes.
#
# The sequences, the queues and the moves that need no decision (take a block, release,
# finish, preempt) live in `minirl/runtime/scheduler_state.py`; the decisions are here.

# %%
# | export minirl/rollout/engine/scheduler.py
"""Continuous batching: which sequences run in the next step, and with which blocks.

`policy="static"` is the baseline (a batch waits for the previous one to finish);
`reserve="max_length"` is contiguous preallocation. Simplified vs vLLM: no chunked prefill, no
priorities, no swapping to CPU memory (preempted sequences recompute).
"""

from minirl.rollout.engine.blocks import blocks_needed, grow_table
from minirl.runtime.scheduler_state import RUNNING, SchedulerState, Sequence


def can_admit(num_running: int, max_num_seqs: int, blocks_wanted: int, blocks_free: int,
              new_tokens: int, token_budget: int, step_is_empty: bool) -> bool:
    """The admission rule: may the first waiting sequence join the next step?

    num_running: sequences already running (batch slots in use); max_num_seqs: slots in all.
    blocks_wanted: free blocks its admission takes (all the blocks its tokens need, minus
    those a prefix-cache hit lets it share with running sequences); blocks_free: free blocks
    now. new_tokens: tokens it must compute (those not found in the cache); token_budget:
    tokens the step may still take. step_is_empty: nothing is scheduled in this step yet.
    Admit iff a slot is free, the blocks it wants are free, and its new tokens fit the
    budget; a sequence larger than the whole budget may still run alone in an empty step
    (otherwise it would wait for ever).
    """
    # BEGIN SOLUTION
    if num_running >= max_num_seqs or blocks_wanted > blocks_free:
        return False
    return new_tokens <= token_budget or step_is_empty
    # END SOLUTION

# %%
# | export minirl/rollout/engine/scheduler.py
class Scheduler(SchedulerState):
    """Decides each step's work: decodes first, preempting the most recently admitted sequence
    when blocks run out, then admissions while `can_admit` allows."""

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (sequence, new tokens to compute) pairs, decodes first."""
        work, preempted = [], 0
        budget = self.max_num_batched_tokens
        for seq in list(self.running):                       # 1. one decode token each
            if seq not in self.running:                      # preempted for an earlier one
                continue
            wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(seq.block_table)
            while wanted > self.free_blocks() and seq in self.running:
                self.preempt(self.running[-1])               # the most recently admitted
                preempted += 1
            if seq in self.running:
                grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size,
                           self.take_block)
                work.append((seq, seq.num_new))
                budget -= seq.num_new
        admitted = 0
        static = self.policy == "static"
        batch_running = static and len(self.running) > 0     # static: the next batch waits
        while self.waiting and not preempted and not batch_running:   # 2. admissions, in order
            seq = self.waiting[0]
            # a static batch is prefilled whole in one step, as HF generate does
            if not self.admit(seq, float("inf") if static else budget, step_is_empty=not work):
                break
            self.waiting.popleft()
            self.running.append(seq)
            work.append((seq, seq.num_new))
            budget -= seq.num_new
            admitted += 1
            self.register(seq)               # its siblings, admitted next, can share its blocks
        for seq, _ in work[:len(work) - admitted]:
            self.register(seq)
        self.record(work, admitted, preempted)               # the step's line of `timeline`
        return work

# %% [markdown]
# `admit` counts the blocks a prefix hit lets a sequence share before it asks `can_admit`.

# %%
# | export minirl/rollout/engine/scheduler.py
@add_to_class(Scheduler)
def admit(self, seq: Sequence, budget: int, step_is_empty: bool) -> bool:
    """Give `seq` its blocks (cached ones shared, the rest new) if `can_admit` says it fits."""
    cached = self.cache.match(seq.tokens) if self.cache is not None else []
    # a cached block in use by another sequence costs nothing; a free (or evictable) one is taken
    evictable = self.cache.evictable_blocks() if cached else set()
    taken = sum(1 for b in cached if self.pool.ref[b] == 0 or b in evictable)
    wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(cached) + taken
    new_tokens = len(seq.tokens) - len(cached) * self.block_size
    if not can_admit(len(self.running), self.max_num_seqs, wanted, self.free_blocks(), new_tokens,
                     budget, step_is_empty):
        return False
    for b in cached:
        self.pool.retain(b)
    seq.block_table = list(cached)
    grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
    seq.num_computed = seq.num_cached = len(cached) * self.block_size
    seq.status = RUNNING
    seq.spans.append([len(self.timeline), len(self.timeline)])
    return True

# %% [markdown]
# ## 4. The engine
#
# One `step()` schedules, runs one forward pass over all the scheduled tokens (or, with a draft,
# a speculative round: section 9), samples a token for every sequence whose pending tokens are
# all computed, and retires those that hit EOS or their limit; `run` steps until all requests
# are served. The engine's construction (its copy of the policy, the cache, pool, scheduler and
# prefix cache), argument checks, `Stats` and notebook 01's rollout protocol (`generate`,
# `load_weights`) live in `minirl/runtime/engine_core.py`.

# %%
# | export minirl/rollout/engine/engine.py
"""`PagedEngine`: the paged KV cache, the scheduler and the caches behind the rollout protocol.

    engine = PagedEngine(model, tokenizer)                # its own copy of the policy, version 0
    rollout = engine.generate(prompts, SamplingConfig(num_generations=8, max_completion_length=256))

Construction, checks and the protocol: `minirl.runtime.engine_core`. Simplified vs vLLM: one
process, one device, no CUDA graphs, plain temperature sampling.
"""

import time

import torch

from minirl.rollout.engine.attention import Chunk, make_step
from minirl.rollout.engine.speculative import speculative_step
from minirl.rollout.sampling import sample_tokens
from minirl.runtime.engine_core import EngineCore, Request, Stats
from minirl.runtime.scheduler_state import RUNNING, Sequence


def forward_step(engine: "PagedEngine", work: list[tuple[Sequence, int]], clock: float,
                 generator: torch.Generator | None = None) -> None:
    """One plain step: the scheduled chunks (prefills and decode tokens) in one forward pass, then
    one token sampled for every sequence whose pending tokens are now all computed.

    clock: perf_counter() when the step's scheduling ended (phase seconds go to `engine.stats`).
    """
    chunks = []
    for seq, n in work:
        if seq.status != RUNNING:                            # a padding row of a static batch
            pad = [engine.tokenizer.pad_token_id]
            chunks.append(Chunk(pad, seq.num_computed, seq.block_table, 0))
            engine.stats.padding_tokens += 1
            continue
        chunks.append(Chunk(seq.tokens[seq.num_computed:], seq.num_computed, seq.block_table, 1))
        engine.stats.count(seq, n)                           # a prefill, or decode tokens
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step)                                              # [R, V]
    clock = engine.tick("forward", clock)
    live = [seq for seq, _ in work if seq.status == RUNNING]
    temperatures = torch.tensor([s.temperature for s in live], device=logits.device)
    tokens, logprobs = sample_tokens(logits, temperatures, generator)   # notebook 01's sampling
    clock = engine.tick("sample", clock)
    for seq, n in work:
        seq.num_computed += n
    for seq, token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
        engine.append(seq, [token], [logprob])
    engine.tick("postprocess", clock)


class PagedEngine(EngineCore):
    """A paged, continuously batched, prefix-caching (optionally speculative) engine on an HF
    causal LM; the constructor's arguments, `generate` and `load_weights` are `EngineCore`'s."""

    def step(self, generator: torch.Generator | None = None) -> None:
        """Schedule, run one forward pass over the scheduled tokens, sample, update sequences."""
        clock = time.perf_counter()
        work = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.timeline[-1]["preempted"]
        clock = self.tick("schedule", clock)
        self.stats.steps += 1
        if not work:
            return
        decoding = [seq for seq, n in work
                    if seq.status == RUNNING and seq.num_computed > seq.num_cached and n == 1]
        if self.draft is not None and len(decoding) == len(work):
            speculative_step(self, decoding, generator)
            return
        forward_step(self, work, clock, generator)

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Add sampled tokens to `seq`, stopping at EOS or max_tokens; finish it if it stopped."""
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            self.stats.generated_tokens += 1
            if token == seq.eos_token_id or seq.num_generated >= seq.max_tokens:
                self.scheduler.finish(seq, "eos" if token == seq.eos_token_id else "length")
                return

    def run(self, requests: list[Request], generator: torch.Generator | None = None
            ) -> list[Sequence]:
        """Serve every request; returns their sequences in order (see Sequence.completion / .error).

        `stats` and the scheduler's `timeline` then describe this run alone.
        """
        self.stats = Stats()
        self.scheduler.timeline = []
        self.size_to_work(requests)          # a cache sized to the work grows to hold them
        seqs = [self.add(r) for r in requests]
        while self.scheduler.has_work():
            self.step(generator)
        return seqs

# %% [markdown]
# Correct first. Greedy decoding must give exactly HF `generate`'s tokens, on both policies,
# and the log-probs recorded while sampling must equal the trainer's float32 recomputation
# (`completion_logprobs`, notebook 01) up to rounding.

# %%
from minirl.algo.logprobs import completion_logprobs
from minirl.runtime.engine_measure import hf_greedy
from minirl.tasks.arithmetic import format_prompt, make_task

TASK = make_task()
checks = [("embedded", policy, policy_tok, [format_prompt(p) for p in TASK.test[:64]], 5, 4),
          ("long-tail", big, big_tok, few_shot_prompts(4), 16 if SMOKE else 64, 16)]
for name, model, tok, texts, n_new, bs in checks:
    engine = PagedEngine(model, tok, block_size=bs)
    requests = [Request(tok(t, add_special_tokens=False)["input_ids"], n_new, 0.0) for t in texts]
    got = [s.completion for s in engine.run(requests)]
    same = sum(g == w for g, w in zip(got, hf_greedy(model, tok, texts, n_new), strict=True))
    ro = engine.generate(texts[:4], SamplingConfig(num_generations=4, max_completion_length=n_new),
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask,
                                         ro.num_completion_tokens)
    gap = (trainer - ro.logprobs)[ro.completion_mask.bool()].abs().max().item()
    print(f"{name:>9}: greedy = HF for {same}/{len(texts)} prompts; log-probs vs the trainer's: "
          f"max |diff| {gap:.1e} ({int(ro.completion_mask.sum())} tokens)")
    assert same == len(texts) and gap < 1e-4

# %% [markdown]
# The scheduler at work: 12 requests, 4 batch slots, 24 blocks of 4 tokens (too few for 4
# long sequences). Each bar is one sequence's stay in the batch; a cross marks a preemption.

# %%
demo = PagedEngine(big, big_tok, block_size=4, num_blocks=24, max_num_seqs=4, cache="none",
                   max_model_len=96)
lengths = [10, 40, 6, 25, 14, 30, 8, 18, 12, 22, 5, 16]
ids = big_tok(few_shot_prompts(12, length=12), add_special_tokens=False)["input_ids"]
demo_seqs = demo.run([Request(x, n, 0.0) for x, n in zip(ids, lengths, strict=True)])
draw_timeline(demo, demo_seqs, f"continuous batching, 4 slots, 24 blocks of 4: "
              f"{demo.stats.steps} steps, {demo.stats.preemptions} preemptions")
assert demo.pool.num_free == demo.num_blocks
assert all(len(s.completion) <= n for s, n in zip(demo_seqs, lengths, strict=True))

# %% [markdown]
# ## 5. Measured: KV memory utilization (the PagedAttention row)
#
# Utilization is the share of reserved KV slots that hold a token, summed over a run's steps:
# the paged engine's blocks against contiguous preallocation of prompt + `max_tokens` slots for
# the same running sequences. Then the payoff: how many sequences one cache runs at once.

# %%
from minirl.runtime.engine_measure import effective_batch, kv_utilization

kv = kv_utilization(big, big_tok, PROMPTS, sampling)
lengths = torch.tensor(kv["completion_lengths"], dtype=torch.float)
prompt_ids = big_tok(PROMPTS, add_special_tokens=False)["input_ids"]
prompt_len = statistics.mean(len(x) for x in prompt_ids)
print(f"completion lengths: mean {lengths.mean():.0f}, median {lengths.median():.0f}, "
      f"max {lengths.max():.0f}, {(lengths == MAX_NEW).float().mean() * 100:.0f} % at the cap")
cache_tokens = 512 if SMOKE else 2048
eb = effective_batch(big, big_tok, PROMPTS[:B // 2], sampling, cache_tokens=cache_tokens)
# a sequence of L new tokens holds on average prompt + L/2 slots during its L steps; it reserves
# prompt + max_tokens (contiguous) or those slots and, on average, half a block more (paged)
held = lengths * (prompt_len + lengths / 2)
expected = float(held.sum() / (lengths * (prompt_len + MAX_NEW)).sum())
expected_paged = float(held.sum() / (held + lengths * kv["block_size"] / 2).sum())
show([("contiguous utilization", "50-70 %", pct(kv["contiguous"]),
       "agree" if 0.5 <= kv["contiguous"] <= 0.7 else "differ",
       f"expected {pct(expected)}: a slab is as full as its sequence gets "
       f"(mean {lengths.mean():.0f} of {MAX_NEW} new tokens)"),
      ("paged utilization", "95 %+", pct(kv["paged"]), "agree" if kv["paged"] >= 0.95 else "differ",
       f"expected {pct(expected_paged)}: only the last block is partly empty"),
      ("sequences at once, same cache", "2-4x", f"{eb['ratio']:.1f}x ({eb['paged']:.0f} vs "
       f"{eb['contiguous']:.0f})", "agree" if 2 <= eb["ratio"] <= 4 else "differ",
       f"{cache_tokens}-token cache; paged preempts when it runs out ({eb['preemptions']} times)")],
     ("quantity", "source", "minirl", "agree?", "why"))
assert kv["paged"] > 0.85 and kv["paged"] > kv["contiguous"] and eb["ratio"] > 1

# %% [markdown]
# A slab fills only as far as its sequence gets, so the longer the tail of lengths, the worse
# contiguous reservation does; paged allocation wastes half a block per sequence on average,
# so its 95 % depends on how many tokens a sequence holds against the block size.
#
# ## 6. Measured: continuous vs static batching
#
# The same requests with 16 batch slots (4 in smoke mode) under the two policies, interleaved.
# A step costs a fixed part, a part per decode row and a part per prefill token; a cost model
# fitted from three timed steps turns each policy's counted work into seconds.

# %%
from minirl.runtime.engine_measure import continuous_vs_static, predicted_seconds, step_costs

cvs = continuous_vs_static(big, big_tok, PROMPTS[:max(2, B // 2)], sampling,
                           max_num_seqs=4 if SMOKE else 16, repeats=1,
                           progress="continuous vs static")
work = cvs["work"]
costs = step_costs(big, 16)
predicted = {p: predicted_seconds(costs, w) for p, w in work.items()}
model_ratio = predicted["static"] / predicted["continuous"]
show([(p, w["steps"], w["decode_rows"], w["prefill_tokens"], f"{predicted[p]:.2f}",
       f"{statistics.median(cvs['seconds'][p]):.2f}") for p, w in work.items()],
     ("policy", "steps", "decode rows", "prefill tokens", "model s", "measured s"))
print(f"a step on this CPU: {1e3 * costs['fixed']:.1f} ms + {1e3 * costs['per_row']:.2f} ms per "
      f"decode row + {1e3 * costs['per_prefill_token']:.2f} ms per prefill token")
show([("throughput, continuous / static", "5-10x", f"{cvs['ratio']:.2f}x (measured)",
       "agree" if 5 <= cvs["ratio"] <= 10 else "differ",
       f"the cost model predicts {model_ratio:.2f}x"),
      ("if a step cost the same for any batch", "-", f"{cvs['step_ratio']:.2f}x (steps)", "-",
       "a GPU's memory-bound decode step: time follows steps"),
      ("if time followed rows only", "-", f"{cvs['row_ratio']:.2f}x (rows)", "-",
       "a compute-bound step: time follows rows")],
     ("quantity", "source", "minirl", "agree?", "why"))
assert work["static"]["steps"] >= work["continuous"]["steps"] and cvs["row_ratio"] > 1

# %% [markdown]
# The static batcher computes more rows (padding) in more steps. On a CPU time follows rows; on
# a GPU a decode step is memory-bound and costs about the same for 1 row as for dozens, so the
# gain follows the steps. The source's 5–10× also counts the larger batches paged memory allows.
#
# ## 7. Prefix caching: the G completions of a prompt share its blocks
#
# GRPO samples G completions of every prompt, and without sharing each prefills the whole
# prompt. A prefix cache finds a **full** block by its chained hash; at admission a sequence
# looks up its blocks' hashes one after another (exercise 5.3) and shares, by reference count,
# every block found until the first miss. Only whole blocks are shared, and the last prompt
# token is always computed (it gives the logits of the first sampled token), so a prompt of P
# tokens shares `block_size * floor((P - 1) / block_size)` of them. With G completions, saved
# share = (G − 1)/G × shared/P, which tends to 1 − 1/G = 87.5 % at G = 8 for long prompts.
# Freed blocks stay findable until the pool hands them out again (vLLM's design).

# %%
# | export minirl/rollout/engine/prefix.py
"""Prefix caching: full blocks found again by the chained hash of their content, and shared.

A registered block stays findable after its last user frees it, until the pool hands it out
again. Simplified vs vLLM: Python's tuple hash instead of SHA-256 (a collision is caught by
comparing the tokens).
"""

from minirl.rollout.engine.blocks import BlockPool, block_hash
from minirl.runtime.cache_upkeep import NoEviction


def match_prefix(tokens: list[int], block_size: int,
                 table: dict[int, tuple[int, tuple]]) -> list[int]:
    """The blocks holding the longest cached prefix of `tokens`, whole blocks only.

    table maps a block hash (`block_hash(parent_hash, block_tokens)`, parent_hash None for
    the first block) to (block id, the block's tokens as a tuple). Walk the full blocks of
    `tokens` in order, chaining the hashes, and collect the block ids until the first block
    that is missing or whose stored tokens differ (a hash collision). Only the first
    (len(tokens) - 1) // block_size blocks are candidates: the last token is always computed.
    """
    # BEGIN SOLUTION
    blocks, parent = [], None
    for i in range((len(tokens) - 1) // block_size):
        chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = block_hash(parent, chunk)
        hit = table.get(parent)
        if hit is None or hit[1] != chunk:
            break
        blocks.append(hit[0])
    return blocks
    # END SOLUTION

# %% [markdown]
# `PrefixCache` keeps the table `match_prefix` reads: it registers each block of a sequence
# as the block fills, and forgets a block when the pool hands it out again.

# %%
# | export minirl/rollout/engine/prefix.py
class PrefixCache(NoEviction):
    """Hash-chained full-block prefix cache over a BlockPool (vLLM's automatic prefix caching).

    match(tokens) -> block ids to share; insert(tokens, block_table) registers the full
    blocks of a sequence whose keys/values are (or are being) computed. `hit_tokens` /
    `lookup_tokens` count tokens found / tokens asked for at admission.
    """

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.table: dict[int, tuple[int, tuple]] = {}      # hash -> (block, tokens)
        self.hash_of: dict[int, int] = {}                  # block -> hash
        self.hit_tokens = self.lookup_tokens = 0
        pool.on_reuse.append(self.forget)

    def match(self, tokens: list[int]) -> list[int]:
        blocks = match_prefix(tokens, self.block_size, self.table)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def insert(self, tokens: list[int], block_table: list[int]) -> None:
        """Register every full block of `tokens` (held in `block_table`) not registered yet.

        A registered block stands for its whole prefix (its hash is chained), so hashing
        resumes after the last registered block instead of from the first.
        """
        full = len(tokens) // self.block_size
        start = full
        while start > 0 and block_table[start - 1] not in self.hash_of:
            start -= 1
        parent = self.hash_of[block_table[start - 1]] if start > 0 else None
        for i in range(start, full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, chunk)
            if parent not in self.table:          # first copy wins; a duplicate stays private
                self.table[parent] = (block_table[i], chunk)
                self.hash_of[block_table[i]] = parent

    def forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.table.get(h, (None,))[0] == block:
            del self.table[h]

# %% [markdown]
# Two prompts of 10 tokens, G = 3 each, blocks of 4: the later completions share the first's
# full blocks (grey, with their reference count) and own only their last, partial block.

# %%
small = PagedEngine(big, big_tok, block_size=4, num_blocks=24, cache="prefix", max_model_len=32)
for p in few_shot_prompts(2, length=10, seed=3):
    for _ in range(3):
        small.add(Request(big_tok(p, add_special_tokens=False)["input_ids"][:10], 4, 0.0))
small.scheduler.schedule()                              # admit all six: one step's tables
running = small.scheduler.running
names = {s.id: f"{'ab'[s.id // 3]}{s.id % 3}" for s in running}
fig, ax = plt.subplots(figsize=(7, 1.6))
draw_blocks(ax, small.pool, {names[s.id]: s.block_table for s in running},
            "after admission: " + ", ".join(f"{names[s.id]} {s.block_table}" for s in running))
plt.tight_layout()
plt.show()
print(f"prompt tokens {sum(len(s.tokens) for s in running)}, to compute "
      f"{sum(s.num_new for s in running)}, found in the cache {sum(s.num_cached for s in running)}")
assert sum(s.num_cached for s in running) == 2 * 2 * 8      # 2 prompts x 2 sharers x 2 full blocks

# %% [markdown]
# The source's figure at G = 8, counted (one token per completion: all prefill), and a sweep
# over block size and prompt length against the closed form (on a one-layer model: counts do
# not depend on the weights).

# %%
from minirl.runtime.engine_measure import closed_form_saved, prefix_savings
from minirl.runtime.generation_display import plot_prefix_sweep

ps = prefix_savings(big, big_tok, PROMPTS[:2 if SMOKE else 4], num_generations=8, block_size=16)
show([("prefill saved at G = 8", "70-80 %", pct(ps["saved"]),
       "agree" if 0.7 <= ps["saved"] <= 0.8 else "differ",
       f"closed form {pct(ps['closed_form'])} for ~{ps['mean_prompt_len']:.0f}-token prompts, "
       "16-token blocks; the limit 1 - 1/G = 87.5 % needs long prompts")],
     ("quantity", "source", "minirl", "agree?", "why"))
assert abs(ps["saved"] - ps["closed_form"]) < 1e-9
counter, _ = build_long_tail_policy(LongTailConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                   num_kv_heads=1, intermediate_size=64))
sweep_bs = [(bs, prefix_savings(counter, big_tok, PROMPTS[:2], 8, bs)) for bs in (4, 8, 16, 32)]
sweep_len = [(n, prefix_savings(counter, big_tok, few_shot_prompts(2, length=n, seed=1), 8, 16))
             for n in (16, 32, 48, 96, 128, 256)]
plot_prefix_sweep(sweep_bs, sweep_len, closed_form_saved)
assert all(abs(r["saved"] - r["closed_form"]) < 1e-9 for _, r in sweep_bs + sweep_len)
print(f"70-80 % saved at G = 8 <=> each later completion recomputes {pct(1 - 0.8 * 8 / 7)} to "
      f"{pct(1 - 0.7 * 8 / 7)} of its prompt;\nhere {pct(1 - ps['closed_form'] * 8 / 7)}")

# %% [markdown]
# The saving climbs towards 1 − 1/G with the prompt length and saw-tooths with P − 1 modulo
# the block size: the source's 70–80 % fits short prompts for 16-token blocks, not G = 8 alone.
#
# ## 8. A radix tree of blocks (SGLang's RadixAttention)
#
# SGLang keeps the cached sequences in a radix tree: each edge holds a run of blocks, a node's
# children are keyed by the tokens of their first block, and a lookup walks down as far as the
# tokens agree. It suits multi-turn conversations (turn t + 1 starts with all of turn t). The
# tree holds a reference to its blocks and, when the pool runs dry, evicts least recently used
# leaves first (`minirl/runtime/cache_upkeep.py`, with the pool's growth and checks).

# %%
# | export minirl/rollout/engine/radix.py
"""A radix-tree prefix cache, SGLang's RadixAttention at block granularity.

Each edge holds a run of full blocks; a node's children are keyed by the tokens of their first
block. Edge splits and LRU eviction: `minirl.runtime.cache_upkeep`. Simplified vs SGLang: whole
blocks only, no cache-aware reordering of the waiting queue.
"""

import itertools

from minirl.rollout.engine.blocks import BlockPool
from minirl.runtime.cache_upkeep import RadixUpkeep


class Node:
    """A tree node: the edge from its parent (tokens and the blocks holding them), its children."""

    __slots__ = ("parent", "first", "tokens", "blocks", "children", "last_access")

    def __init__(self, parent, tokens: tuple, blocks: list[int], clock: int, block_size: int):
        self.parent, self.tokens, self.blocks = parent, tokens, blocks
        self.first = tokens[:block_size]             # the key under which the parent finds it
        self.children: dict[tuple, "Node"] = {}
        self.last_access = clock


class RadixCache(RadixUpkeep):
    """Prefix cache over a BlockPool as a radix tree of block runs; PrefixCache's interface."""

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.root = Node(None, (), [], 0, pool.block_size)
        self.held: set[int] = set()                  # blocks the tree holds a reference to
        self.clock = itertools.count(1)
        self.hit_tokens = self.lookup_tokens = 0

    def chunk(self, tokens, i: int) -> tuple:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def walk(self, tokens: list[int], limit: int):
        """Follow `tokens` down the tree for at most `limit` blocks.

        Returns (blocks found, last node reached, number of that node's edge blocks matched).
        """
        node, blocks, now = self.root, [], next(self.clock)
        node.last_access = now
        while len(blocks) < limit:
            child = node.children.get(self.chunk(tokens, len(blocks)))
            if child is None:
                return blocks, node, len(node.blocks)
            child.last_access = now
            n = 0
            while n < len(child.blocks) and len(blocks) < limit and \
                    self.chunk(child.tokens, n) == self.chunk(tokens, len(blocks)):
                blocks.append(child.blocks[n])
                n += 1
            if n < len(child.blocks):
                return blocks, child, n
            node = child
        return blocks, node, len(node.blocks)

    def match(self, tokens: list[int]) -> list[int]:
        blocks, _, _ = self.walk(tokens, (len(tokens) - 1) // self.block_size)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

# %% [markdown]
# Inserting: walk down as far as the tree agrees, split the edge where the sequence leaves it,
# and hang the rest below as a new leaf holding a reference to each of its blocks.

# %%
# | export minirl/rollout/engine/radix.py
@add_to_class(RadixCache)
def insert(self, tokens: list[int], block_table: list[int]) -> None:
    """Add the full blocks of `tokens` (held in `block_table`), sharing what the tree has."""
    full = len(tokens) // self.block_size
    found, node, n = self.walk(tokens, full)
    if n < len(node.blocks):                     # the sequence leaves this edge midway: split it
        node = self.split(node, n)
    if len(found) < full:
        bs = self.block_size
        leaf = Node(node, tuple(tokens[len(found) * bs:full * bs]),
                    list(block_table[len(found):full]), next(self.clock), bs)
        node.children[leaf.first] = leaf
        for b in leaf.blocks:
            self.pool.retain(b)
            self.held.add(b)


# %% [markdown]
# A multi-turn workload: 8 conversations of 4 turns (3 of 3 in smoke mode), each prompt the
# previous prompt, its answer and a new message; the share of prompt tokens found in a roomy
# cache and in one too small to keep every conversation.

# %%
from minirl.runtime.engine_measure import multi_turn

C, TURNS, ANSWER = (3, 3, 12) if SMOKE else (8, 4, 24)
opening = few_shot_prompts(C, length=48, seed=10)
follow = [few_shot_prompts(C, length=24, seed=11 + t) for t in range(TURNS - 1)]
rows, hit = [], {}
for blocks, label in ((None, "roomy"), (32 if SMOKE else 64, "tight")):
    for cache in ("none", "prefix", "radix"):
        mt = multi_turn(big, big_tok, opening, follow, max_tokens=ANSWER, cache=cache,
                        num_blocks=blocks)
        hit[label, cache] = mt
        rows.append((label, cache, pct(mt["hit_rate"]), pct(mt["hit_rate_after_first"]),
                     " ".join(f"{h:.2f}" for h in mt["per_turn"])))
show(rows, ("cache size", "cache", "hit rate", "from turn 2", "per turn"))
for label in ("roomy", "tight"):
    gap = hit[label, "radix"]["hit_rate"] - hit[label, "prefix"]["hit_rate"]
    print(f"{label}: radix - prefix hit rate = {100 * gap:+.1f} points: "
          + ("the same prefixes found" if abs(gap) < 1e-9 else "the two caches part ways"))
assert hit["roomy", "radix"]["hit_rate_after_first"] > 0.5 and hit["roomy", "none"]["hit_rate"] == 0

# %% [markdown]
# With room for everything, a hash chain and a tree find the same blocks; under memory
# pressure they can part ways, as what is evicted decides what is found. The source gives no
# figure for RadixAttention; the table above is ours.

# %% [markdown]
# ## 9. Speculative decoding
#
# A decode step reads every weight for one token per sequence, leaving a GPU's arithmetic
# mostly idle. A cheap **draft** proposes k tokens and the target checks them in one forward
# pass over k + 1 positions. Draft token i is kept with probability min(1, p_i(d_i) / q_i(d_i)) while
# every earlier one was kept; at the first rejection a replacement is drawn from
# max(0, p_i − q_i), renormalized; if all k pass, a bonus token is drawn from p_{k+1}. Every
# emitted token is then distributed exactly as the target alone would sample it (exercise 5.4
# is this rule). The two drafts, a smaller model with the same vocabulary and n-gram prompt
# lookup (what followed the last occurrence of the current n-gram), live in
# `minirl/runtime/drafts.py`: a draft only proposes.

# %%
# | export minirl/rollout/engine/speculative.py
"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

`accept_draft` keeps every emitted token distributed as the target alone would sample it
(Leviathan et al. 2023, Chen et al. 2023). The drafts: `minirl.runtime.drafts`. Simplified vs
vLLM: a fixed k, no tree of drafts; only pure decode steps speculate.
"""

import time

import torch
from torch import Tensor

from minirl.rollout.engine.attention import Chunk, make_step
from minirl.runtime.drafts import probabilities, sampling_logprobs


def accept_draft(p: Tensor, q: Tensor, draft: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The rejection-sampling rule of speculative decoding, for S sequences at once.

    p: [S, k+1, V] the target's probabilities at the k+1 verified positions; q: [S, k, V] the
    draft's probabilities it sampled d_1..d_k from; draft: [S, k] long, the proposed tokens.
    Draw u ~ U(0, 1) per draft token (from `generator`); d_i is accepted iff u_i < p_i(d_i) /
    q_i(d_i), and only while every earlier one was accepted. Returns (accepted [S] long in
    0..k, next_token [S] long): next_token is drawn from max(0, p_a - q_a) renormalized at the
    first rejected position a, or from p_{k+1} when all k are accepted.
    """
    # BEGIN SOLUTION
    S, k = draft.shape
    p_draft = p[:, :k].gather(2, draft[..., None]).squeeze(2)             # [S, k]
    q_draft = q.gather(2, draft[..., None]).squeeze(2)                    # [S, k]
    u = torch.rand(S, k, generator=generator, device=p.device)
    kept = u * q_draft < p_draft                                          # u < p/q, never / 0
    accepted = kept.long().cumprod(1).sum(1)                              # [S] the leading run
    rows = torch.arange(S, device=p.device)
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], 1)              # [S, k+1, V]
    residual = (p[rows, accepted] - q_padded[rows, accepted]).clamp(min=0)   # [S, V]
    next_token = torch.multinomial(residual / residual.sum(1, keepdim=True), 1,
                                   generator=generator).squeeze(1)
    return accepted, next_token
    # END SOLUTION

# %%
# | export minirl/rollout/engine/speculative.py
def speculative_step(engine, seqs, generator=None) -> None:
    """One round for decoding sequences: propose k, verify k + 1 positions in one pass."""
    k = engine.k
    clock = time.perf_counter()
    draft, q = engine.draft.propose(seqs, k, generator)                   # [S, k], [S, k, V]
    clock = engine.tick("draft", clock)
    drafts = draft.tolist()
    chunks = [Chunk([s.tokens[-1]] + d, s.num_computed, s.block_table, k + 1)
              for s, d in zip(seqs, drafts, strict=True)]
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step).view(len(seqs), k + 1, -1)                # [S, k+1, V]
    clock = engine.tick("forward", clock)
    temperatures = torch.tensor([s.temperature for s in seqs], device=logits.device)
    accepted, next_token = accept_draft(probabilities(logits, temperatures), q.to(logits.device),
                                        draft.to(logits.device), generator)
    logp = sampling_logprobs(logits, temperatures)                        # [S, k+1, V]
    clock = engine.tick("sample", clock)
    engine.stats.count_round(len(seqs), k, int(accepted.sum()))
    for i, (s, a, nxt) in enumerate(zip(seqs, accepted.tolist(), next_token.tolist(), strict=True)):
        tokens = drafts[i][:a] + [nxt]
        logprobs = logp[i, torch.arange(a + 1), torch.tensor(tokens)].tolist()
        s.num_computed += 1 + a
        engine.draft.rollback(s, len(s.tokens) + min(a, k - 1))
        engine.append(s, tokens, logprobs)
    engine.tick("postprocess", clock)

# %% [markdown]
# Does the rule keep the target's distribution? Bigram "models" p and q on 4 tokens, k = 3:
# the first three emitted tokens of 4,000 runs against the exact target probabilities (a
# chi-square test, three seeds). A correct rule's p-values are uniform; a wrong one's collapse.

# %%
from minirl.runtime.engine_measure import bigram_speculation, greedy_acceptance

pvalues = {}
for name, rule in (("accept_draft", accept_draft), ("keep if p >= q (wrong)", greedy_acceptance)):
    pvalues[name] = [bigram_speculation(rule, seed=seed) for seed in (1, 2, 3)]
    chi2 = ", ".join(f"{c:.0f}" for _, c in pvalues[name])
    print(f"{name:>22}: chi2 (63 degrees of freedom) {chi2}; p-values "
          + ", ".join(f"{p:.2g}" for p, _ in pvalues[name]))
assert all(p > 1e-4 for p, _ in pvalues["accept_draft"])
assert all(p < 1e-6 for p, _ in pvalues["keep if p >= q (wrong)"])

# %% [markdown]
# Two regimes. The GRPO case: the embedded policy and a draft 8× smaller (untrained in smoke
# mode), 16 prompts × G = 8 at temperature 1, and one sequence alone (the latency case). Then
# n-gram lookup at batch size 1 on the long-tail policy decoding greedily, which falls into a
# loop a lookup predicts: a stand-in for outputs that copy their context.

# %%
from minirl.models.policy import build_policy, build_tokenizer
from minirl.runtime.drafts import ModelDraft, NgramDraft
from minirl.runtime.engine_measure import (
    looping_prompt,
    speculative_speedup,
    speculative_sweep,
    step_seconds,
)
from minirl.runtime.workloads import DRAFT_POLICY, load_draft_policy

if SMOKE:                                # an untrained draft: warm-starting one takes half a minute
    draft_model = build_policy(DRAFT_POLICY, build_tokenizer()).eval()
else:
    draft_model = load_draft_policy()[0]
ks = [1, 3] if SMOKE else [1, 2, 3, 4]
grpo_ids = [policy_tok(r["prompt"], add_special_tokens=False)["input_ids"]
            for r in TASK.rows("train")[:2 if SMOKE else 16]]
workloads_ = {   # name: target, tokenizer, draft factory, requests, block size
    "GRPO batch": (policy, policy_tok, lambda: ModelDraft(draft_model),
                   [Request(x, 4, 1.0) for x in grpo_ids for _ in range(8)], 4),
    "batch 1": (policy, policy_tok, lambda: ModelDraft(draft_model),
                [Request(grpo_ids[0], 4, 1.0)], 4),
    "n-gram, batch 1": (big, big_tok, lambda: NgramDraft(3),
                        [Request(looping_prompt(big, big_tok, PROMPTS), 24 if SMOKE else 128,
                                 0.0)], 16),
}
spec = {name: speculative_sweep(model, tok, make, reqs, ks, repeats=1 if SMOKE else 3,
                                block_size=bs, progress=f"{name}, k = 0 (plain), {ks}")
        for name, (model, tok, make, reqs, bs) in workloads_.items()}
show([(name, k, pct(r["acceptance"][k]), f"{r['tokens_per_round'][k]:.2f}",
       f"{r['speedup'][k]:.2f}x") for name, r in spec.items() for k in ks],
     ("workload", "k", "acceptance", "tokens per verification", "speedup (tokens/s)"))

# %% [markdown]
# Why, in target decode steps: a round costs k draft steps of cost c and one verification of
# cost v, and yields the tokens per verification above. We measure c and v here; on a GPU a
# large target's step is memory-bound (v ≈ 1) and a draft 10–50× smaller costs c ≈ 0.05.

# %%
k_show, rows_n = ks[-1], len(workloads_["GRPO batch"][3])
target_1 = step_seconds(policy, 1, 1, 8, block_size=4)
target_n = step_seconds(policy, rows_n, 1, 8, block_size=4)
c_cpu = step_seconds(draft_model, 1, 1, 8, block_size=4) / target_1
v_cpu = step_seconds(policy, 1, k_show + 1, 8, block_size=4) / target_1
c_batch = step_seconds(draft_model, rows_n, 1, 8, block_size=4) / target_n
v_batch = step_seconds(policy, rows_n, k_show + 1, 8, block_size=4) / target_n
r1, rb, ngram = spec["batch 1"], spec["GRPO batch"], spec["n-gram, batch 1"]
v_big = step_seconds(big, 1, k_show + 1, 128) / step_seconds(big, 1, 1, 128)
show([(label, f"{c:.2f}", f"{v:.2f}",
       f"{speculative_speedup(r['tokens_per_round'][k_show], k_show, c, v):.2f}x", measured)
      for label, c, v, r, measured in (
          ("this CPU, 1 row", c_cpu, v_cpu, r1, f"{r1['speedup'][k_show]:.2f}x"),
          (f"this CPU, {rows_n} rows", c_batch, v_batch, rb, f"{rb['speedup'][k_show]:.2f}x"),
          ("n-gram, 1 row (free draft)", 0.0, v_big, ngram, f"{ngram['speedup'][k_show]:.2f}x"),
          ("GPU regime (assumed), 1 row", 0.05, 1.0, r1, "-"))],
     ("costs", "draft step c", f"verify {k_show + 1} tokens v", f"model speedup, k={k_show}",
      "measured"))
model_best = max(max(rb["speedup"].values()), max(r1["speedup"].values()))
ngram_best = max(ngram["speedup"].values())
show([("speculation, model draft", "2-3x", f"{model_best:.2f}x",
       "agree" if 2 <= model_best <= 3 else "differ",
       f"<= 4-token answers; a draft step costs c = {c_cpu:.2f} target steps (~0.05 on a GPU)"),
      ("speculation, n-gram lookup", "2-3x", f"{ngram_best:.2f}x",
       "agree" if 2 <= ngram_best <= 3 else "differ",
       f"one sequence in a loop; a free draft, accepted {pct(max(ngram['acceptance'].values()))}")],
     ("quantity", "source", "minirl (best k)", "agree?", "why"))

# %% [markdown]
# Answers of at most 4 tokens leave a verification little to gain, and on a CPU a step grows
# with its work, so v is above one; a free, right draft at batch 1 gains tokens per
# verification / v. Speculation pays when a step is memory-bound and the draft cheap and often
# right: short, latency-sensitive responses, not large RL batches.
#
# ## 10. Faster than HF generate, and where the time goes
#
# The engine against HF `generate`, called alternately on the same workload. HF computes all
# B × G rows until the longest completion ends and prefills each prompt G times; the engine
# drops a sequence at its EOS and prefills each prompt's full blocks once.
# (`python benchmarks/engine_vs_hf.py` runs the full workload with repeats.)

# %%
vs = versus_hf(big, big_tok, PROMPTS[:2 if SMOKE else 8], sampling, block_size=16, repeats=1)
c = vs["paged_counts"]
show([(k, f"{vs['tokens_per_s'][k]:.0f}", f"{statistics.median(vs['seconds'][k]):.2f}",
       f"{statistics.median(vs['tokens'][k]):.0f}") for k in ("paged", "hf")],
     ("engine", "tokens/s", "seconds to finish the batch", "tokens generated"))
print(f"speedup: {vs['speedup']:.2f}x in tokens/s, {vs['finish_speedup']:.2f}x in time to finish.\n"
      f"HF prefilled {vs['hf_prefill_tokens']} prompt tokens and decoded "
      f"{vs['hf_rows_x_steps']:.0f} row-steps;\nthe engine prefilled {c['prefill_tokens']:.0f} "
      f"({c['cached_tokens']:.0f} found in its cache) and decoded {c['decode_tokens']:.0f} tokens "
      f"in {c['steps']:.0f} steps")
phases = vs["paged_phase_seconds"]
total = sum(phases.values())
show([(p, f"{s:.3f}", pct(s / total)) for p, s in phases.items() if s > 0],
     ("engine phase", "seconds", "share"))

# %% [markdown]
# The advantage is work not done (finished rows, repeated prefills); it grows with the tail of
# lengths and with G.
#
# How close to the machine is a decode step? Its **roofline** time is the least the hardware
# needs: every weight and cached key and value read once at the copy bandwidth, or every
# multiply-add done at the matrix-product peak, whichever takes longer.

# %%
from minirl.runtime.engine_measure import decode_roofline, machine_limits

limits = machine_limits(trial=0.02 if SMOKE else 0.25)
roof = decode_roofline(big, rows=32, context=160, limits=limits, repeats=5 if SMOKE else 15)
threads = f"{limits['threads']} thread{'s' * (limits['threads'] > 1)}"
print(f"this machine at {threads} (wall clock, best of 3 trials): float32 products "
      f"{limits['matmul_flops'] / 1e9:.0f} GFLOP/s, copies {limits['copy_bytes'] / 1e9:.1f} GB/s")
print(f"one decode step, 32 rows x 160 tokens: {roof['flops'] / 1e6:.0f} MFLOP, "
      f"{(roof['weight_bytes'] + roof['kv_bytes']) / 1e6:.1f} MB;\nideal "
      f"{1e3 * roof['ideal_s']:.2f} ms ({roof['bound']}-bound), measured "
      f"{1e3 * roof['measured_s']:.2f} ms: {pct(roof['share'])} of the machine")
assert 0 < roof["share"] and roof["ideal_s"] == max(roof["memory_s"], roof["compute_s"])

# %% [markdown]
# Matrix products of 32 rows run below the peak of a large product; every weight and cached key
# streams from memory at each step, not all of it while arithmetic runs; and Python still builds
# the step and queues its kernels before they run (the queue takes Python out from between the
# kernels, not out of the step). `benchmarks/engine_vs_hf.py` breaks the step down by kind of
# work and measures the share at one thread by CPU time, each step right after HF's (which has
# pushed the engine's weights out of the caches): not the same figure as this one, measured
# step after step, as the engine runs; `benchmarks/decode_step.py` measures the step against
# HF's at equal rows.
#
# ## 11. In the loop
#
# Registered as "paged", the engine serves notebook 01's loop (`--rollout-engine paged`). The
# weight sync calls `load_weights` after every update, which also empties the prefix cache:
# keys and values computed by old weights must never be reused.

# %%
from minirl.config import RLConfig
from minirl.rollout.base import RolloutEngine
from minirl.rollout.registry import ENGINES, build_engine, register_engine


# %%
# | export minirl/rollout/registry.py
@register_engine("paged")
def build_paged(config: RLConfig, model, tokenizer, device, **options):
    """Notebook 05's engine: paged KV cache, continuous batching, prefix caching; no options."""
    from minirl.rollout.engine.engine import PagedEngine  # noqa: PLC0415 (loads when built)
    return PagedEngine(model, tokenizer, config.engine_dtype, device=device)


# %%
print("engines:", ", ".join(ENGINES))
config = RLConfig.from_flat(rollout_engine="paged", num_generations=4)
engine = build_engine(config, policy, policy_tok)
rollout = engine.generate([format_prompt(p) for p in TASK.test[:2]],
                          SamplingConfig(num_generations=4), expected_version=0,
                          generator=torch.Generator().manual_seed(0))
print(type(engine).__name__, isinstance(engine, RolloutEngine), rollout.completions)
engine.load_weights(policy.state_dict().items(), version=1)
assert engine.version == 1 and isinstance(engine, RolloutEngine)

# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/05_generation_speed.py`. Fill them in, then grade:
#
# ```
# python -m minirl.grade --only 05
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 5.1 | `grow_table` | blocks taken on demand: exactly ceil(tokens / block_size), never one too many |
# | 5.2 | `can_admit` | a free slot, enough free blocks, the token budget, and the empty-step exception |
# | 5.3 | `match_prefix` | chained hashes, whole blocks, the last token always computed, collisions caught |
# | 5.4 | `accept_draft` | the output distribution equals the target's (a chi-square test), the bonus token after k kept drafts follows p_{k+1}, acceptance counted as a leading run |
#
# Questions to think about (not graded): why does preemption pick the most recently
# admitted sequence? What would it take to share a partly filled last block (copy-on-write)?
# Why does speculation help a single user's latency more than a large batch's throughput?
