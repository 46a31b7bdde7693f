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
# go, and build, in plain PyTorch, the five ideas that production engines use to spend less
# of both: a **paged KV cache** (vLLM's PagedAttention), **continuous batching**, **prefix
# caching**, a **radix-tree cache** (SGLang's RadixAttention) and **speculative decoding**.
# Together they make `PagedEngine`, a rollout engine of about 2,000 lines (1,250 without
# docstrings and comments) behind the same protocol as notebook 01's engines: the training
# loop can use it with one flag.
#
# Generation is a large share of an RL step (most of it when completions are long): every step samples B × G completions token by token,
# and each token is a forward pass. The source summarizes the answers in one table:
#
# | technique | problem | principle | typical benefit |
# |---|---|---|---|
# | PagedAttention | contiguous KV allocation fragments memory: 50–70 % utilization | fixed-size blocks allocated on demand | 95 %+ utilization, 2–4× larger batches |
# | continuous batching | static batches wait for their slowest sequence | admit a new sequence as soon as one ends | 5–10× throughput |
# | speculative decoding | decoding has low compute density | a small draft proposes, the large model verifies in parallel | 2–3× |
# | prefix caching | G responses to one prompt recompute the prefix | hash and reuse the prompt's KV cache | 70–80 % of prefix compute saved at G = 8 |
#
# vLLM cannot run on a laptop's CPU, so we build each row ourselves, check that it computes
# exactly what HF `generate` computes, and measure each claim on two policies: the embedded
# arithmetic policy of notebook 00 and a larger one whose completions have a long tail of
# lengths. Where a CPU and a tiny model give another figure than a GPU, we say why in numbers.
# Anchor for size and readability: nano-vllm (about 1,200 lines), which we read but do not copy.

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import os
import statistics
import time

import matplotlib.pyplot as plt
import torch

from minirl.runtime.notebook import add_to_class  # a method added to a class defined in an earlier cell

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
torch.set_num_threads(1)                       # small matrices: one thread is steadier on a shared machine
torch.manual_seed(0)


def show(rows, header):
    """Print a small aligned table (a list of tuples under a header tuple)."""
    rows = [tuple(str(c) for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for j, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("-+-".join("-" * w for w in widths))


def pct(x):
    return f"{100 * x:.1f} %"


# %% [markdown]
# ## 0. Two policies to measure on
#
# The embedded policy (notebook 00, about 1 M parameters) answers two-digit sums in at most
# 4 tokens: the stage-1 GRPO batch. Its completions are too short for most of this
# notebook's questions, so we add a larger policy with a long tail of completion lengths,
# as RL batches have: most completions stop early, a few run long. It has random weights, on
# purpose: with near-uniform logits over a 70-token vocabulary, each step emits EOS with a
# probability of a few percent, so lengths are roughly geometric, and the tail comes from the
# model itself (HF `generate`, TRL and our engine all see EOS the same way). Training it to
# write text would not change what a token costs.

# %%
from minirl.models.policy import load_default_policy
from minirl.rollout.engine.workloads import (  # code: appendix
    LongTailConfig,
    build_long_tail_policy,
    few_shot_prompts,
    load_long_tail_policy,
)

policy, policy_tok, _ = load_default_policy(progress=False)
big, big_tok, big_path = load_long_tail_policy()
for name, model in (("embedded", policy), ("long-tail", big)):
    c = model.config
    print(f"{name:>9}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"{c.num_hidden_layers} layers, {c.num_attention_heads} query heads / {c.num_key_value_heads} key-value "
          f"heads of {c.hidden_size // c.num_attention_heads}, vocabulary {c.vocab_size}, "
          f"context {c.max_position_embeddings}")
PROMPTS = few_shot_prompts(4 if SMOKE else 16, length=64)
B, G, MAX_NEW = len(PROMPTS), 4 if SMOKE else 8, 48 if SMOKE else 256
print(f"\nlong-tail workload: {B} prompts x G={G}, at most {MAX_NEW} new tokens; a prompt: {PROMPTS[0]!r} "
      f"({len(big_tok(PROMPTS[0], add_special_tokens=False)['input_ids'])} tokens)")

# %% [markdown]
# The result first: the finished engine, as the package ships it, against HF `generate` on two
# of these prompts (same model, G and length limit; one call each, so a noisy figure).
# Sections 1 to 9 open it piece by piece; section 10 repeats this comparison with repeats.

# %%
from minirl.config import SamplingConfig
from minirl.rollout.engine.measure import versus_hf

first = versus_hf(big, big_tok, PROMPTS[:2], SamplingConfig(num_generations=G, max_completion_length=MAX_NEW),
                  repeats=1)
print(f"PagedEngine {first['tokens_per_s']['paged']:.0f} tokens/s, HF generate {first['tokens_per_s']['hf']:.0f}: "
      f"{first['speedup']:.2f}x in tokens/s, {first['finish_speedup']:.2f}x in time to finish the batch "
      f"({'faster' if first['finish_speedup'] > 1 else 'not faster'} here); prompt tokens prefilled: "
      f"{first['paged_counts']['prefill_tokens']:.0f} vs HF's {first['hf_prefill_tokens']}")

# %% [markdown]
# ## 1. Where generation's memory goes: the KV cache, and blocks
#
# Decoding one token attends to every earlier token of its sequence, so an engine keeps
# each token's keys and values for every layer: 2 × layers × key-value heads × head size
# numbers per token. Grouped-query attention (several query heads sharing one key-value
# head) is there to shrink this. For a sequence of L tokens the cache holds L such entries,
# and it is only known how long L gets when the sequence ends.

# %%
def kv_bytes_per_token(config, bytes_per_number: int) -> int:
    """Bytes of keys and values one token holds in the cache, over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * bytes_per_number


from transformers import Qwen2Config

qwen7b = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
rows = [("embedded (fp32)", kv_bytes_per_token(policy.config, 4)),
        ("long-tail (fp32)", kv_bytes_per_token(big.config, 4)),
        ("Qwen2.5-7B shape (bf16)", kv_bytes_per_token(qwen7b, 2))]
show([(n, f"{b:,} B", f"{b * 4096 / 2**20:,.1f} MiB") for n, b in rows],
     ("model", "KV per token", "one 4k-token sequence"))

# %% [markdown]
# The simplest allocation reserves, for every sequence, a contiguous slab for its maximum
# length (prompt + `max_tokens`) when it starts: HF's static cache, FasterTransformer and
# early servers do this. Most sequences end long before, and the rest of their slab sits
# empty until they do. PagedAttention allocates like an operating system's virtual memory
# instead: the cache is a pool of fixed-size **blocks** (16 tokens is vLLM's default); a
# sequence owns a **block table** listing its blocks in order and takes a new block only
# when its last one is full. It never holds more than `block_size - 1` empty slots.
#
# The pool below keeps a **free list** and a **reference count** per block (a block can be
# shared, section 7). Exercise 5.1 is `grow_table`, the on-demand rule.

# %%
# | export minirl/rollout/engine/blocks.py
"""Paged KV memory: fixed-size blocks, a free list, reference counts and content hashes.

The KV cache is cut into `num_blocks` blocks of `block_size` token slots each. A sequence
owns a block table (a list of block ids) and gets a new block only when its last one is
full, so it never holds more than block_size - 1 empty slots (vLLM's PagedAttention). A
block shared by several sequences (the G completions of one prompt) has a reference count;
it goes back to the free list when the count drops to 0.

Free blocks keep their content and their hash until they are handed out again, and the free
list hands out the block freed longest ago first: a block that a prefix cache still knows
survives as long as the memory allows (least recently used is reused first).

Simplified vs vLLM: one pool on one device, no swapping to CPU memory, no copy-on-write of a
partly filled shared block (only full blocks are shared).
"""

from collections import OrderedDict
from typing import Callable


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
# the block before it, so two equal hashes stand for two equal prefixes (section 7 shares blocks
# this way). Then the pool: a reference count per block and a free list, least recently freed first.

# %%
# | export minirl/rollout/engine/blocks.py
def block_hash(parent: int | None, tokens) -> int:
    """The hash of one full block: its tokens, chained with the hash of the block before it.

    Chaining makes a block's hash stand for the whole prefix up to its end, so two sequences
    share block i only if they agree on every token up to the end of block i. Python's hash
    of a tuple of ints is deterministic across runs (only str/bytes hashes are salted).
    """
    return hash((parent, *tokens))


class BlockPool:
    """num_blocks blocks, each with a reference count; the free ones in least-recently-freed order.

    allocate() hands out the free block freed longest ago (ref count 1); retain(b) adds a
    holder (taking b off the free list if it was free: a cache hit on a freed block);
    release(b) drops one and frees b at 0. Callbacks in `on_reuse` hear about a free block
    being handed out again, so that a cache forgets the content it is about to lose.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse: list[Callable[[int], None]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A free block with reference count 1; RuntimeError if none is free (the scheduler checks first)."""
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
            del self.free[block]                         # a freed block brought back: its content is intact
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at 0 the block joins the free list (content kept until reused)."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"BlockPool.release({block}): the block is already free (double free)")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

# %% [markdown]
# Two more methods: `grow` enlarges the pool when the engine's cache grows (the new blocks are
# handed out first, so freed ones keep their content longer), and `check` asserts the invariant
# everything else relies on: the free list is exactly the blocks nobody holds.

# %%
# | export minirl/rollout/engine/blocks.py
@add_to_class(BlockPool)
def grow(self, num_blocks: int) -> None:
    """Add blocks up to `num_blocks` in all; the new ones are handed out before any freed one."""
    new = range(self.num_blocks, num_blocks)
    self.ref += [0] * len(new)
    self.free = OrderedDict.fromkeys([*new, *self.free])   # freed blocks keep their content longer
    self.num_blocks = max(self.num_blocks, num_blocks)


@add_to_class(BlockPool)
def check(self) -> None:
    """Raise AssertionError unless the free list is exactly the blocks with reference count 0."""
    zero = {b for b, r in enumerate(self.ref) if r == 0}
    assert zero == set(self.free), f"free list {sorted(self.free)[:8]} != blocks with ref 0 {sorted(zero)[:8]}"
    assert all(r >= 0 for r in self.ref), "a negative reference count"

# %% [markdown]
# Three sequences of 5, 9 and 3 tokens in a pool of 12 blocks of 4 slots, then the first
# one grows by 4 tokens and the second one ends. Each colour is a sequence; white blocks are
# free. The blocks of a sequence need not be adjacent: the table is the only thing that
# says where its tokens are.

# %%
def draw_blocks(ax, pool, tables, title, per_row=12):
    """The pool as a row of cells, coloured by owner; shared blocks show their reference count."""
    owner = {}
    for name, table in tables.items():
        for b in table:
            owner.setdefault(b, []).append(name)
    colours = dict(zip(tables, plt.cm.tab10.colors, strict=False))   # the first len(tables) of 10
    for b in range(pool.num_blocks):
        r, c = divmod(b, per_row)
        names = owner.get(b, [])
        face = "white" if not names else (colours[names[0]] if len(names) == 1 else "lightgrey")
        ax.add_patch(plt.Rectangle((c, -r), 0.95, 0.9, facecolor=face, edgecolor="black"))
        label = f"{b}" if not names else (f"{b}\n{names[0]}" if len(names) == 1 else f"{b}\nref {pool.ref[b]}")
        ax.text(c + 0.47, -r + 0.45, label, ha="center", va="center", fontsize=7)
    rows_ = -(-pool.num_blocks // per_row)
    ax.set_xlim(0, per_row)
    ax.set_ylim(-rows_ + 0.9, 1)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


pool = BlockPool(num_blocks=12, block_size=4)
tables = {"A": [], "B": [], "C": []}
for name, length in (("A", 5), ("B", 9), ("C", 3)):
    grow_table(tables[name], length, 4, pool.allocate)
fig, axes = plt.subplots(2, 1, figsize=(8, 2.6))
draw_blocks(axes[0], pool, tables, f"tables {tables}; free {list(pool.free)}")
grow_table(tables["A"], 9, 4, pool.allocate)               # A grows to 9 tokens: one more block
for b in tables.pop("B"):                                  # B ends: its blocks go back to the free list
    pool.release(b)
draw_blocks(axes[1], pool, tables, f"A grew to 9 tokens, B ended: tables {tables}; free {list(pool.free)}")
plt.tight_layout()
plt.show()
pool.check()
assert pool.num_used == sum(len(t) for t in tables.values())

# %% [markdown]
# ## 2. Attention through block tables
#
# An engine step flattens the work of many sequences into one list of new tokens: whole
# prompts, prompt tails, single decode tokens. Each token has a position in its own
# sequence and a **slot** in the cache, `block_table[position // block_size] * block_size
# + position % block_size`. Every layer first writes the step's keys and values into their
# slots, then lets each query read its own sequence's keys and values back through the
# block table.
#
# How the read is done is where speed is won or lost. vLLM reads the blocks in place,
# inside its attention kernel. Plain PyTorch has no attention kernel that takes a block
# table, so there are two ways (both below):
#
# - **gather**: copy the sequence's blocks into a padded tensor (`index_select`) and call
#   `scaled_dot_product_attention` with a mask. Every layer copies every sequence's keys and
#   values once more, and then attention reads the copy. For a chunk of many queries (a
#   prompt) the copy is shared by all of them and costs little; for one query per sequence
#   (a decode step) it triples the bytes attention moves.
# - **in place**: `F.embedding_bag` is a gather fused with a weighted sum, `out[b] =
#   Σ_j w[b, j] · E[i[b, j]]`, reading the rows `E[i]` where they lie. With `E` the cache's
#   value rows, `i` a sequence's slots and `w` its attention probabilities, one bag is one
#   query's attention output. The scores `q · k` are a weighted sum too, over the head
#   dimension: store each block's keys transposed (`[head_dim, block_size]`, as vLLM's
#   kernel also lays keys out for its reads), and bag `(sequence, head, block)` sums the
#   block's rows `k[:, d]` with weights `q[d]`, which gives the block's `block_size` scores.
#   Nothing is copied; the indices are built once per step from the block tables and serve
#   every layer.
#
# Everything else in the model comes from the HF module: embeddings, RMSNorm weights, the
# rotary frequencies, the projection weights, the activation. The forward pass is the
# engine's own (as every vLLM model is): the q/k/v projections run as one matrix product and
# gate/up as another, and on an x86 CPU their weights are prepacked once for oneDNN, as vLLM's
# CPU backend does. So the engine runs the embedded policy, the long-tail policy, or any
# Llama/Qwen2 checkpoint.

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# A step groups its chunks for attention (`Group`: sequences padded to one query width) and
# flattens all of them into one `Step`, the tensors every layer of the forward pass reads.

# %%
# | export minirl/rollout/engine/attention.py
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

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The two reads, for one group. The cache of one layer is `keys` `[Hkv, num_blocks,
# head_dim, block_size]` (transposed within each block) and `values` `[Hkv, num_blocks,
# block_size, head_dim]`. `gather_attention` copies the group's blocks and calls SDPA;
# `decode_attention` reads them in place through `Rows`, the block tables turned into row
# indices of the two caches once per step. Grouped-query attention costs no copy in either:
# the n_rep query heads that share a key head are stacked along the query axis (gather) or
# index the same key head's rows (in place).

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The in-place read. `decode_rows` turns a decode group's block tables into the row indices of
# both caches once per step, for every layer; `decode_attention` is then two embedding bags
# around a softmax. `rotate`, the rotary embedding applied to queries and keys, comes last.

# %%
# | export minirl/rollout/engine/attention.py
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

# %%
# | export minirl/rollout/engine/attention.py
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

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The model itself: `PagedModel` keeps the HF module's weights and parameter names, builds the
# fused products from them, owns the cache tensor, and runs a `Step` through every layer.

# %%
# | export minirl/rollout/engine/attention.py
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

# %% [markdown]
# The forward pass of one `Step`: embeddings and rotary angles once, the decode groups' rows and
# the other groups' masks once for every layer; then, per layer, the fused q/k/v product, the new
# keys and values written into their slots, the two reads, and the MLP.

# %%
# | export minirl/rollout/engine/attention.py
@add_to_class(PagedModel)
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

# %% [markdown]
# The test that matters: the logits a paged forward pass computes equal HF's. Three
# prompts are prefilled through block tables of 8-token blocks (chunks: the gathered read),
# then each decodes its last token against the cache (the in-place read), and the
# next-token logits are compared with one plain HF forward pass per prompt. Then the two
# reads are compared with each other on the decode step's queries.

# %%
with torch.no_grad():
    for name, model, tok in (("embedded", policy, policy_tok), ("long-tail", big, big_tok)):
        texts = few_shot_prompts(3, length=20 if name == "embedded" else 60)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        paged = PagedModel(model)
        paged.allocate_cache(30, 8)
        tables_ = [list(range(10 * i, 10 * i + 10)) for i in range(3)]
        paged(make_step([Chunk(x[:-1], 0, t) for x, t in zip(ids, tables_, strict=True)], 8, paged.n_rep, "cpu"))
        decode = make_step([Chunk(x[-1:], len(x) - 1, t) for x, t in zip(ids, tables_, strict=True)], 8, paged.n_rep, "cpu")
        got = paged(decode)
        want = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
        diff = (got - want).abs().max().item()
        keys, values = paged.cache_views(0)
        reads = 0.0
        for g in decode.groups:                          # the same queries, read both ways
            q = torch.randn(g.stop - g.start, paged.num_heads, paged.head_dim)
            bias = torch.zeros(g.mask.shape).masked_fill_(~g.mask, float("-inf"))
            rows = decode_rows(g, paged.num_heads, paged.n_rep, 30, paged.head_dim, 8)
            gap = decode_attention(q, keys, values, rows, 0.125) - gather_attention(q, keys, values, g, bias, 0.125)
            reads = max(reads, gap.abs().max().item())
        print(f"{name:>9}: max |paged - HF| over {want.numel()} logits = {diff:.2e}; "
              f"in place vs gathered read: {reads:.1e}")
        assert diff < 1e-4 and reads < 1e-5

# %% [markdown]
# ## 3. The scheduler: continuous batching
#
# A static batcher takes a batch of sequences, runs it until the longest one ends, and only
# then takes the next batch; a sequence that ended early keeps its row, computed as padding
# (that is what HF `generate` does with the B × G rows of a GRPO batch). Continuous batching
# (Orca, vLLM) decides anew at every step: a sequence leaves the batch at its EOS and a
# waiting one takes its slot in the next step. Each step of our scheduler:
#
# 1. gives every running sequence one decode token, and a new block if its last is full; if
#    no block is free, it **preempts** the most recently admitted sequence: frees its
#    blocks and puts it back at the front of the queue, to recompute its tokens later
#    (vLLM's default, cheaper than swapping to CPU memory for short sequences);
# 2. **admits** waiting sequences, first come first served, while the admission rule allows
#    (exercise 5.2): a free batch slot, enough free blocks for the tokens it must hold, and
#    room in the step's token budget for the tokens it must compute. Their prefills run in the
#    same forward pass as the decodes (mixed prefill and decode, as vLLM V1 and SGLang do).

# %%
# | export minirl/rollout/engine/scheduler.py
"""Continuous batching: which sequences run in the next step, and with which blocks.

Every step the scheduler (1) gives each running sequence one decode token, and a new block
when its last one is full, preempting the most recently admitted sequences when no block is
left (their blocks are freed; they go back to the front of the queue and recompute their
tokens later); then (2) admits waiting sequences, first come first served, while a batch
slot, enough free blocks and the step's token budget allow (`can_admit`). Prefills of the
newly admitted and decode tokens of the running sequences run in the same forward pass.
A sequence leaves at its EOS or its token limit and frees its blocks at once, so a
waiting one can take its place in the very next step: that is continuous batching.

`policy="static"` is the baseline: a batch is admitted only when the previous one has
completely finished, and a finished sequence keeps its row (it is computed as padding)
until the longest one of its batch ends, as HF `generate` and other fixed-shape batchers do.
`reserve="max_length"` allocates blocks for prompt + max_tokens at admission, the
contiguous preallocation paged attention replaces.

Simplified vs vLLM: no chunked prefill (a prompt longer than the token budget runs alone in
its step), no priorities, no swapping preempted blocks to CPU memory (recompute only).
"""

from collections import deque
from dataclasses import dataclass, field

from minirl.rollout.engine.blocks import BlockPool, blocks_needed, grow_table

# %% [markdown]
# A `Sequence` is one completion as the scheduler sees it: its tokens, its block table, how
# many of its tokens are already in the cache, and its status (waiting, running, finished).

# %%
# | export minirl/rollout/engine/scheduler.py
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One completion being generated: the prompt, the tokens so far, and where its KV lives.

    Compared by identity (eq=False): the scheduler looks sequences up in its lists every step,
    and a field-by-field comparison of token lists would cost more than the lookup.
    """

    id: int
    tokens: list[int]              # prompt + generated tokens
    prompt_len: int
    max_tokens: int                # generated tokens at most
    temperature: float = 1.0       # 0: greedy
    eos_token_id: int | None = None
    logprobs: list[float] = field(default_factory=list)   # behaviour log-prob of each generated token
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose keys/values are in the cache
    num_cached: int = 0            # of the prompt, tokens found in the prefix cache (last admission)
    num_preempted: int = 0
    status: str = WAITING
    spans: list[list[int]] = field(default_factory=list)   # [first step, last step] of each stay in the batch
    finish_reason: str | None = None   # "eos", "length" or "error"
    error: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_new(self) -> int:
        """Tokens to compute in the next step: all not yet cached; a padding row of a static batch: 1."""
        return 1 if self.status == FINISHED else len(self.tokens) - self.num_computed



# %% [markdown]
# The state the scheduler works on: the waiting queue, the running batch and the pool's
# blocks, with the moves that need no decision: queue a sequence, take a block (evicting a
# cached one if the pool is empty), release a sequence's blocks, finish a sequence.

# %%
# | export minirl/rollout/engine/scheduler.py

class SchedulerState:
    """Waiting queue, running batch, blocks: what the scheduler moves from step to step, and the moves
    that need no decision (queue, take a block, release, finish); `Scheduler` decides each step's work.

    cache: a prefix cache (`PrefixCache` or `RadixCache`) or None. `timeline` records, per
    step, how many sequences ran, were admitted and were preempted, and the blocks in use.
    """

    def __init__(self, pool: BlockPool, cache=None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 policy: str = "continuous", reserve: str = "on_demand", lookahead: int = 0):
        if policy not in ("continuous", "static"):
            raise ValueError(f"Scheduler: policy={policy!r}; use 'continuous' or 'static'")
        if reserve not in ("on_demand", "max_length"):
            raise ValueError(f"Scheduler: reserve={reserve!r}; use 'on_demand' (paged) or 'max_length' (contiguous)")
        self.pool, self.cache = pool, cache
        self.block_size = pool.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.policy, self.reserve, self.lookahead = policy, reserve, lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.timeline: list[dict] = []
        self.on_release: list = []                   # callbacks(seq): a draft model frees its own blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_blocks(self) -> int:
        """Blocks the scheduler may take: free ones, plus those a cache would give back on request."""
        return self.pool.num_free + (self.cache.evictable() if self.cache is not None else 0)

    def take_block(self) -> int:
        if self.pool.num_free == 0 and self.cache is not None:
            self.cache.evict(1)
        return self.pool.allocate()

    def tokens_to_hold(self, seq: Sequence) -> int:
        """Token slots the sequence needs in the next step: what it will have computed (+ lookahead)."""
        if self.reserve == "max_length":
            return max(seq.prompt_len + seq.max_tokens, seq.num_computed + seq.num_new) + self.lookahead
        return seq.num_computed + seq.num_new + self.lookahead

# %% [markdown]
# Releasing and finishing. A sequence's blocks go back to the pool last block first, so the pool
# reuses them before the prompt blocks a prefix cache may still find; under the static policy a
# finished sequence keeps its row (and its blocks) until its whole batch is done.

# %%
# | export minirl/rollout/engine/scheduler.py
@add_to_class(SchedulerState)
def release(self, seq: Sequence) -> None:
    for b in reversed(seq.block_table):          # last blocks first: they are evicted first
        self.pool.release(b)
    seq.block_table = []
    seq.num_computed = 0
    for callback in self.on_release:
        callback(seq)


@add_to_class(SchedulerState)
def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
    """`seq` is done; continuous: its slot and blocks are free now; static: when its batch is done."""
    seq.status, seq.finish_reason, seq.error = FINISHED, reason, error
    if seq.spans:
        seq.spans[-1][1] = len(self.timeline) - 1
    if self.policy == "static" and seq in self.running and any(s.status == RUNNING for s in self.running):
        return                                   # it stays as a padding row of its batch
    if self.policy == "static":
        for s in [s for s in self.running if s.status == FINISHED]:
            self.running.remove(s)
            self.release(s)
        return
    if seq in self.running:
        self.running.remove(seq)
    elif seq in self.waiting:
        self.waiting.remove(seq)
    self.release(seq)

# %% [markdown]
# Then the decisions, starting with the admission rule (exercise 5.2): may a waiting sequence
# join the next step, given the free slots, the free blocks and the step's token budget?

# %%
# | export minirl/rollout/engine/scheduler.py
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

# %% [markdown]
# `Scheduler` adds the decisions to that state. `schedule` builds one step's work: decodes
# first, preempting when blocks run out, then admissions in order while `can_admit` allows.

# %%
# | export minirl/rollout/engine/scheduler.py
class Scheduler(SchedulerState):
    """Decides each step's work (see the module docstring): decodes first, preempting the most
    recently admitted sequence when blocks run out, then admissions while `can_admit` allows."""

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (sequence, number of new tokens to compute) pairs, decodes first."""
        work, preempted = [], 0
        budget = self.max_num_batched_tokens
        for seq in list(self.running):                                    # 1. one decode token each
            if seq not in self.running:                                   # preempted for an earlier one
                continue
            wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(seq.block_table)
            while wanted > self.free_blocks() and seq in self.running:
                self.preempt(self.running[-1])                            # the most recently admitted
                preempted += 1
            if seq in self.running:
                grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
                work.append((seq, seq.num_new))
                budget -= seq.num_new
        admitted = 0
        static = self.policy == "static"
        batch_running = static and len(self.running) > 0          # static: the next batch waits for this one
        while self.waiting and not preempted and not batch_running:       # 2. admissions, in order
            seq = self.waiting[0]
            # a static batch is prefilled whole in one step, as HF generate does
            if not self.admit(seq, float("inf") if static else budget, step_is_empty=not work):
                break
            self.waiting.popleft()
            self.running.append(seq)
            work.append((seq, seq.num_new))
            budget -= seq.num_new
            admitted += 1
            self.register(seq)                        # its siblings, admitted next, can share its blocks now
        for seq, _ in work[:len(work) - admitted]:
            self.register(seq)
        self.timeline.append({"running": len(work), "admitted": admitted, "preempted": preempted,
                              "waiting": len(self.waiting), "blocks_used": self.pool.num_used,
                              "tokens": sum(n for _, n in work),
                              "held": sum(s.num_computed + n for s, n in work),          # KV slots filled after it
                              "reserved_max": sum(s.prompt_len + s.max_tokens for s, _ in work)})
        return work

# %% [markdown]
# The moves `schedule` makes: `register` tells the cache about blocks as they fill, `admit`
# counts the blocks a prefix hit lets a sequence share before it asks `can_admit`, and `preempt`
# frees a running sequence's blocks and puts it back at the front of the queue.

# %%
# | export minirl/rollout/engine/scheduler.py
@add_to_class(Scheduler)
def register(self, seq: Sequence) -> None:
    """Tell the cache about the blocks `seq` fills in this step (only when a block becomes full)."""
    done = seq.num_computed + seq.num_new
    if self.cache is not None and seq.status == RUNNING and done // self.block_size > seq.num_computed // \
            self.block_size:
        self.cache.insert(seq.tokens[:done], seq.block_table)


@add_to_class(Scheduler)
def admit(self, seq: Sequence, budget: int, step_is_empty: bool) -> bool:
    """Give `seq` its blocks (cached ones shared, the rest new) if `can_admit` says it fits."""
    cached = self.cache.match(seq.tokens) if self.cache is not None else []
    # a cached block still in use by another sequence costs nothing; a free (or evictable) one is taken
    evictable = self.cache.evictable_blocks() if cached else set()
    taken = sum(1 for b in cached if self.pool.ref[b] == 0 or b in evictable)
    wanted = blocks_needed(self.tokens_to_hold(seq), self.block_size) - len(cached) + taken
    new_tokens = len(seq.tokens) - len(cached) * self.block_size
    if not can_admit(len(self.running), self.max_num_seqs, wanted, self.free_blocks(), new_tokens, budget,
                     step_is_empty):
        return False
    for b in cached:
        self.pool.retain(b)
    seq.block_table = list(cached)
    grow_table(seq.block_table, self.tokens_to_hold(seq), self.block_size, self.take_block)
    seq.num_computed = seq.num_cached = len(cached) * self.block_size
    seq.status = RUNNING
    seq.spans.append([len(self.timeline), len(self.timeline)])
    return True


@add_to_class(Scheduler)
def preempt(self, seq: Sequence) -> None:
    """Free the blocks of `seq` and requeue it at the front; it recomputes its tokens when readmitted."""
    self.running.remove(seq)
    self.release(seq)
    seq.spans[-1][1] = len(self.timeline) - 1      # it last ran in the previous step
    if seq.status == FINISHED:                   # a padding row of a static batch: nothing to resume
        return
    seq.status = WAITING
    seq.num_preempted += 1
    self.waiting.appendleft(seq)

# %% [markdown]
# ## 4. The engine
#
# `PagedEngine` puts it together: its own copy of the policy as a `PagedModel`, the pool,
# the scheduler, a prefix cache (sections 7 and 8) and optionally a draft (section 9). One
# `step()` schedules, runs one forward pass over all scheduled tokens, samples a token for
# every sequence whose pending tokens are all computed, and retires the sequences that hit
# EOS or their limit. `generate` is the rollout-engine protocol of notebook 01, so it returns
# the same `Rollout`, with the behaviour log-probs and the policy version.

# %%
# | export minirl/rollout/engine/engine.py
"""`PagedEngine`: the paged KV cache, the scheduler and the caches behind the rollout-engine protocol.

    engine = PagedEngine(model, tokenizer)                # its own copy of the policy, version 0
    rollout = engine.generate(prompts, SamplingConfig(num_generations=8, max_completion_length=256))
    engine.load_weights(actor.named_weights(), version=1)  # the trainer's HF parameter names

`generate` turns each prompt into G sequences, runs engine steps until all have finished,
and returns a `Rollout` with the behaviour log-probs (log-softmax of the very logits each
token was sampled from, in float32) and the version. `run(requests)` is the serving-level
entry: one result per request, and a request that cannot be served (too long, max_tokens
<= 0, empty) fails alone with its error while the others run.

Each `step()`: the scheduler picks the work (decode tokens of running sequences, prefills of
newly admitted ones), one `PagedModel` forward pass computes all of it, and each sequence
that completed its pending tokens samples one new token (or, with a draft, verifies k
speculated ones). `stats` counts prompt tokens computed and found in the cache, decode
tokens, preemptions and the seconds spent in each phase.

Simplified vs vLLM: one process, one device, no CUDA graphs, no detokenization streaming,
plain temperature sampling (no top-k/top-p), weights updated in place between batches.
"""

import copy
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig
from minirl.data import Rollout
from minirl.rollout.base import check_request, check_tokenizer, draw_seed, make_rollout
from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.blocks import BlockPool, blocks_needed
from minirl.rollout.engine.prefix import PrefixCache
from minirl.rollout.engine.radix import RadixCache
from minirl.rollout.engine.scheduler import FINISHED, RUNNING, Scheduler, Sequence
from minirl.rollout.engine.speculative import speculative_step
from minirl.rollout.hf import DTYPES
from minirl.rollout.sampling import sample_tokens

CACHES = ("prefix", "radix", "none")
AUTO_CACHE_TOKENS = 65536   # the most a cache sized to the work grows to (pass num_blocks or kv_cache_bytes for more)


@dataclass
class Request:
    """One completion to generate: prompt token ids, at most `max_tokens` new tokens, temperature (0: greedy)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0

# %% [markdown]
# `Stats` is the engine's bookkeeping: the tokens it computed, by kind, and the seconds each
# phase took. The measurements of the later sections read their counted figures from it.

# %%
# | export minirl/rollout/engine/engine.py
@dataclass
class Stats:
    """What the engine computed, by kind, and where the time went (seconds per phase)."""

    prompt_tokens: int = 0         # prompt (and recomputed) tokens admitted
    cached_tokens: int = 0         # of those, found in the prefix cache: no prefill
    prefill_tokens: int = 0        # tokens computed by prefills
    decode_tokens: int = 0         # tokens computed by decode steps (one per running sequence per step)
    generated_tokens: int = 0      # tokens sampled and kept
    padding_tokens: int = 0        # static batching: rows computed for sequences that had finished
    steps: int = 0
    preemptions: int = 0
    draft_tokens: int = 0          # speculation: tokens proposed
    accepted_tokens: int = 0       # speculation: proposals the target accepted
    verified_rows: int = 0         # speculation: sequences verified (each gets accepted + 1 tokens)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "sample", "draft", "postprocess"), 0.0))

# %% [markdown]
# Validation, out of the way of what follows: which requests can be served, how many blocks the
# cache gets, and whether pushed weights fit the engine's model. Each raises (or returns) one line
# naming the value, the limit and the fix.

# %%
# | export minirl/rollout/engine/engine.py
def request_error(request: Request, max_model_len: int) -> str | None:
    """Why `request` cannot be served (an error message naming the value and the limit), or None."""
    P, M = len(request.prompt_ids), request.max_tokens
    if P == 0:
        return "the prompt is empty (0 tokens); pass at least one token"
    if not isinstance(M, int) or M <= 0:
        return f"max_tokens={M!r} must be an int >= 1"
    if P + M > max_model_len:
        return (f"prompt of {P} tokens + max_tokens={M} = {P + M} tokens exceeds max_model_len="
                f"{max_model_len} (the model's context); shorten the prompt or lower max_tokens")
    if request.temperature < 0:
        return f"temperature={request.temperature} must be >= 0 (0: greedy)"
    return None


def cache_blocks(model: PagedModel, block_size: int, num_blocks: int | None, kv_cache_bytes: int | None,
                 max_model_len: int) -> int:
    """Blocks in the cache: `num_blocks`, or as many as `kv_cache_bytes` holds, or (neither) one sequence's worth.

    Raises if both are given, or if the cache cannot hold one sequence of max_model_len tokens.
    """
    if num_blocks is not None and kv_cache_bytes is not None:
        raise ValueError(f"PagedEngine: num_blocks={num_blocks} and kv_cache_bytes={kv_cache_bytes}: pass one")
    if kv_cache_bytes is not None:
        per_block = model.cache_bytes_per_block(block_size)
        num_blocks = kv_cache_bytes // per_block
        if num_blocks * block_size < max_model_len:
            raise ValueError(f"PagedEngine: kv_cache_bytes={kv_cache_bytes} holds {num_blocks} blocks of "
                             f"{per_block} B, fewer than one sequence of max_model_len={max_model_len}; "
                             f"raise it to >= {blocks_needed(max_model_len, block_size) * per_block}")
    if num_blocks is None:                                   # one sequence now; `run` grows it to the work
        num_blocks = blocks_needed(max_model_len, block_size)
    if num_blocks * block_size < max_model_len:
        raise ValueError(f"PagedEngine: the cache holds num_blocks * block_size = {num_blocks} * {block_size} = "
                         f"{num_blocks * block_size} tokens, fewer than one sequence of max_model_len="
                         f"{max_model_len}; raise num_blocks to >= "
                         f"{blocks_needed(max_model_len, block_size)} or lower max_model_len")
    return num_blocks


def check_weights(state: dict, own: dict, version: int) -> None:
    """Raise, naming what differs, unless `state` has exactly the names and shapes of `own` (the engine's)."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    reshaped = sorted(f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in set(own) & set(state)
                      if own[k].shape != state[k].shape)
    if missing or unexpected or reshaped:
        raise ValueError(f"PagedEngine.load_weights(version={version}): missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, wrong shape {reshaped[:3]} (of {len(own)} tensors); push all of "
                         "the policy's tensors, by the names of the engine's model (same architecture and size)")

# %% [markdown]
# One plain engine step after scheduling: every scheduled chunk (whole prompts, prompt tails,
# single decode tokens, padding rows of a static batch) goes into one forward pass through the
# block tables, and each sequence whose pending tokens are all computed samples its next token.

# %%
# | export minirl/rollout/engine/engine.py
def forward_step(engine: "EngineCore", work: list[tuple[Sequence, int]], clock: float,
                 generator: torch.Generator | None = None) -> None:
    """One plain step: the scheduled chunks (prefills and decode tokens) in one forward pass, one token sampled
    for every sequence whose pending tokens are now all computed (the speculative round is `speculative_step`).

    clock: perf_counter() when the step's scheduling ended (the phases' seconds go to `engine.stats`).
    """
    chunks = []
    for seq, n in work:
        if seq.status != RUNNING:                                    # a padding row of a static batch
            chunks.append(Chunk([engine.tokenizer.pad_token_id], seq.num_computed, seq.block_table, 0))
            engine.stats.padding_tokens += 1
            continue
        chunks.append(Chunk(seq.tokens[seq.num_computed:], seq.num_computed, seq.block_table, 1))
        if seq.num_computed == seq.num_cached:                       # admitted in this step: a prefill
            engine.stats.prompt_tokens += len(seq.tokens)
            engine.stats.cached_tokens += seq.num_cached
            engine.stats.prefill_tokens += n
        else:
            engine.stats.decode_tokens += n
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step)                                                     # [R, V]
    clock = engine.tick("forward", clock)
    live = [seq for seq, _ in work if seq.status == RUNNING]
    temperatures = torch.tensor([s.temperature for s in live], device=logits.device)
    tokens, logprobs = sample_tokens(logits, temperatures, generator)   # notebook 01's sampling step
    clock = engine.tick("sample", clock)
    for seq, n in work:
        seq.num_computed += n
    for seq, token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
        engine.append(seq, [token], [logprob])
    engine.tick("postprocess", clock)

# %% [markdown]
# The engine's core: its constructor checks its arguments and sets up its own copy of the
# policy, the cache tensor sized in blocks, and (through `reset`) the pool, the scheduler and a
# prefix cache.

# %%
# | export minirl/rollout/engine/engine.py
class EngineCore:
    """The engine's state and its step: a paged, continuously batched, prefix-caching (optionally
    speculative) engine on an HF causal LM; `PagedEngine` adds the entry points.

    model: a Llama/Qwen2-style HF causal LM (copied; the engine keeps its own weights).
    block_size: token slots per KV block. num_blocks: blocks in the cache, or kv_cache_bytes: a
    byte budget for it (keys and values of every layer); with neither, the cache is sized to
    the work: each `run` grows it to hold its running requests (at most max_num_seqs) at their
    longest (prompt + max_tokens), up to AUTO_CACHE_TOKENS tokens; on a CPU the OS commits a
    block's memory only when it is first used. max_num_seqs: batch slots. max_num_batched_tokens:
    tokens per step (prefills beyond it wait for the next step). max_model_len: longest prompt + completion (default:
    the model's max_position_embeddings). cache: "prefix" (hash chain), "radix" (tree with
    LRU eviction) or "none". policy: "continuous" or "static" (see Scheduler). reserve:
    "on_demand" (paged) or "max_length" (contiguous preallocation, for comparison).
    draft: a `ModelDraft` or `NgramDraft` to speculate `num_speculative_tokens` tokens per step.
    """

    def __init__(self, model, tokenizer, dtype: str = "float32", device=None, block_size: int = 16,
                 num_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, cache: str = "prefix", policy: str = "continuous",
                 reserve: str = "on_demand", draft=None, num_speculative_tokens: int = 0,
                 kv_cache_bytes: int | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"PagedEngine: dtype={dtype!r}; use one of {', '.join(DTYPES)}")
        if cache not in CACHES:
            raise ValueError(f"PagedEngine: cache={cache!r}; use one of {', '.join(CACHES)}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedEngine: {name}={value!r} must be an int >= 1")
        check_tokenizer(tokenizer)
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.padding_side = "left"
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = PagedModel(copy.deepcopy(model).to(self.device, DTYPES[dtype]).eval())
        self.dtype = dtype
        context = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = max_model_len or context
        if self.max_model_len is None or self.max_model_len < 2:
            raise ValueError(f"PagedEngine: max_model_len={self.max_model_len!r}; pass the longest prompt + "
                             "completion (>= 2 tokens) the engine must hold")
        if num_speculative_tokens < 0 or (num_speculative_tokens > 0) != (draft is not None):
            raise ValueError(f"PagedEngine: num_speculative_tokens={num_speculative_tokens} with draft={draft!r}: "
                             "pass both a draft and num_speculative_tokens >= 1 to speculate, or neither")
        self.sized_to_work = num_blocks is None and kv_cache_bytes is None
        num_blocks = cache_blocks(self.model, block_size, num_blocks, kv_cache_bytes, self.max_model_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.cache_kind, self.policy, self.reserve = cache, policy, reserve
        self.draft, self.k = draft, num_speculative_tokens
        self.model.allocate_cache(num_blocks, block_size)
        if draft is not None:
            draft.attach(self)
        self.version = 0
        self.reset()

# %% [markdown]
# The engine's state can be emptied (`reset`, after new weights: keys and values of the old ones
# must never be found again) and the cache enlarged in place (`grow`, when the cache is sized to
# the work), keeping the blocks in use and the cached prefixes.

# %%
# | export minirl/rollout/engine/engine.py
# ------------------------------------------------------------------ state
@add_to_class(EngineCore)
def reset(self) -> None:
    """Empty the cache and the queues (keys/values of other weights must never be reused)."""
    self.pool = BlockPool(self.num_blocks, self.block_size)
    caches = {"prefix": PrefixCache, "radix": RadixCache, "none": lambda pool: None}
    self.cache = caches[self.cache_kind](self.pool)
    self.scheduler = Scheduler(self.pool, self.cache, self.max_num_seqs, self.max_num_batched_tokens,
                               self.policy, self.reserve, lookahead=self.k)
    self.stats = Stats()
    self.next_id = 0
    if self.draft is not None:
        self.draft.reset()
        self.scheduler.on_release.append(self.draft.release)


@add_to_class(EngineCore)
def grow(self, num_blocks: int) -> None:
    """Enlarge the cache to `num_blocks` blocks (never shrinks); blocks in use and cached prefixes stay."""
    if num_blocks <= self.num_blocks:
        return
    self.model.grow_cache(num_blocks)
    self.pool.grow(num_blocks)
    if self.draft is not None:
        self.draft.grow(num_blocks)
    self.num_blocks = num_blocks

# %% [markdown]
# One step: schedule, then a plain forward step or, when every scheduled sequence is decoding and a
# draft is attached, a speculative round (section 9); `append` adds sampled tokens and finishes a
# sequence at EOS or its limit, and `tick` adds a phase's seconds to `stats`.

# %%
# | export minirl/rollout/engine/engine.py
# ------------------------------------------------------------------ one step
@add_to_class(EngineCore)
def step(self, generator: torch.Generator | None = None) -> None:
    """Schedule, run one forward pass over all the scheduled tokens, sample, update the sequences."""
    clock = time.perf_counter()
    work = self.scheduler.schedule()
    self.stats.preemptions += self.scheduler.timeline[-1]["preempted"]
    clock = self.tick("schedule", clock)
    self.stats.steps += 1
    if not work:
        return
    decoding = [seq for seq, n in work if seq.status == RUNNING and seq.num_computed > seq.num_cached and n == 1]
    if self.draft is not None and len(decoding) == len(work):
        speculative_step(self, decoding, generator)
        return
    forward_step(self, work, clock, generator)


@add_to_class(EngineCore)
def append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
    """Add sampled tokens to `seq`, stopping at EOS or max_tokens; finish it if it stopped."""
    for token, logprob in zip(tokens, logprobs, strict=True):
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        if token == seq.eos_token_id or seq.num_generated >= seq.max_tokens:
            self.scheduler.finish(seq, "eos" if token == seq.eos_token_id else "length")
            return


@add_to_class(EngineCore)
def tick(self, phase: str, since: float) -> float:
    now = time.perf_counter()
    self.stats.seconds[phase] += now - since
    return now

# %% [markdown]
# The entry points on top of the core, first the serving one: `run` checks and queues requests
# and steps until all have finished.

# %%
# | export minirl/rollout/engine/engine.py
class PagedEngine(EngineCore):
    """`EngineCore` with its entry points: `run` (serving: requests in, sequences out; `add` queues
    one, `check` says why one cannot be served) and the rollout-engine protocol (`generate`,
    `load_weights`, `named_weights`); the constructor's arguments are EngineCore's."""

    # ------------------------------------------------------------------ serving

    def check(self, request: Request) -> str | None:
        """Why `request` cannot be served (an error message naming the value and the limit), or None."""
        return request_error(request, self.max_model_len)

    def add(self, request: Request) -> Sequence:
        """Queue one request; a request that cannot be served comes back finished, with its error."""
        seq = Sequence(self.next_id, list(request.prompt_ids), len(request.prompt_ids), request.max_tokens,
                       request.temperature, self.tokenizer.eos_token_id)
        self.next_id += 1
        error = self.check(request)
        if error is not None:
            seq.status, seq.finish_reason, seq.error = FINISHED, "error", error
        else:
            self.scheduler.add(seq)
        return seq

    def run(self, requests: list[Request], generator: torch.Generator | None = None) -> list[Sequence]:
        """Serve every request; returns their sequences in order (see Sequence.completion / .error).

        `stats` and the scheduler's `timeline` then describe this run alone.
        """
        self.stats = Stats()
        self.scheduler.timeline = []
        if self.sized_to_work:
            served = [r for r in requests if self.check(r) is None]
            if served:
                longest = max(len(r.prompt_ids) + r.max_tokens for r in served) + self.k
                wanted = min(len(served), self.max_num_seqs) * blocks_needed(longest, self.block_size)
                self.grow(min(wanted, AUTO_CACHE_TOKENS // self.block_size))
        seqs = [self.add(r) for r in requests]
        while self.scheduler.has_work():
            self.step(generator)
        return seqs

# %% [markdown]
# The rollout-engine protocol of notebook 01: `load_weights` checks and copies the trainer's
# weights (then empties the cache), and `generate` turns prompts into G requests each, runs them,
# and pads the sequences into a `Rollout`.

# %%
# | export minirl/rollout/engine/engine.py
# ------------------------------------------------------------------ the protocol
@add_to_class(PagedEngine)
def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
    """Copy the trainer's weights (HF parameter names) into the engine's copy; it now holds `version`.

    Checks every name and shape before copying anything (a model of another architecture
    or size fails with the names that differ), then empties the cache: keys and values
    computed by the old weights must not be reused by a prefix hit.
    """
    state = dict(named_tensors)
    check_weights(state, self.model.model.state_dict(), version)
    with torch.no_grad():
        self.model.model.load_state_dict(state, strict=True)
    self.model.refresh()                                     # the fused products follow the new weights
    self.version = version
    self.reset()


@add_to_class(PagedEngine)
def named_weights(self) -> Iterable[tuple[str, Tensor]]:
    return self.model.model.named_parameters()


@add_to_class(PagedEngine)
@torch.no_grad()
def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
             generator: torch.Generator | None = None) -> Rollout:
    """sampling.num_generations completions per prompt; rows i*G .. i*G+G-1 belong to prompts[i].

    Raises ValueError before any work if a prompt cannot be served (too long for
    max_model_len), naming the prompt, its length and the limit. See `RolloutEngine.generate`.
    """
    check_request(self, prompts, sampling, expected_version)
    G, C = sampling.num_generations, sampling.max_completion_length
    ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    requests = [Request(x, C, sampling.temperature) for x in ids for _ in range(G)]
    for i, x in enumerate(ids):
        if (error := self.check(Request(x, C, sampling.temperature))) is not None:
            raise ValueError(f"PagedEngine.generate: prompts[{i}]: {error}")
    seed = draw_seed(generator)
    sampler = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
    seqs = self.run(requests, sampler)
    pad = self.tokenizer.pad_token_id
    P = max(len(x) for x in ids)
    width = max(len(s.completion) for s in seqs)
    prompt_ids = torch.full((len(seqs), P), pad, dtype=torch.long)
    prompt_mask = torch.zeros(len(seqs), P, dtype=torch.long)
    completion_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    logprobs = torch.zeros(len(seqs), width)
    for row, seq in enumerate(seqs):
        n, m = seq.prompt_len, len(seq.completion)
        prompt_ids[row, P - n:] = torch.tensor(seq.tokens[:n])
        prompt_mask[row, P - n:] = 1
        completion_ids[row, :m] = torch.tensor(seq.completion, dtype=torch.long)
        logprobs[row, :m] = torch.tensor(seq.logprobs)
    return make_rollout(self.tokenizer, prompts, G, prompt_ids.to(self.device), prompt_mask.to(self.device),
                        completion_ids.to(self.device), logprobs.to(self.device), self.version)

# %% [markdown]
# Correct first. Greedy decoding must give exactly HF `generate`'s tokens, on both
# policies, and the log-probs the engine records while sampling must equal the trainer's
# float32 recomputation (`completion_logprobs`, notebook 01) up to rounding. (Where two
# logits tie within rounding, greedy decoding may pick either: `tests/test_engine.py`
# accepts a difference only there.)

# %%
from minirl.algo.logprobs import completion_logprobs
from minirl.config import SamplingConfig
from minirl.tasks.arithmetic import format_prompt, make_task

TASK = make_task()


def hf_greedy(model, tok, texts, max_new_tokens):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:].tolist()
    return [row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row for row in out]


checks = [("embedded", policy, policy_tok, [format_prompt(p) for p in TASK.test[:64]], 5, 4),
          ("long-tail", big, big_tok, few_shot_prompts(4), 16 if SMOKE else 64, 16)]
for name, model, tok, texts, n_new, bs in checks:
    engine = PagedEngine(model, tok, block_size=bs)
    got = [s.completion for s in engine.run([Request(tok(t, add_special_tokens=False)["input_ids"], n_new, 0.0)
                                             for t in texts])]
    same = sum(g == w for g, w in zip(got, hf_greedy(model, tok, texts, n_new), strict=True))
    ro = engine.generate(texts[:4], SamplingConfig(num_generations=4, max_completion_length=n_new),
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
    gap = (trainer - ro.logprobs)[ro.completion_mask.bool()].abs().max().item()
    print(f"{name:>9}: greedy = HF generate for {same}/{len(texts)} prompts; sampled log-probs vs the trainer's "
          f"fp32 recomputation: max |diff| {gap:.1e} over {int(ro.completion_mask.sum())} tokens")
    assert same == len(texts) and gap < 1e-4

# %% [markdown]
# Now the scheduler at work: 12 requests of the long-tail policy, 4 batch slots, and a cache
# of 24 blocks of 4 tokens, too small for 4 long sequences at once. Each bar is one
# sequence's stay in the batch; a bar that ends in a cross was preempted and comes back
# later to recompute; the lower panel shows the sequences running and the blocks in use,
# step by step. A finished sequence's slot is taken in the next step when blocks allow; while
# the pool is full (lower panel), a slot stays empty and requests wait.

# %%
def draw_timeline(engine, seqs, title):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True, height_ratios=(3, 1.3))
    for row, seq in enumerate(seqs):
        for i, (first, last) in enumerate(seq.spans):
            top.barh(row, last - first + 1, left=first, color=plt.cm.tab10(row % 10), edgecolor="black", height=0.7)
            if i < len(seq.spans) - 1:
                top.plot(last + 1, row, "kx")
    top.set_ylabel("sequence")
    top.set_title(title, fontsize=9)
    timeline = engine.scheduler.timeline
    bottom.plot([r["running"] for r in timeline], label="sequences in the step")
    bottom.plot([r["blocks_used"] for r in timeline], label="blocks in use")
    bottom.axhline(engine.num_blocks, color="grey", ls=":", label="blocks in the pool")
    bottom.set_xlabel("engine step")
    bottom.legend(fontsize=7, loc="upper right")
    plt.tight_layout()
    plt.show()


demo = PagedEngine(big, big_tok, block_size=4, num_blocks=24, max_num_seqs=4, cache="none", max_model_len=96)
lengths = [10, 40, 6, 25, 14, 30, 8, 18, 12, 22, 5, 16]
ids = big_tok(few_shot_prompts(12, length=12), add_special_tokens=False)["input_ids"]
demo_seqs = demo.run([Request(x, n, 0.0) for x, n in zip(ids, lengths, strict=True)])
draw_timeline(demo, demo_seqs, f"continuous batching, 4 slots, 24 blocks of 4: {demo.stats.steps} steps, "
              f"{demo.stats.preemptions} preemptions")
assert demo.pool.num_free == demo.num_blocks and all(len(s.completion) <= n for s, n in zip(demo_seqs, lengths, strict=True))

# %% [markdown]
# ## 5. Measured: KV memory utilization (the PagedAttention row)
#
# Utilization is the share of reserved KV slots that hold a token, summed over the steps
# of a run. We run the long-tail workload once and, at every step, compare the slots the
# paged engine holds (its blocks) with what contiguous preallocation of prompt +
# `max_tokens` slots would hold for the very same running sequences. Then the payoff: with
# one fixed cache size, how many sequences run at once under each policy while requests are
# still waiting.

# %%
# | export minirl/rollout/engine/measure.py
"""The measurements of notebook 05 and chapters/05, one function per row of the source's table.

Each function runs the paged engine on a workload it is given (any HF Llama/Qwen2-style model
and tokenizer) and returns a plain dict of figures: counted ones (KV slots, prefill tokens,
accepted drafts, cache hits) that do not depend on the machine, and timed ones (tokens per
second) whose alternatives run interleaved, `repeats` times each, compared by their medians.
"""

import statistics
import time

import torch
from tqdm.auto import tqdm

from minirl.config import SamplingConfig
from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.engine import PagedEngine, Request
from minirl.rollout.hf import HFEngine


def interleaved(runs: dict, repeats: int, progress: str | None = None) -> dict[str, list[float]]:
    """Seconds of each run (a no-argument function), in turn, `repeats` times: A, B, A, B, ...

    Each run is called once before, unmeasured: first calls pay one-time costs (allocation,
    kernel selection) that would otherwise land on whichever runs first. progress: the label
    of a tqdm bar over the calls (none without one).
    """
    bar = tqdm(total=len(runs) * (repeats + 1), desc=progress, disable=progress is None)
    for name, run in runs.items():
        run()
        bar.set_postfix_str(f"{name}: warm-up call", refresh=False)
        bar.update(1)
    seconds = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
            bar.set_postfix_str(f"{name}: {seconds[name][-1]:.2f} s", refresh=False)
            bar.update(1)
    bar.close()
    return seconds

# %% [markdown]
# The first row's figure: the share of held KV slots that hold a token, counted at every step
# of one run, for the paged engine's blocks and for contiguous preallocation of the same sequences.

# %%
# | export minirl/rollout/engine/measure.py
def kv_utilization(model, tokenizer, prompts: list[str], sampling: SamplingConfig, block_size: int = 16,
                   seed: int = 0) -> dict:
    """KV slots filled / slots held, summed over the steps of one generate call, paged vs contiguous.

    Paged: the blocks the engine actually holds (no prefix cache, so that sharing does not
    flatter it). Contiguous: what preallocating prompt + max_tokens slots per running sequence
    would hold for the very same sequences at the very same steps.
    """
    engine = PagedEngine(model, tokenizer, block_size=block_size, cache="none")
    rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
    timeline = engine.scheduler.timeline
    held = sum(row["held"] for row in timeline)
    lengths = rollout.completion_mask.sum(1).tolist()
    return {"paged": held / sum(row["blocks_used"] * block_size for row in timeline),
            "contiguous": held / sum(row["reserved_max"] for row in timeline),
            "block_size": block_size, "completion_lengths": lengths}

# %%
# | export minirl/rollout/engine/measure.py
def effective_batch(model, tokenizer, prompts: list[str], sampling: SamplingConfig, cache_tokens: int,
                    block_size: int = 16, seed: int = 0) -> dict:
    """Sequences running at once when the KV cache holds `cache_tokens`: paged vs contiguous reservation.

    The mean is taken over the steps in which requests were still waiting, the steps when
    memory, not the workload, sets the batch size. Also counts the steps each needs in all.
    """
    out = {}
    for reserve in ("on_demand", "max_length"):
        engine = PagedEngine(model, tokenizer, block_size=block_size, cache="none", reserve=reserve,
                             num_blocks=cache_tokens // block_size)
        engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
        timeline = engine.scheduler.timeline
        full = [row["running"] for row in timeline if row["waiting"] > 0] or [row["running"] for row in timeline]
        out[reserve] = (statistics.mean(full), len(timeline), engine.stats.preemptions)
    return {"paged": out["on_demand"][0], "contiguous": out["max_length"][0],
            "ratio": out["on_demand"][0] / out["max_length"][0],
            "steps": {"paged": out["on_demand"][1], "contiguous": out["max_length"][1]},
            "preemptions": out["on_demand"][2], "cache_tokens": cache_tokens}

# %%
sampling = SamplingConfig(num_generations=G, max_completion_length=MAX_NEW)
kv = kv_utilization(big, big_tok, PROMPTS, sampling)
lengths = torch.tensor(kv["completion_lengths"], dtype=torch.float)
prompt_len = statistics.mean(len(big_tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS)
print(f"workload: {B} prompts (mean {prompt_len:.0f} tokens) x G={G}, max_tokens={MAX_NEW}; completion lengths: "
      f"mean {lengths.mean():.0f}, median {lengths.median():.0f}, max {lengths.max():.0f}, "
      f"{(lengths == MAX_NEW).float().mean() * 100:.0f} % at the cap")
cache_tokens = 512 if SMOKE else 2048
eb = effective_batch(big, big_tok, PROMPTS[:B // 2], sampling, cache_tokens=cache_tokens)
# a sequence of L new tokens holds on average prompt + L/2 slots during its L steps, and reserves prompt + max_tokens
# (contiguous) or those slots and, on average, half a block more (paged: its last block is partly empty)
expected = float((lengths * (prompt_len + lengths / 2)).sum() / (lengths * (prompt_len + MAX_NEW)).sum())
expected_paged = float((lengths * (prompt_len + lengths / 2)).sum()
                       / (lengths * (prompt_len + lengths / 2 + kv["block_size"] / 2)).sum())
rows = [("contiguous utilization", "50-70 %", pct(kv["contiguous"]),
         "agree" if 0.5 <= kv["contiguous"] <= 0.7 else "differ",
         f"expected {pct(expected)} from these lengths: a slab is only as full as its sequence gets "
         f"(mean {lengths.mean():.0f} of {MAX_NEW} new tokens)"),
        ("paged utilization", "95 %+", pct(kv["paged"]), "agree" if kv["paged"] >= 0.95 else "differ",
         f"expected {pct(expected_paged)}: only the last block is partly empty, half of {kv['block_size']} slots "
         f"per sequence of ~{prompt_len + lengths.mean() / 2:.0f} held tokens (longer: closer to 100 %)"),
        ("sequences at once, same cache", "2-4x", f"{eb['ratio']:.1f}x ({eb['paged']:.0f} vs {eb['contiguous']:.0f})",
         "agree" if 2 <= eb["ratio"] <= 4 else "differ",
         f"{cache_tokens}-token cache; paged admits by current length and preempts when it runs out "
         f"({eb['preemptions']} preemptions)")]
show(rows, ("quantity", "source", "minirl", "agree?", "why"))
assert kv["paged"] > 0.85 and kv["paged"] > kv["contiguous"] and eb["ratio"] > 1

# %% [markdown]
# Utilization is a property of the workload as much as of the allocator: contiguous
# reservation fills each slab only as far as its sequence gets, so the longer the tail of
# lengths, the worse it does. Paged allocation wastes at most one partly filled block per
# sequence, whatever the lengths: half a block on average, so whether it reaches the source's
# 95 % depends on how many tokens a sequence holds against the block size (the row's
# expected figure says where these prompts and 16-token blocks land). The larger concurrency is what buys throughput on a GPU,
# where a decode step costs about the same for 8 sequences as for 64 (the next section).

# %% [markdown]
# ## 6. Measured: continuous vs static batching
#
# The same requests with 16 batch slots (4 in smoke mode), run by the same engine under the
# two policies, interleaved. The static batcher pays for the rows of finished sequences
# until the longest of the batch ends.

# %%
# | export minirl/rollout/engine/measure.py
def continuous_vs_static(model, tokenizer, prompts: list[str], sampling: SamplingConfig, max_num_seqs: int,
                         repeats: int = 3, block_size: int = 16, seed: int = 0, progress: str | None = None) -> dict:
    """Tokens/s of continuous and static batching on the same requests, with `max_num_seqs` batch slots.

    Also counts, per policy, the work of one run: steps, decode rows (a static batch's padding
    rows included) and prefill tokens. progress: the label of a bar over the runs (`interleaved`).
    """
    engines = {policy: PagedEngine(model, tokenizer, block_size=block_size, max_num_seqs=max_num_seqs,
                                   cache="none", policy=policy) for policy in ("continuous", "static")}
    tokens, work = {}, {}

    def run(policy):
        engine = engines[policy]
        rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
        tokens[policy] = int(rollout.completion_mask.sum())
        stats = engine.stats
        work[policy] = {"steps": stats.steps, "decode_rows": stats.decode_tokens + stats.padding_tokens,
                        "prefill_tokens": stats.prefill_tokens}

    seconds = interleaved({p: (lambda p=p: run(p)) for p in engines}, repeats, progress)
    rate = {p: tokens[p] / statistics.median(seconds[p]) for p in engines}
    return {"continuous_tokens_per_s": rate["continuous"], "static_tokens_per_s": rate["static"],
            "ratio": rate["continuous"] / rate["static"], "work": work,
            "step_ratio": work["static"]["steps"] / work["continuous"]["steps"],
            "row_ratio": work["static"]["decode_rows"] / work["continuous"]["decode_rows"],
            "tokens": tokens, "seconds": seconds}


def step_costs(model, rows: int, context: int = 128, prompt: int = 64, block_size: int = 16) -> dict:
    """A linear cost model of an engine step on this device, in seconds: fixed + per decode row + per prefill token.

    Fitted from three timed forward passes: 1 decode row, `rows` decode rows (both after
    `context` cached tokens) and one prefill of `prompt` tokens.
    """
    one = step_seconds(model, 1, 1, context, block_size=block_size)
    many = step_seconds(model, rows, 1, context, block_size=block_size)
    prefill = step_seconds(model, 1, prompt, 0, block_size=block_size)
    per_row = max(many - one, 0.0) / (rows - 1)
    fixed = one - per_row
    return {"fixed": fixed, "per_row": per_row, "per_prefill_token": max(prefill - fixed, 0.0) / prompt}


def predicted_seconds(costs: dict, work: dict) -> float:
    """What the cost model says a run with this work (steps, decode_rows, prefill_tokens) takes."""
    return (costs["fixed"] * work["steps"] + costs["per_row"] * work["decode_rows"]
            + costs["per_prefill_token"] * work["prefill_tokens"])


def step_seconds(model, rows: int, tokens_per_row: int, context: int, repeats: int = 15, block_size: int = 16) -> float:
    """Median seconds of one PagedModel forward pass: `rows` sequences, each `tokens_per_row` new tokens
    after `context` cached ones (what a decode step, or a verification of k drafts, costs)."""
    paged, step = probe_step(model, rows, tokens_per_row, context, block_size)
    return statistics.median(interleaved({"step": lambda: paged(step)}, repeats)["step"])


def probe_step(model, rows: int, tokens_per_row: int, context: int, block_size: int = 16):
    """(PagedModel, Step) of a synthetic engine step: `rows` sequences of `tokens_per_row` new tokens after
    `context` cached ones, each in blocks of its own; run once, so that the first call's costs are paid."""
    paged = PagedModel(model)
    per_row = -(-(context + tokens_per_row) // block_size)
    paged.allocate_cache(rows * per_row, block_size)
    chunks = [Chunk([3] * tokens_per_row, context, list(range(r * per_row, (r + 1) * per_row)), tokens_per_row)
              for r in range(rows)]
    step = make_step(chunks, block_size, paged.n_rep, next(model.parameters()).device)
    paged(step)
    return paged, step

# %%
slots = 4 if SMOKE else 16
cvs = continuous_vs_static(big, big_tok, PROMPTS[:max(2, B // 2)], sampling, max_num_seqs=slots, repeats=1,
                           progress="continuous vs static")
work = cvs["work"]
costs = step_costs(big, 16)
model_ratio = predicted_seconds(costs, work["static"]) / predicted_seconds(costs, work["continuous"])
show([(p, w["steps"], w["decode_rows"], w["prefill_tokens"], f"{predicted_seconds(costs, w):.2f}",
       f"{statistics.median(cvs['seconds'][p]):.2f}") for p, w in work.items()],
     ("policy", "steps", "decode rows", "prefill tokens", "model s", "measured s"))
print(f"\ncost model of a step on this CPU: {1e3 * costs['fixed']:.1f} ms fixed + {1e3 * costs['per_row']:.2f} ms per "
      f"decode row + {1e3 * costs['per_prefill_token']:.2f} ms per prefill token\n")
show([("throughput, continuous / static", "5-10x", f"{cvs['ratio']:.2f}x (measured)",
       "agree" if 5 <= cvs["ratio"] <= 10 else "differ", f"the cost model predicts {model_ratio:.2f}x from the work"),
      ("if a step cost the same for any batch", "-", f"{cvs['step_ratio']:.2f}x (steps)", "-",
       "a GPU's memory-bound decode step: time follows steps"),
      ("if time followed rows only", "-", f"{cvs['row_ratio']:.2f}x (rows)", "-",
       "a compute-bound step: time follows rows")],
     ("quantity", "source", "minirl", "agree?", "why"))
assert work["static"]["steps"] >= work["continuous"]["steps"] and cvs["row_ratio"] > 1


# %% [markdown]
# Where the difference comes from, in numbers. A step costs a fixed part (reading every
# weight once, launching a few hundred operators from Python), a part per decode row and a
# part per prefill token (the arithmetic). The static batcher computes more rows (the
# finished sequences' padding) in more steps (each batch lasts as long as its longest
# member); both policies prefill the same prompts. The cost model fitted above turns these
# counts into seconds; compare its prediction with the measured ratio (a machine shared with
# other work adds noise to the latter). On a GPU a small model's decode step is memory-bound
# and costs about the same for 1 row as for dozens: the gain follows the steps, and the slots
# continuous batching keeps busy are free throughput. The source's 5–10× also counts the
# larger batches paged memory allows (section 5) and longer tails than this workload's.

# %% [markdown]
# ## 7. Prefix caching: the G completions of a prompt share its blocks
#
# GRPO samples G completions of every prompt. Without sharing, each of them prefills the
# whole prompt. A prefix cache notices that their first blocks have the same content: a
# **full** block is identified by a hash of its tokens, chained with the previous block's
# hash, so the hash stands for the whole prefix up to the block's end. At admission a
# sequence looks up its blocks' hashes one after another (exercise 5.3) and shares, by
# reference count, every block found until the first miss. Two details matter for the
# numbers: only whole blocks are shared, and the last prompt token is always computed (it
# gives the logits of the first sampled token), so a prompt of P tokens shares
# `block_size * floor((P - 1) / block_size)` of them. With G completions,
# saved share = (G − 1)/G × shared/P, which tends to 1 − 1/G = 87.5 % at G = 8 for long
# prompts.
#
# Freed blocks keep their content and stay findable until the pool hands them out again,
# least recently freed first: the free list doubles as the cache (vLLM's design).

# %%
# | export minirl/rollout/engine/prefix.py
"""Prefix caching: full blocks found again by the hash of their content, and shared.

When a block is full, its hash (its tokens chained with the previous block's hash, see
`block_hash`) is registered with the block id. A new sequence looks up the hashes of its
own full blocks, one after another, and shares every block found until the first miss:
those tokens need no prefill. The G completions of one GRPO prompt are the textbook case:
the first one to be admitted computes the prompt's blocks, the other G - 1 share them (even
in the same step: each layer writes a step's keys and values before any query reads them).

A registered block stays findable after its last user frees it, until the pool hands it out
again (`BlockPool.on_reuse` tells the cache to forget it): freed blocks double as the cache.

Simplified vs vLLM: Python's tuple hash instead of SHA-256 (a collision is caught by
comparing the tokens); the last block of a sequence is never matched, even when full, so that
at least one token is computed and gives the logits to sample from (vLLM does the same).
"""

from minirl.rollout.engine.blocks import BlockPool, block_hash


def match_prefix(tokens: list[int], block_size: int, table: dict[int, tuple[int, tuple]]) -> list[int]:
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
# `PrefixCache` keeps the table `match_prefix` reads: it registers each block of a sequence as
# the block fills, and forgets a block when the pool hands it out again.

# %%
# | export minirl/rollout/engine/prefix.py
class PrefixCache:
    """Hash-chained full-block prefix cache over a BlockPool (vLLM's automatic prefix caching).

    match(tokens) -> block ids to share; insert(tokens, block_table) registers the full
    blocks of a sequence whose keys/values are (or are being) computed. `hits`/`lookups`
    count tokens found / tokens asked for at admission.
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

        A registered block of the table stands for its whole prefix (its hash is chained), so
        hashing resumes after the last registered block instead of from the first.
        """
        full = len(tokens) // self.block_size
        start = full
        while start > 0 and block_table[start - 1] not in self.hash_of:
            start -= 1
        parent = self.hash_of[block_table[start - 1]] if start > 0 else None
        for i in range(start, full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, chunk)
            if parent not in self.table:                   # first copy wins; a duplicate stays private
                self.table[parent] = (block_table[i], chunk)
                self.hash_of[block_table[i]] = parent

    def forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.table.get(h, (None,))[0] == block:
            del self.table[h]

    def evictable(self) -> int:
        return 0                                           # cached blocks sit in the free list already

    def evictable_blocks(self) -> set[int]:
        return set()

    def evict(self, n: int) -> None:
        pass

# %% [markdown]
# A picture: two prompts of 10 tokens, G = 3 each, blocks of 4. The first completion of
# each prompt allocates its two full blocks and a partial one; the other two share the full
# blocks (grey, with their reference count) and own only their last, partial block.

# %%
small = PagedEngine(big, big_tok, block_size=4, num_blocks=24, cache="prefix", max_model_len=32)
pair = few_shot_prompts(2, length=10, seed=3)
for p in pair:
    for _ in range(3):
        small.add(Request(big_tok(p, add_special_tokens=False)["input_ids"][:10], 4, 0.0))
small.scheduler.schedule()                                  # admit all six: one step's worth of tables
running = small.scheduler.running
fig, ax = plt.subplots(figsize=(8, 1.6))
draw_blocks(ax, small.pool, {f"{'ab'[s.id // 3]}{s.id % 3}": s.block_table for s in running},
            "block tables after admission: " + ", ".join(f"{'ab'[s.id // 3]}{s.id % 3} {s.block_table}"
                                                         for s in running))
plt.tight_layout()
plt.show()
print(f"prompt tokens {sum(len(s.tokens) for s in running)}, to compute {sum(s.num_new for s in running)}, "
      f"found in the cache {sum(s.num_cached for s in running)}")
assert sum(s.num_cached for s in running) == 2 * 2 * 8      # 2 prompts x 2 sharers x 2 full blocks

# %% [markdown]
# The source's figure at G = 8, counted: every completion generates one token, so the run is
# all prefill, and we count the prompt tokens computed with and without the cache. The
# closed form above predicts the count exactly, which the sweep over block size and prompt
# length shows. Counts do not depend on the weights, so the sweep runs a one-layer model
# with the long-tail policy's vocabulary (`counter`), which takes a fraction of the time.

# %%
# | export minirl/rollout/engine/measure.py
def closed_form_saved(prompt_len: int, num_generations: int, block_size: int) -> float:
    """Share of prefill tokens a prefix cache saves when G completions share one prompt of P tokens.

    The first completion computes all P tokens; each of the other G - 1 reuses the prompt's
    full blocks except that the last token is always computed: bs * floor((P - 1) / bs) tokens.
    saved = (G - 1) * bs * floor((P - 1) / bs) / (G * P), which tends to 1 - 1/G for long prompts.
    """
    shared = block_size * ((prompt_len - 1) // block_size)
    return (num_generations - 1) * shared / (num_generations * prompt_len)


def prefix_savings(model, tokenizer, prompts: list[str], num_generations: int, block_size: int) -> dict:
    """Share of prompt tokens a prefix cache keeps from being prefilled, G completions per prompt, counted.

    Each run generates one token per completion, so that only the prefill is measured.
    """
    sampling = SamplingConfig(num_generations=num_generations, max_completion_length=1)
    computed = {}
    for cache in ("none", "prefix"):
        engine = PagedEngine(model, tokenizer, block_size=block_size, cache=cache)
        engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
        computed[cache] = engine.stats.prefill_tokens
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    closed = sum(closed_form_saved(n, num_generations, block_size) * n for n in lengths) / sum(lengths)
    return {"saved": 1 - computed["prefix"] / computed["none"], "closed_form": closed,
            "prefill_tokens": computed, "prompt_tokens": sum(lengths) * num_generations,
            "mean_prompt_len": sum(lengths) / len(lengths), "block_size": block_size, "G": num_generations}

# %%
ps = prefix_savings(big, big_tok, PROMPTS[:2 if SMOKE else 4], num_generations=8, block_size=16)
show([("prefill saved at G = 8", "70-80 %", pct(ps["saved"]), "agree" if 0.7 <= ps["saved"] <= 0.8 else "differ",
       f"closed form {pct(ps['closed_form'])} for ~{ps['mean_prompt_len']:.0f}-token prompts and 16-token blocks; "
       f"the limit 1 - 1/G = 87.5 % needs long prompts")],
     ("quantity", "source", "minirl", "agree?", "why"))
assert abs(ps["saved"] - ps["closed_form"]) < 1e-9
counter, _ = build_long_tail_policy(LongTailConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                                   intermediate_size=64))
sweep_bs = [(bs, prefix_savings(counter, big_tok, PROMPTS[:2], 8, bs)) for bs in (4, 8, 16, 32)]
sweep_len = [(n, prefix_savings(counter, big_tok, few_shot_prompts(2, length=n, seed=1), 8, 16))
             for n in (16, 32, 48, 96, 128, 256)]
fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
a.plot([bs for bs, _ in sweep_bs], [r["saved"] for _, r in sweep_bs], "o", label="counted")
a.plot([bs for bs, _ in sweep_bs], [r["closed_form"] for _, r in sweep_bs], "-", label="closed form")
a.set_xscale("log", base=2)
a.set_xlabel(f"block size (prompts of ~{sweep_bs[0][1]['mean_prompt_len']:.0f} tokens)")
a.set_ylabel("share of prefill saved")
lens = torch.arange(4, 300)
b.plot(lens, [closed_form_saved(int(n), 8, 16) for n in lens], "-", lw=0.8, label="closed form, block 16")
b.plot([r["mean_prompt_len"] for _, r in sweep_len], [r["saved"] for _, r in sweep_len], "o", label="counted")
b.axhline(7 / 8, color="grey", ls=":", label="1 - 1/G")
b.axhspan(0.7, 0.8, color="orange", alpha=0.15, label="source: 70-80 %")
b.set_xlabel("prompt length (tokens)")
for ax in (a, b):
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
assert all(abs(r["saved"] - r["closed_form"]) < 1e-9 for _, r in sweep_bs + sweep_len)
# saved = (G - 1)/G x shared/P, so the source's range fixes the share of the prompt a later completion recomputes
recomputed = {s: 1 - s * 8 / 7 for s in (0.8, 0.7)}
print(f"70-80 % saved at G = 8 <=> each later completion recomputes {pct(recomputed[0.8])} to {pct(recomputed[0.7])} "
      f"of its prompt (the tail after the last full block, the last token included); here "
      f"{pct(1 - ps['closed_form'] * 8 / 7)}")

# %% [markdown]
# The saving climbs towards 1 − 1/G with the prompt length and saw-tooths with the
# remainder of P − 1 modulo the block size: a prompt that ends just after a block boundary
# recomputes almost nothing, one that ends just before recomputes almost a block. Smaller
# blocks never save less of the prompt (more only where the tail after the last full block
# shrinks) but mean longer block tables and more, smaller copies.
# The source's 70–80 % fits prompts whose recomputed tail (the part after the last full
# block) is the share printed above, short prompts for 16-token blocks; it is not a property
# of G = 8 alone.

# %% [markdown]
# ## 8. A radix tree of blocks (SGLang's RadixAttention)
#
# A hash chain finds a prefix one block at a time. SGLang keeps the cached sequences in a
# radix tree instead: each edge holds a run of blocks, a node's children are keyed by the
# tokens of their first block, and a lookup walks down as far as the tokens agree. The tree
# suits multi-turn conversations (turn t + 1 starts with all of turn t, prompt and answer)
# and programs that branch one context into several calls. The tree holds a reference to its
# blocks; when the pool runs dry it evicts the least recently used leaves first, never a
# block a running sequence uses, and never a node before its children.

# %%
# | export minirl/rollout/engine/radix.py
"""A radix-tree prefix cache with LRU eviction, SGLang's RadixAttention at block granularity.

The cached token sequences form a tree: each edge holds a run of full blocks (their tokens
and block ids) and each node's children are keyed by the tokens of their first block. A
lookup walks down from the root as far as the tokens agree; an insertion walks the same way,
splits an edge where the new sequence departs from it, and hangs the rest as a new leaf.
This suits multi-turn and branching prompts: turn t + 1 of a conversation starts with all of
turn t (prompt and answer), and branches of one context share their trunk.

The tree holds a reference to each of its blocks, so cached blocks are not in the free list:
when the pool runs dry the scheduler asks the tree to `evict`, and the tree frees blocks
from the least recently used leaves first (a running sequence's blocks are never evicted:
their reference count is above the tree's own 1). An inner node goes only after its children.

Simplified vs SGLang: whole blocks only (SGLang can match single tokens); no cache-aware
reordering of the waiting queue (SGLang serves the longest shared prefix first).
"""

import heapq
import itertools

from minirl.rollout.engine.blocks import BlockPool


class Node:
    """A tree node: the edge from its parent (tokens and the blocks that hold them) and its children."""

    __slots__ = ("parent", "first", "tokens", "blocks", "children", "last_access")

    def __init__(self, parent, tokens: tuple, blocks: list[int], clock: int, block_size: int):
        self.parent, self.tokens, self.blocks = parent, tokens, blocks
        self.first = tokens[:block_size]             # the key under which the parent finds it
        self.children: dict[tuple, "Node"] = {}
        self.last_access = clock

# %% [markdown]
# The tree itself, and how it is read: `match` walks down from the root as far as whole blocks
# agree. The next two cells add to it (`insert`) and take from it (`evict`, least-recently-used
# leaves first, never a block a running sequence still holds).

# %%
# | export minirl/rollout/engine/radix.py
class RadixCache:
    """Prefix cache over a BlockPool as a radix tree of block runs; same interface as PrefixCache."""

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
                    child.tokens[n * self.block_size:(n + 1) * self.block_size] == self.chunk(tokens, len(blocks)):
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
# Inserting a sequence's full blocks: walk down as far as the tree agrees, split the edge where the
# sequence leaves it midway, and hang the rest below as a new leaf that holds a reference to each
# of its blocks.

# %%
# | export minirl/rollout/engine/radix.py
@add_to_class(RadixCache)
def insert(self, tokens: list[int], block_table: list[int]) -> None:
    """Add the full blocks of `tokens` (held in `block_table`) to the tree, sharing what is there."""
    full = len(tokens) // self.block_size
    found, node, n = self.walk(tokens, full)
    if n < len(node.blocks):                     # the sequence leaves this edge midway: split it
        node = self.split(node, n)
    if len(found) < full:
        bs = self.block_size
        leaf = Node(node, tuple(tokens[len(found) * bs:full * bs]), list(block_table[len(found):full]),
                    next(self.clock), bs)
        node.children[leaf.first] = leaf
        for b in leaf.blocks:
            self.pool.retain(b)
            self.held.add(b)


@add_to_class(RadixCache)
def split(self, node: Node, n: int) -> Node:
    """Cut `node`'s edge after n blocks; returns the new upper node (the old one hangs below it)."""
    bs = self.block_size
    upper = Node(node.parent, node.tokens[:n * bs], node.blocks[:n], node.last_access, bs)
    node.parent.children[upper.first] = upper
    node.tokens, node.blocks, node.parent = node.tokens[n * bs:], node.blocks[n:], upper
    node.first = node.tokens[:bs]
    upper.children[node.first] = node
    return upper

# %% [markdown]
# Eviction: only blocks the tree alone holds, with nothing in use below them, can be freed; `evict`
# takes least-recently-used leaves first, each from its last block back, so a shared prefix goes last.

# %%
# | export minirl/rollout/engine/radix.py
@add_to_class(RadixCache)
def evictable_blocks(self) -> set[int]:
    """Blocks `evict` can free: held by the tree alone, with nothing below them in use.

    A block is in use when its reference count exceeds the tree's own 1. Usually a block in
    use keeps its whole path in use, but a sequence that computed a duplicate of a tree block
    (the last prompt block is always computed) can hold a deeper block and not the tree's copy
    of an earlier one: that earlier block must wait for the deeper one (evicting it would
    orphan the subtree).
    """
    free: set[int] = set()

    def visit(node) -> bool:                     # True: the whole subtree is evictable
        below = all([visit(child) for child in node.children.values()])
        for b in reversed(node.blocks):
            if not below or self.pool.ref[b] != 1:
                return False
            free.add(b)
        return below

    visit(self.root)
    return free


@add_to_class(RadixCache)
def evictable(self) -> int:
    return len(self.evictable_blocks())


@add_to_class(RadixCache)
def evict(self, n: int) -> int:
    """Free up to n blocks, least recently used leaves first, each leaf from its last block back."""
    heap = [(node.last_access, id(node), node) for node in self.nodes() if not node.children]
    heapq.heapify(heap)
    freed = 0
    while freed < n and heap:
        _, _, node = heapq.heappop(heap)
        while node.blocks and freed < n and self.pool.ref[node.blocks[-1]] == 1:
            block = node.blocks.pop()
            node.tokens = node.tokens[:-self.block_size]
            self.held.discard(block)
            self.pool.release(block)
            freed += 1
        if not node.blocks:
            parent = node.parent
            del parent.children[node.first]
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
    return freed


@add_to_class(RadixCache)
def nodes(self):
    stack = list(self.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())

# %% [markdown]
# A multi-turn workload: 8 conversations of 4 turns (3 of 3 in smoke mode); each turn's
# prompt is the previous prompt, the previous answer (greedy, at most 24 tokens; 12 in smoke
# mode) and a new message of about 24 tokens. We count the share of prompt tokens found in
# the cache, with a roomy cache and with one too small to keep every conversation.

# %%
# | export minirl/rollout/engine/measure.py
def multi_turn(model, tokenizer, first: list[str], follow_ups: list[list[str]], max_tokens: int, cache: str,
               num_blocks: int | None = None, block_size: int = 16, seed: int = 0) -> dict:
    """A multi-turn workload: turn t + 1 of conversation c is turn t's prompt and answer plus a new message.

    first: the opening message of each conversation; follow_ups[t][c]: the message of
    conversation c at turn t + 1. Every turn is one `run` of all conversations (greedy).
    Returns the share of prompt tokens found in the cache, over all turns and from turn 2 on.
    """
    engine = PagedEngine(model, tokenizer, block_size=block_size, cache=cache, num_blocks=num_blocks)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    prompts = [encode(text) for text in first]
    hits, totals = [], []
    for turn in range(len(follow_ups) + 1):
        seqs = engine.run([Request(p, max_tokens, 0.0) for p in prompts])
        hits.append(engine.stats.cached_tokens)
        totals.append(engine.stats.prompt_tokens)
        if turn < len(follow_ups):
            answers = [[t for t in s.completion if t != tokenizer.eos_token_id] for s in seqs]
            prompts = [p + a + encode(m) for p, a, m in zip(prompts, answers, follow_ups[turn], strict=True)]
    return {"hit_rate": sum(hits) / sum(totals), "hit_rate_after_first": sum(hits[1:]) / max(1, sum(totals[1:])),
            "per_turn": [h / t for h, t in zip(hits, totals, strict=True)], "prompt_tokens": totals}

# %%
C, TURNS, ANSWER = (3, 3, 12) if SMOKE else (8, 4, 24)
first = few_shot_prompts(C, length=48, seed=10)
follow = [few_shot_prompts(C, length=24, seed=11 + t) for t in range(TURNS - 1)]
rows, hit = [], {}
for blocks, label in ((None, "roomy"), (32 if SMOKE else 64, "tight")):
    for cache in ("none", "prefix", "radix"):
        mt = multi_turn(big, big_tok, first, follow, max_tokens=ANSWER, cache=cache, num_blocks=blocks)
        hit[label, cache] = mt["hit_rate"]
        rows.append((label, cache, pct(mt["hit_rate"]), pct(mt["hit_rate_after_first"]),
                     " ".join(f"{h:.2f}" for h in mt["per_turn"])))
show(rows, ("cache size", "cache", "hit rate", "from turn 2", "per turn"))
for label in ("roomy", "tight"):
    gap = hit[label, "radix"] - hit[label, "prefix"]
    print(f"{label}: radix - prefix hit rate = {100 * gap:+.1f} points: "
          + ("the same prefixes found" if abs(gap) < 1e-9 else "the two caches part ways"))
assert float(rows[2][3].split()[0]) > 50 and float(rows[0][2].split()[0]) == 0

# %% [markdown]
# With room for everything the two caches must find the same prefixes (the first line under
# the table): at block granularity a hash chain and a tree describe the same sets of blocks,
# and every turn after the first finds all of its history (earlier prompts and answers)
# except the last, partly filled block; only that block and the new message are computed.
# They can part ways under memory pressure, where what gets evicted decides what is found:
# the tree evicts whole least-recently-used branches from their leaves, the hash cache
# reuses freed blocks in the order they were freed. Whether this workload's tight cache is
# tight enough for that to show is the second line (in smoke mode, with 3 short
# conversations, it need not be). SGLang's further advantages are not built here: matching single
# tokens rather than whole blocks, and serving the waiting request with the longest cached
# prefix first. The source gives no figure for RadixAttention; the table above is ours.

# %% [markdown]
# ## 9. Speculative decoding
#
# A decode step computes one token per sequence, which on a GPU leaves the arithmetic units
# mostly idle: the weights are read from memory for very little work. Speculative decoding
# lets a cheap **draft** propose k tokens and has the target check all of them in one
# forward pass over k + 1 positions. Draft token i is kept with probability
# min(1, p_i(d_i) / q_i(d_i)) while every earlier one was kept; at the first rejection a
# replacement is drawn from max(0, p_i − q_i), renormalized; if all k pass, a bonus token is
# drawn from p_{k+1}. Every emitted token is then distributed exactly as the target alone
# would sample it (exercise 5.4 is this rule). Two drafts: a smaller model with the same
# vocabulary, and n-gram prompt lookup, which proposes what followed the last occurrence of
# the current n-gram earlier in the sequence (free to compute).

# %%
# | export minirl/rollout/engine/speculative.py
"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

Each round, for every running sequence: the draft proposes d_1..d_k with probabilities
q_i(d_i); the target computes its distributions p_1..p_{k+1} at all k+1 positions in one
forward pass (the last accepted token and the k drafts); `accept_draft` keeps each d_i with
probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection, where it samples a
replacement from max(0, p_i - q_i) (renormalized); if all k are kept it samples a bonus token
from p_{k+1}. Every emitted token is then distributed exactly as the target alone would have
sampled it (Leviathan et al. 2023, Chen et al. 2023), so its behaviour log-prob is log p_i.

Two drafts: `ModelDraft` (a small model with the same vocabulary, its own paged cache) and
`NgramDraft` (prompt lookup: the tokens that followed the last occurrence of the current
n-gram earlier in the sequence; free to compute, a point mass q).

Simplified vs vLLM: a fixed k for all sequences, no tree of drafts; a step that admits new
sequences runs as a plain step (prefill + one decode token), only pure decode steps speculate.
"""

import copy
import time

import torch
from torch import Tensor

from minirl.rollout.engine.attention import Chunk, PagedModel, make_step
from minirl.rollout.engine.blocks import BlockPool, blocks_needed
from minirl.rollout.sampling import sample_tokens


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
    p_draft = p[:, :k].gather(2, draft[..., None]).squeeze(2)                     # [S, k]
    q_draft = q.gather(2, draft[..., None]).squeeze(2)                            # [S, k]
    u = torch.rand(S, k, generator=generator, device=p.device)
    kept = u * q_draft < p_draft                                                  # u < p/q, without dividing by 0
    accepted = kept.long().cumprod(1).sum(1)                                      # [S] the leading run
    rows = torch.arange(S, device=p.device)
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], 1)                      # [S, k+1, V]: q = 0 after the drafts
    residual = (p[rows, accepted] - q_padded[rows, accepted]).clamp(min=0)       # [S, V]
    next_token = torch.multinomial(residual / residual.sum(1, keepdim=True), 1, generator=generator).squeeze(1)
    return accepted, next_token
    # END SOLUTION

# %%
# | export minirl/rollout/engine/speculative.py
def sampling_logprobs(logits: Tensor, temperatures: Tensor) -> Tensor:
    """log_softmax(logits / temperature), at temperature 1 where it is 0: what `sample_tokens` records.

    logits: [S, n, V] float32; temperatures: [S]. The verifier's behaviour log-probs.
    """
    t = temperatures[:, None, None]
    return torch.log_softmax(logits / torch.where(t == 0, 1.0, t), -1)


def probabilities(logits: Tensor, temperatures: Tensor) -> Tensor:
    """The distribution `sample_tokens` draws from: exp(sampling_logprobs), a one-hot argmax at temperature 0.

    logits: [S, n, V] float32; temperatures: [S]. The target's p and the model draft's q.
    """
    hard = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.where(temperatures[:, None, None] == 0, hard, sampling_logprobs(logits, temperatures).exp())

# %% [markdown]
# The first draft, free to compute: prompt lookup proposes the tokens that followed the last
# occurrence of the current n-gram, with a point mass q (a draft that is certain).

# %%
# | export minirl/rollout/engine/speculative.py
class NgramDraft:
    """Prompt lookup: propose the k tokens that followed the latest earlier occurrence of the last n tokens.

    Tries n, n-1, ..., 1; with no occurrence (or fewer than k tokens after it) it proposes the
    last token repeated, which the target will mostly reject. q is a point mass on each proposal.
    """

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"NgramDraft: n={n} must be >= 1")
        self.n = n

    def attach(self, engine) -> None:
        self.vocab_size = engine.model.vocab_size

    def reset(self) -> None:
        pass

    def release(self, seq) -> None:
        pass

    def rollback(self, seq, valid: int) -> None:
        pass

    def grow(self, num_blocks: int) -> None:
        pass

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.n, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [tokens[-1]] * k

    def propose(self, seqs, k: int, generator=None) -> tuple[Tensor, Tensor]:
        draft = torch.tensor([self.lookup(s.tokens, k) for s in seqs])                # [S, k]
        q = torch.nn.functional.one_hot(draft, self.vocab_size).float()               # [S, k, V]
        return draft, q

# %% [markdown]
# The second draft, a small model: it keeps its own paged cache (its own blocks for each
# sequence), proposes k tokens by sampling, and rolls its cache back to what was accepted.

# %%
# | export minirl/rollout/engine/speculative.py
class ModelDraft:
    """A small causal LM with the target's vocabulary as the draft, with its own paged cache.

    It keeps, per target sequence, a block table and how many of the sequence's tokens it has
    computed; each round it catches up on the tokens it has not seen (1 or 2 after a round,
    the whole prompt the first time), then samples k tokens one step at a time.
    """

    def __init__(self, model):
        self.source = model

    def attach(self, engine) -> None:
        target_vocab, vocab = engine.model.vocab_size, self.source.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"ModelDraft: the draft's vocab_size={vocab} differs from the target's {target_vocab}; "
                             "speculation compares probabilities token by token, so both must share one tokenizer")
        p = next(engine.model.model.parameters())
        self.model = PagedModel(copy.deepcopy(self.source).to(p.device, p.dtype).eval())
        self.block_size, self.num_blocks = engine.block_size, engine.num_blocks
        self.model.allocate_cache(self.num_blocks, self.block_size)
        self.device = p.device
        self.reset()

    def reset(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.state: dict[int, tuple[list[int], int]] = {}     # seq id -> (block table, tokens computed)

    def grow(self, num_blocks: int) -> None:
        """The target's cache grew: so does the draft's (one block per target block)."""
        self.model.grow_cache(num_blocks)
        self.pool.grow(num_blocks)
        self.num_blocks = num_blocks

    def release(self, seq) -> None:
        table, _ = self.state.pop(seq.id, ([], 0))
        for b in table:
            self.pool.release(b)

# %% [markdown]
# Proposing: each sequence catches up on the tokens the draft has not computed, then the draft
# samples k tokens one step at a time, keeping the probabilities it drew from; `rollback` forgets
# the keys and values of rejected drafts.

# %%
# | export minirl/rollout/engine/speculative.py
@add_to_class(ModelDraft)
def propose(self, seqs, k: int, generator=None) -> tuple[Tensor, Tensor]:
    temperatures = torch.tensor([s.temperature for s in seqs], device=self.device)
    drafts, qs = [], []
    chunks = []
    for s in seqs:
        table, done = self.state.get(s.id, ([], 0))
        while len(table) < blocks_needed(len(s.tokens) + k - 1, self.block_size):
            table.append(self.pool.allocate())
        self.state[s.id] = (table, len(s.tokens) + k - 1)
        chunks.append(Chunk(s.tokens[done:], done, table))
    position = [len(s.tokens) for s in seqs]
    for i in range(k):
        logits = self.model(make_step(chunks, self.block_size, self.model.n_rep, self.device))   # [S, V]
        token, _ = sample_tokens(logits, temperatures, generator)      # [S]: notebook 01's sampling step
        q = probabilities(logits[:, None], temperatures)[:, 0]         # [S, V]: what it drew from
        drafts.append(token)
        qs.append(q)
        tokens = token.tolist()
        chunks = [Chunk([t], position[j] + i, self.state[s.id][0])
                  for j, (s, t) in enumerate(zip(seqs, tokens, strict=True))]
    return torch.stack(drafts, 1), torch.stack(qs, 1)                                           # [S, k], [S, k, V]


@add_to_class(ModelDraft)
def rollback(self, seq, valid: int) -> None:
    """Only the first `valid` tokens of `seq` have keys/values the draft computed from accepted tokens."""
    if seq.id in self.state:
        table, done = self.state[seq.id]
        self.state[seq.id] = (table, min(done, valid))

# %% [markdown]
# One round for every decoding sequence: propose k tokens, verify the k + 1 positions in one
# forward pass of the target, keep what `accept_draft` accepts and roll the draft back.

# %%
# | export minirl/rollout/engine/speculative.py
def speculative_step(engine, seqs, generator=None) -> None:
    """One round for decoding sequences: propose k, verify k + 1 positions in one pass, keep what passes."""
    k = engine.k
    clock = time.perf_counter()
    draft, q = engine.draft.propose(seqs, k, generator)                                # [S, k], [S, k, V]
    clock = engine.tick("draft", clock)
    drafts = draft.tolist()
    chunks = [Chunk([s.tokens[-1]] + d, s.num_computed, s.block_table, k + 1)
              for s, d in zip(seqs, drafts, strict=True)]
    step = make_step(chunks, engine.block_size, engine.model.n_rep, engine.device)
    clock = engine.tick("prepare", clock)
    logits = engine.model(step).view(len(seqs), k + 1, -1)                             # [S, k+1, V]
    clock = engine.tick("forward", clock)
    temperatures = torch.tensor([s.temperature for s in seqs], device=logits.device)
    accepted, next_token = accept_draft(probabilities(logits, temperatures), q.to(logits.device),
                                        draft.to(logits.device), generator)
    logp = sampling_logprobs(logits, temperatures)                                      # [S, k+1, V]
    clock = engine.tick("sample", clock)
    engine.stats.decode_tokens += len(seqs) * (k + 1)
    engine.stats.draft_tokens += len(seqs) * k
    engine.stats.accepted_tokens += int(accepted.sum())
    engine.stats.verified_rows += len(seqs)
    for i, (s, a, nxt) in enumerate(zip(seqs, accepted.tolist(), next_token.tolist(), strict=True)):
        tokens = drafts[i][:a] + [nxt]
        logprobs = logp[i, torch.arange(a + 1), torch.tensor(tokens)].tolist()
        s.num_computed += 1 + a
        engine.draft.rollback(s, len(s.tokens) + min(a, k - 1))
        engine.append(s, tokens, logprobs)
    engine.tick("postprocess", clock)

# %% [markdown]
# A check that the rule keeps the target's distribution, on a vocabulary of 4: bigram
# "models" p (target) and q (draft), k = 3, and the first three emitted tokens of 4,000
# speculative runs against the exact target probabilities (a chi-square test, three seeds;
# the graded check of exercise 5.4 runs the same test with more samples). For a correct rule
# the p-value is uniform between 0 and 1 from seed to seed; for a wrong one it collapses.
# With k = 3 the bonus token is the 4th token of a round at the earliest, so this test never
# sees it: the graded check adds a second test where every draft is kept (q = p at the draft
# positions) and the token after them must follow p_{k+1}, not p_k nor max(0, p_{k+1} − q_k).

# %%
def bigram_speculation(accept, n=4000, V=4, k=3, seed=0):
    """(p-value, chi2) of the first 3 tokens of n speculative runs from token 0 against the target's joint."""
    mats = torch.Generator().manual_seed(1234)
    P = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=mats) * 1.5, -1)
    g = torch.Generator().manual_seed(seed)
    out, filled = torch.full((n, 3), -1), torch.zeros(n, dtype=torch.long)
    last, rows_ = torch.zeros(n, dtype=torch.long), torch.arange(n)
    while int(filled.min()) < 3:
        drafts, qs, prev = [], [], last
        for _ in range(k):
            qs.append(Q[prev])
            drafts.append(torch.multinomial(qs[-1], 1, generator=g).squeeze(1))
            prev = drafts[-1]
        draft = torch.stack(drafts, 1)
        a, nxt = accept(P[torch.cat([last[:, None], draft], 1)], torch.stack(qs, 1), draft, g)
        for j in range(k + 1):
            token = torch.where(j < a, draft[:, min(j, k - 1)], nxt)
            ok = (j <= a) & (filled < 3)
            out[rows_[ok], filled[ok]] = token[ok]
            filled = filled + ok.long()
        last = nxt
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    t1, t2, t3 = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    expected = (P[0][t1] * P[t1, t2] * P[t2, t3]).flatten().double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V ** 3 - 1) / 2, dtype=torch.double), chi2 / 2)), float(chi2)


def greedy_acceptance(p, q, draft, generator=None):
    """A plausible mistake: keep a draft token whenever the target likes it at least as much as the draft."""
    S, k = draft.shape
    kept = p[:, :k].gather(2, draft[..., None]).squeeze(2) >= q.gather(2, draft[..., None]).squeeze(2)
    accepted = kept.long().cumprod(1).sum(1)
    return accepted, torch.multinomial(p[torch.arange(S), accepted], 1, generator=generator).squeeze(1)


pvalues = {}
for name, rule in (("accept_draft", accept_draft), ("keep if p >= q (wrong)", greedy_acceptance)):
    pvalues[name] = [bigram_speculation(rule, seed=seed) for seed in (1, 2, 3)]
    print(f"{name:>22}: chi2 on 63 degrees of freedom " + ", ".join(f"{c:.0f}" for _, c in pvalues[name])
          + "; p-values " + ", ".join(f"{p:.2g}" for p, _ in pvalues[name]))
assert all(p > 1e-4 for p, _ in pvalues["accept_draft"]) and all(p < 1e-6 for p, _ in pvalues["keep if p >= q (wrong)"])

# %% [markdown]
# Now measured, in two regimes. First the GRPO case: the embedded policy as target and a
# policy about 8× smaller, warm-started the same way (in smoke mode an untrained one), as
# draft; 16 prompts × G = 8 (2 × 8 in smoke mode) sampled at temperature 1, and one
# sequence alone, the latency case the source has in mind. Second, n-gram lookup on the
# long-tail policy decoding greedily at batch size 1: greedy decoding of a random model either
# stops at once or falls into a loop, which a lookup predicts (we take the first prompt that
# loops), a stand-in for outputs that copy their context (code edits, extraction).

# %%
# | export minirl/rollout/engine/measure.py
def speculative_sweep(model, tokenizer, make_draft, requests: list[Request], ks: list[int], repeats: int = 3,
                      block_size: int = 16, seed: int = 0, progress: str | None = None) -> dict:
    """Acceptance rate, tokens per verification and speedup (tokens/s over plain decoding) for each k.

    make_draft() -> a fresh draft (ModelDraft or NgramDraft). acceptance: accepted / proposed
    drafts; tokens_per_round: tokens a sequence gains per verification pass (accepted + 1).
    progress: the label of a bar over the runs (`interleaved`, which names them by k; 0 is plain decoding).
    """
    engines = {0: PagedEngine(model, tokenizer, block_size=block_size)}
    engines |= {k: PagedEngine(model, tokenizer, block_size=block_size, draft=make_draft(),
                               num_speculative_tokens=k) for k in ks}
    tokens, accepted, per_round = {}, {}, {}

    def run(k):
        engine = engines[k]
        engine.reset()
        seqs = engine.run(requests, torch.Generator().manual_seed(seed))
        tokens[k] = sum(len(s.completion) for s in seqs)
        stats = engine.stats
        accepted[k] = stats.accepted_tokens / max(1, stats.draft_tokens)
        per_round[k] = (stats.accepted_tokens + stats.verified_rows) / max(1, stats.verified_rows)

    seconds = interleaved({k: (lambda k=k: run(k)) for k in engines}, repeats, progress)
    rate = {k: tokens[k] / statistics.median(seconds[k]) for k in engines}
    return {"acceptance": {k: accepted[k] for k in ks}, "tokens_per_round": {k: per_round[k] for k in ks},
            "speedup": {k: rate[k] / rate[0] for k in ks}, "tokens_per_s": rate, "seconds": seconds}


def speculative_speedup(tokens_per_round: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Speedup of speculation over plain decoding when costs are counted in target decode steps.

    Each round the draft runs k steps of `draft_cost` each and the target one pass over k + 1
    tokens costing `verify_cost` decode steps; it yields `tokens_per_round` tokens, where plain
    decoding yields 1 per step. On a GPU a decode step is memory-bound, so verify_cost ~ 1 and
    a draft ~20x smaller has draft_cost ~0.05; on a CPU both grow with the work.
    """
    return tokens_per_round / (k * draft_cost + verify_cost)

# %%
from minirl.models.policy import build_policy, build_tokenizer
from minirl.rollout.engine.workloads import DRAFT_POLICY, load_draft_policy

draft_model = build_policy(DRAFT_POLICY, build_tokenizer()).eval() if SMOKE else load_draft_policy()[0]
print(f"draft: {sum(p.numel() for p in draft_model.parameters()) / 1e3:.0f} k parameters; target "
      f"{sum(p.numel() for p in policy.parameters()) / 1e3:.0f} k")
ks = [1, 3] if SMOKE else [1, 2, 3, 4]


def looping_prompt(model, tok, prompts: list[str]) -> list[int]:
    """The first prompt whose greedy continuation runs 16 tokens without EOS (some end at once)."""
    for text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):]
        if len(out) == 16 and tok.eos_token_id not in out.tolist():
            return ids
    raise RuntimeError("no prompt loops under greedy decoding: the n-gram workload needs one")


encode = lambda texts: [policy_tok(t, add_special_tokens=False)["input_ids"] for t in texts]   # noqa: E731
grpo_prompts = [r["prompt"] for r in TASK.rows("train")[:2 if SMOKE else 16]]
workloads_ = {
    "GRPO batch": (policy, policy_tok, lambda: ModelDraft(draft_model),
                   [Request(x, 4, 1.0) for x in encode(grpo_prompts) for _ in range(8)], 4),
    "batch 1": (policy, policy_tok, lambda: ModelDraft(draft_model),
                [Request(x, 4, 1.0) for x in encode(grpo_prompts[:1])], 4),
    "n-gram, batch 1": (big, big_tok, lambda: NgramDraft(3),
                        [Request(looping_prompt(big, big_tok, PROMPTS), 24 if SMOKE else 128, 0.0)], 16),
}
spec = {}
for name, (model, tok, make, reqs, bs) in workloads_.items():
    spec[name] = speculative_sweep(model, tok, make, reqs, ks, repeats=1 if SMOKE else 3, block_size=bs,
                                   progress=f"{name}, k = 0 (plain), {', '.join(map(str, ks))}")
rows = []
for name, r in spec.items():
    for k in ks:
        rows.append((name, k, pct(r["acceptance"][k]), f"{r['tokens_per_round'][k]:.2f}", f"{r['speedup'][k]:.2f}x"))
show(rows, ("workload", "k", "acceptance", "tokens per verification", "speedup (tokens/s)"))

# %% [markdown]
# The cost model says why the speedups are what they are. Count everything in target decode
# steps: a round costs k draft steps of relative cost c and one verification of k + 1
# tokens of relative cost v(k), and yields the tokens per verification printed above, where
# plain decoding yields 1 per step. We measure c and v on this CPU at batch size 1, and put
# beside them the GPU regime, where a decode step of a large target is memory-bound
# (v ≈ 1) and a draft 10–50× smaller costs c ≈ 0.05.

# %%
k_show = ks[-1]
target_1 = step_seconds(policy, 1, 1, 8, block_size=4)
verify = step_seconds(policy, 1, k_show + 1, 8, block_size=4)
draft_1 = step_seconds(draft_model, 1, 1, 8, block_size=4)
c_cpu, v_cpu = draft_1 / target_1, verify / target_1
rows_n = len(workloads_["GRPO batch"][3])
target_n = step_seconds(policy, rows_n, 1, 8, block_size=4)
c_batch = step_seconds(draft_model, rows_n, 1, 8, block_size=4) / target_n
v_batch = step_seconds(policy, rows_n, k_show + 1, 8, block_size=4) / target_n
r1 = spec["batch 1"]
rows = [("this CPU, 1 row (measured)", f"{c_cpu:.2f}", f"{v_cpu:.2f}",
         f"{speculative_speedup(r1['tokens_per_round'][k_show], k_show, c_cpu, v_cpu):.2f}x",
         f"{r1['speedup'][k_show]:.2f}x"),
        (f"this CPU, {len(workloads_['GRPO batch'][3])} rows (measured)", f"{c_batch:.2f}", f"{v_batch:.2f}",
         f"{speculative_speedup(spec['GRPO batch']['tokens_per_round'][k_show], k_show, c_batch, v_batch):.2f}x",
         f"{spec['GRPO batch']['speedup'][k_show]:.2f}x"),
        ("GPU regime (assumed)", "0.05", "1.00",
         f"{speculative_speedup(r1['tokens_per_round'][k_show], k_show, 0.05, 1.0):.2f}x", "-")]
show(rows, ("costs", "draft step c", f"verify {k_show + 1} tokens v", f"model speedup, k={k_show}", "measured"))
gpu_speedup = speculative_speedup(r1["tokens_per_round"][k_show], k_show, 0.05, 1.0)
print(f"\nin a batch of {rows_n}, verifying {k_show + 1} tokens per row costs {v_batch:.2f} decode steps "
      f"({'more than' if v_batch > 1 else 'no more than'} one); with a GPU's costs the acceptance measured at batch 1 "
      f"({r1['tokens_per_round'][k_show]:.2f} tokens per verification, break-even {1 + k_show * 0.05:.2f}) gives "
      f"{gpu_speedup:.2f}x: {'a speedup' if gpu_speedup > 1 else 'no speedup'}")
ngram = spec["n-gram, batch 1"]
v_big = step_seconds(big, 1, k_show + 1, 128) / step_seconds(big, 1, 1, 128)
print(f"n-gram, batch 1, k={k_show}: verifying {k_show + 1} tokens costs {v_big:.2f} decode steps of the long-tail "
      f"policy ({v_big - 1:+.0%} over one step); the draft is free (c = 0): model speedup "
      f"{speculative_speedup(ngram['tokens_per_round'][k_show], k_show, 0.0, v_big):.2f}x, measured "
      f"{ngram['speedup'][k_show]:.2f}x\n")
model_best = max(max(spec["GRPO batch"]["speedup"].values()), max(r1["speedup"].values()))
ngram_best = max(ngram["speedup"].values())
show([("speculation, model draft", "2-3x", f"{model_best:.2f}x", "agree" if 2 <= model_best <= 3 else "differ",
       f"<= 4-token answers; the draft costs c = {c_cpu:.2f} target steps here (~0.05 on a GPU), and verifying "
       f"{k_show + 1} tokens in a batch of {rows_n} costs {v_batch:.1f} steps (~1 on a GPU)"),
      ("speculation, n-gram lookup", "2-3x", f"{ngram_best:.2f}x", "agree" if 2 <= ngram_best <= 3 else "differ",
       f"one sequence, a free draft accepted {pct(max(ngram['acceptance'].values()))} of the time "
       "(a loop: the best case for a lookup, so it may land above the source's range)")],
     ("quantity", "source", "minirl (best k)", "agree?", "why"))


# %% [markdown]
# Read the two regimes together. With the model draft the answers are at most 4 tokens,
# so a verification can gain little, and the cost model leaves out what a round costs besides
# the steps: the draft's own prefill of every prompt and the Python of the round, a large share
# of the work for answers this short (compare the model's speedup with the measured one; on a
# shared machine the two can differ either way). In a
# batch, verifying k + 1 tokens per row costs v decode steps (printed above, against one),
# because a CPU's step grows with the work in it; where v is above one and few drafts are
# kept, speculation adds work instead of saving it. When the draft is free and right (n-gram
# lookup on repetitive output) and the batch is one sequence, a verification costs the v
# printed for it (the share over one step beside it), and the cost model's prediction
# tokens per verification / v is printed beside the measured gain.
# With a GPU's costs (last row of the cost table) a round of k drafts breaks even at
# 1 + 0.05 k tokens per verification; the line above says whether the acceptance measured here
# clears it (an untrained draft, in smoke mode, does not). Speculation pays when a decode
# step is memory-bound and the draft is much cheaper than the target and often right, which
# is why it suits short, latency-sensitive responses rather than large RL batches, where a
# step is no longer memory-bound.

# %% [markdown]
# ## 10. Faster than HF generate, and where the time goes
#
# The whole engine against HF `generate` on the same model, prompts, G and length limit,
# called alternately. HF computes all B × G rows at every step until the longest completion
# ends and prefills each prompt G times; the engine drops a sequence at its EOS and prefills
# each prompt's full blocks once. The two engines sample different completions (other random
# streams), so we report both tokens per second and the time to finish the same batch.
# (The notebook runs a reduced workload; `python benchmarks/engine_vs_hf.py` runs the full
# one, with repeats, at both thread counts, and ends with `speedup_vs_hf: X`.)

# %%
# | export minirl/rollout/engine/measure.py
def versus_hf(model, tokenizer, prompts: list[str], sampling: SamplingConfig, block_size: int = 16, repeats: int = 3,
              seed: int = 0, log=None, kv_cache_bytes: int | None = None) -> dict:
    """The paged engine against HF generate (`HFEngine`) on the same model, prompts, G and length limit.

    One unmeasured call each first, then paged, HF, paged, ... `repeats` times. The paged
    engine's cache is emptied before every call (as a weight update would). Compared: generated
    tokens (up to and including EOS) per second, `speedup` the median over repeats of the ratio
    within a repeat (the two calls of a repeat see about the same machine load); and the time
    to finish the batch, `finish_speedup` likewise. The completions differ (other random
    streams), so token counts differ a little. Also returns the engine's median seconds per
    phase and token counts, and HF's work: prompt tokens prefilled and rows x steps decoded.
    kv_cache_bytes: the paged engine's cache budget (default: sized to the work).
    """
    engines = {"paged": PagedEngine(model, tokenizer, block_size=block_size, kv_cache_bytes=kv_cache_bytes),
               "hf": HFEngine(model, tokenizer)}
    for engine in engines.values():
        engine.generate(prompts[:1], sampling, generator=torch.Generator().manual_seed(seed))
    seconds, tokens = {k: [] for k in engines}, {k: [] for k in engines}
    phases, counts, hf_rows = [], [], []
    for r in range(repeats):
        for kind, engine in engines.items():
            if kind == "paged":
                engine.reset()
            start = time.perf_counter()
            rollout = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed + r))
            seconds[kind].append(time.perf_counter() - start)
            tokens[kind].append(int(rollout.completion_mask.sum()))
            if kind == "paged":
                phases.append(dict(engine.stats.seconds))
                counts.append({k: getattr(engine.stats, k) for k in ("prompt_tokens", "cached_tokens", "prefill_tokens",
                                                                      "decode_tokens", "steps")})
            else:
                hf_rows.append(rollout.completion_ids.numel())            # B*G rows x the longest completion
        if log is not None:
            log(f"repeat {r + 1}/{repeats}: paged {seconds['paged'][-1]:.2f} s ({tokens['paged'][-1]} tokens), "
                f"hf {seconds['hf'][-1]:.2f} s ({tokens['hf'][-1]} tokens)")
    rates = {k: [t / s for t, s in zip(tokens[k], seconds[k], strict=True)] for k in engines}     # per repeat
    ratios = [p / h for p, h in zip(rates["paged"], rates["hf"], strict=True)]                   # within a repeat
    finish = [h / p for p, h in zip(seconds["paged"], seconds["hf"], strict=True)]
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    return {"prompts": len(prompts), "num_generations": sampling.num_generations,
            "max_completion_length": sampling.max_completion_length, "block_size": block_size, "repeats": repeats,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "speedup": statistics.median(ratios), "speedups": ratios,
            "finish_speedup": statistics.median(finish), "finish_speedups": finish,
            "paged_phase_seconds": {p: statistics.median(x[p] for x in phases) for p in phases[0]},
            "paged_counts": {c: statistics.median(x[c] for x in counts) for c in counts[0]},
            "hf_prefill_tokens": prompt_tokens * sampling.num_generations,
            "hf_rows_x_steps": statistics.median(hf_rows)}

# %%
vs = versus_hf(big, big_tok, PROMPTS[:2 if SMOKE else 8], sampling, block_size=16, repeats=1)
c = vs["paged_counts"]
show([(k, f"{vs['tokens_per_s'][k]:.0f}", f"{statistics.median(vs['seconds'][k]):.2f}",
       f"{statistics.median(vs['tokens'][k]):.0f}") for k in ("paged", "hf")],
     ("engine", "tokens/s", "seconds to finish the batch", "tokens generated"))
print(f"\nspeedup: {vs['speedup']:.2f}x in tokens/s, {vs['finish_speedup']:.2f}x in time to finish.  HF prefilled "
      f"{vs['hf_prefill_tokens']} prompt tokens and decoded {vs['hf_rows_x_steps']:.0f} row-steps; the engine "
      f"prefilled {c['prefill_tokens']:.0f} ({c['cached_tokens']:.0f} found in its cache) and decoded "
      f"{c['decode_tokens']:.0f} tokens in {c['steps']:.0f} steps")
phases = vs["paged_phase_seconds"]
total = sum(phases.values())
show([(p, f"{s:.3f}", pct(s / total)) for p, s in phases.items() if s > 0], ("engine phase", "seconds", "share"))
print(f"\nthe forward pass: {pct(phases['forward'] / total)} of the engine's time, "
      + ("most of it" if phases["forward"] > total / 2 else "less than half"))

# %% [markdown]
# The forward pass's share of the engine's time is printed last; the Python that schedules,
# builds the step's index tensors and samples is the rest. The advantage
# over HF is work not done: rows of finished sequences and repeated prompt prefills. It grows
# with the length of the tail and with G; on the stage-1 batch (4-token answers, 7-token
# prompts) there is little of either to save, as the benchmark's first workload shows, and
# when every completion runs to the cap (the benchmark's `uniform` workload) only the prefix
# saving and the cost of a step remain.

# %% [markdown]
# ### A decode step against this machine's limits
#
# How close to the machine is a decode step? Its **roofline** time is what the hardware
# needs at the very least: every weight and every cached key and value read once at the copy
# bandwidth, or every multiply-add done at the matrix-product peak, whichever takes longer
# (they could overlap). We measure both limits on this machine, at the current threads: the
# FLOP/s of one large float32 matrix product and the bytes/s of copying a tensor larger than
# the CPU's caches. The share `ideal / measured` says how much of the machine the step uses.

# %%
# | export minirl/rollout/engine/measure.py
from torch.profiler import ProfilerActivity, profile


def machine_limits(repeats: int = 5, size: int = 2048, copy_mib: int = 256) -> dict:
    """This machine's float32 matrix-product peak and copy bandwidth, at the current torch threads.

    matmul_flops: FLOP/s of a size x size float32 product (2 size^3 FLOPs); copy_bytes: bytes/s
    of copying a `copy_mib` MiB tensor (read + written, 2 x its size; larger than a CPU's
    last-level cache). The best of `repeats`: a limit is what the machine can do.
    """
    a = torch.randn(size, size)
    src = torch.empty(copy_mib * 2**20 // 4).normal_()
    dst = torch.empty_like(src)
    seconds = interleaved({"matmul": lambda: a @ a, "copy": lambda: dst.copy_(src)}, repeats)
    return {"matmul_flops": 2 * size ** 3 / min(seconds["matmul"]),
            "copy_bytes": 2 * src.numel() * 4 / min(seconds["copy"]), "threads": torch.get_num_threads()}


def decode_step_work(model, rows: int, context: int) -> dict:
    """FLOPs and bytes of one decode step (`rows` sequences, one token each after `context`), from the shape.

    FLOPs: 2 per weight of every matrix product per row (q/k/v/o, the MLP, the LM head; the
    embedding is a lookup), plus attention's 4 x heads x head_dim per visible position (q.k and
    p.v). Bytes: every parameter read once, plus the keys and values of rows x (context + 1)
    positions. Activations are left out (a few kB per row, cache-resident).
    """
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).dtype.itemsize
    products = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.weight.numel() for m in products)
    params = {p.data_ptr(): p.numel() for p in model.parameters()}                   # tied weights once
    positions = rows * (context + 1)
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize * positions
    attention_flops = 4 * positions * c.num_attention_heads * head_dim * c.num_hidden_layers
    return {"flops": 2 * weights * rows + attention_flops, "attention_flops": attention_flops,
            "weight_bytes": sum(params.values()) * itemsize, "kv_bytes": kv_bytes,
            "bytes": sum(params.values()) * itemsize + kv_bytes}


def decode_roofline(model, rows: int = 32, context: int = 160, limits: dict | None = None, repeats: int = 15,
                    block_size: int = 16) -> dict:
    """One decode step's measured seconds (median) beside its roofline: max(bytes / bandwidth, FLOPs / peak)."""
    limits = limits or machine_limits()
    work = decode_step_work(model, rows, context)
    memory, compute = work["bytes"] / limits["copy_bytes"], work["flops"] / limits["matmul_flops"]
    measured = step_seconds(model, rows, 1, context, repeats, block_size)
    ideal = max(memory, compute)
    return work | limits | {"rows": rows, "context": context, "memory_s": memory, "compute_s": compute,
                            "ideal_s": ideal, "measured_s": measured, "share": ideal / measured,
                            "bound": "compute" if compute >= memory else "memory"}


STEP_KINDS = {"matrix products": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"),
              "attention, read in place": ("aten::_embedding_bag_forward_only", "aten::_embedding_bag",
                                           "aten::_softmax"),
              "cache writes": ("aten::_index_put_impl_", "aten::index_copy_")}
OTHER_KIND = "everything else (norms, rotary, residuals, indexing, Python)"


def decode_step_breakdown(model, roof: dict, repeats: int = 3, block_size: int = 16) -> dict:
    """Where the measured decode step of `roof` (decode_roofline's result) goes, each kind beside its own ideal.

    The step is profiled (torch.profiler, self CPU time of each operator, `repeats` calls) and its
    operators sorted into STEP_KINDS and OTHER_KIND; a kind's seconds are its share of the profiled
    time times the measured step. Ideals: the products' FLOPs at the matmul peak or their weights at
    the copy bandwidth, attention's FLOPs or the cached keys and values likewise; the rest has none.
    "bound" is the share of the machine the step would reach if everything but the products and
    attention took no time at all: how far removing overhead alone could take it.
    """
    paged, step = probe_step(model, roof["rows"], 1, roof["context"], block_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            paged(step)
    own = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(own.values())
    shares = {kind: sum(own.get(op, 0) for op in ops) / total for kind, ops in STEP_KINDS.items()}
    shares[OTHER_KIND] = 1 - sum(shares.values())
    peak, bandwidth = roof["matmul_flops"], roof["copy_bytes"]
    products_flops = roof["flops"] - roof["attention_flops"]
    ideals = {"matrix products": max(products_flops / peak, roof["weight_bytes"] / bandwidth),
              "attention, read in place": max(roof["attention_flops"] / peak, roof["kv_bytes"] / bandwidth)}
    kinds = {kind: {"share": share, "seconds": share * roof["measured_s"], "ideal_s": ideals.get(kind)}
             for kind, share in shares.items()}
    return {"kinds": kinds, "bound": roof["ideal_s"] / sum(kinds[k]["seconds"] for k in ideals)}

# %%
limits = machine_limits(repeats=2 if SMOKE else 5)
roof = decode_roofline(big, rows=32, context=160, limits=limits, repeats=5 if SMOKE else 15)
show([("FLOPs", f"{roof['flops'] / 1e6:.0f} M", f"{limits['matmul_flops'] / 1e9:.0f} GFLOP/s",
       f"{1e3 * roof['compute_s']:.2f}"),
      ("bytes (weights + keys/values)", f"{roof['weight_bytes'] / 1e6:.1f} + {roof['kv_bytes'] / 1e6:.1f} MB",
       f"{limits['copy_bytes'] / 1e9:.1f} GB/s", f"{1e3 * roof['memory_s']:.2f}")],
     ("one decode step, 32 rows x 160 tokens", "work", f"this machine, {limits['threads']} threads", "ideal ms"))
print(f"\nmeasured {1e3 * roof['measured_s']:.2f} ms against the ideal {1e3 * roof['ideal_s']:.2f} ms "
      f"({roof['bound']}-bound): the step uses {pct(roof['share'])} of the machine\n")

# where the measured time goes, by operator, each kind beside its own ideal
parts = decode_step_breakdown(big, roof)
show([(kind, pct(k["share"]), f"{1e3 * k['seconds']:.2f}",
       "0" if k["ideal_s"] is None else f"{1e3 * k['ideal_s']:.2f}",
       "-" if k["ideal_s"] is None else f"{k['seconds'] / k['ideal_s']:.1f}x") for kind, k in parts["kinds"].items()],
     ("inside the decode step", "share of CPU time", "ms", "its own ideal ms", "over its ideal"))
over = {kind: k["seconds"] - (k["ideal_s"] or 0.0) for kind, k in parts["kinds"].items()}     # no ideal: all over
print(f"\nthe most time over its ideal: {max(over, key=over.get)}; with no time at all outside the matrix products "
      f"and attention, the step would use {pct(parts['bound'])} of the machine")
assert 0 < roof["share"] and roof["ideal_s"] == max(roof["memory_s"], roof["compute_s"])

# %% [markdown]
# Reading the table: matrix products of 32 rows run at a fraction of the peak of a large
# product (the "over its ideal" column says how far; each weight is loaded for only 32 rows
# of work, and these are small matrices); the in-place attention reads every key
# once per query head that shares it (4 query heads per key head here) where a fused kernel
# would read it once; and "everything else" is pure overhead, a few dozen small operators
# per layer launched from Python, each costing microseconds whatever its size (what CUDA
# graphs remove on a GPU). The last line is the ceiling of removing that overhead alone:
# with "everything else" gone, the products and the attention as they run here would still
# hold the step to that share; beyond it they need kernels of their own (a fused paged-attention
# kernel reads each key once for all the query heads sharing it). The benchmark prints the
# same comparison and the share as `decode_roofline_share: X`.

# %% [markdown]
# ## 11. In the loop
#
# `PagedEngine` stands behind the rollout-engine protocol, so the loop of notebook 01 can use
# it once it joins notebook 01's engine registry: one entry, named "paged", whose factory
# imports this module only when it builds the engine. Every stage then takes it, with
# `RLConfig(rollout=RolloutConfig(rollout_engine="paged"))` or from the command line
# (`python chapters/01_single_process.py --rollout-engine paged`, and chapters 04, 06, 07).
# The weight sync calls `load_weights` after every update, which also empties the prefix
# cache: keys and values computed by the old weights must never be reused.

# %%
from minirl.config import RLConfig
from minirl.rollout.base import RolloutEngine
from minirl.rollout.registry import ENGINES, build_engine, register_engine


# %%
# | export minirl/rollout/registry.py
@register_engine("paged")
def build_paged(config: RLConfig, model, tokenizer, device, **options):
    """Notebook 05's paged engine: paged KV cache, continuous batching, prefix caching; options: none used."""
    from minirl.rollout.engine.engine import PagedEngine  # noqa: PLC0415 (loads when built)
    return PagedEngine(model, tokenizer, config.engine_dtype, device=device)


# %%
print("engines:", ", ".join(ENGINES))

engine = build_engine(RLConfig.from_flat(rollout_engine="paged", num_generations=4), policy, policy_tok)
rollout = engine.generate([format_prompt(p) for p in TASK.test[:2]], SamplingConfig(num_generations=4),
                          expected_version=0, generator=torch.Generator().manual_seed(0))
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

# %% [markdown]
# ## Appendix: the workloads
#
# The larger policy, the few-shot prompts and the draft used above, in
# `minirl/rollout/engine/workloads.py`.

# %%
# | export minirl/rollout/engine/workloads.py
"""Workloads for measuring generation: a larger policy with a long tail of completion lengths, and prompts.

`load_long_tail_policy()` builds (once, cached under $MINIRL_CACHE like the embedded policy)
a Qwen2 causal LM of about 8 M parameters with a 70-token character vocabulary and random
weights. Random weights are the point: its logits are nearly uniform, so every step emits
EOS with probability about 1/70 and completion lengths are close to geometric (mean ~70,
median ~50, a few percent run into a 256-token cap). That is the long tail of an RL batch -
most completions stop early, a few run long - produced by the model itself, so HF
`generate`, TRL and the paged engine all see EOS the same way, with no engine-specific
stopping rule. Training it to write real text would cost more CPU time than all the
benchmarks together and would not change the cost of a token.

`few_shot_prompts(n, length)` makes prompts of about `length` characters from the
arithmetic task (solved examples, then one question), the ~64-token prompts of the
long-tail workload; `load_draft_policy()` is a small warm-started draft for speculation.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.models.policy import BOS, EOS, PAD, PolicyConfig, load_default_policy
from minirl.runtime.policy_cache import cache_dir, load_tokenizer
from minirl.tasks.arithmetic import make_task

LONG_TAIL_CHARACTERS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz.,:;?!()[]{}<>/|&%$#@^~_'\""


@dataclass(frozen=True)
class LongTailConfig:
    """The larger policy: 8 layers of width 256, 4 query heads sharing 1 key/value head (GQA 4:1)."""

    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 1
    intermediate_size: int = 1024
    max_length: int = 512
    seed: int = 0

# %% [markdown]
# Its tokenizer: one token per character, after the three special tokens the embedded policy
# also uses, padding on the left as generation needs.

# %%
# | export minirl/rollout/engine/workloads.py
def long_tail_tokenizer(max_length: int = 512) -> PreTrainedTokenizerFast:
    """One token per character of LONG_TAIL_CHARACTERS, after <pad>, <bos>, <eos> (ids 0, 1, 2)."""
    vocab = {PAD: 0, BOS: 1, EOS: 2} | {c: 3 + i for i, c in enumerate(LONG_TAIL_CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    # unk_token named: without one, a reload next to a Qwen2 config.json (AutoTokenizer picks
    # Qwen2Tokenizer) adds '<|endoftext|>' as a 71st id the model does not embed.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=PAD, model_max_length=max_length)
    tokenizer.padding_side = "left"
    return tokenizer

# %% [markdown]
# The model: a seeded random Qwen2 of that size, saved once as an ordinary HF checkpoint under
# $MINIRL_CACHE and loaded from there.

# %%
# | export minirl/rollout/engine/workloads.py
def build_long_tail_policy(config: LongTailConfig = LongTailConfig()):
    """(model, tokenizer): a randomly initialized Qwen2 sized by `config` (seeded), in eval mode."""
    tokenizer = long_tail_tokenizer(config.max_length)
    torch.manual_seed(config.seed)
    qwen = Qwen2Config(vocab_size=len(tokenizer), hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                       num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                       max_position_embeddings=config.max_length, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(qwen).eval(), tokenizer


def load_long_tail_policy(config: LongTailConfig = LongTailConfig(), device: str = "cpu"):
    """(model, tokenizer, path) of the larger policy, saved once as an ordinary HF checkpoint."""
    key = json.dumps(asdict(config) | {"unk_token": PAD}, sort_keys=True)   # a cache from before unk_token: rebuilt
    path = cache_dir() / f"long-tail-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").exists():
        model, tokenizer = build_long_tail_policy(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, path)               # atomic: readers see all of it or none of it
        except OSError:                         # another process finished first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    tokenizer = load_tokenizer(path)   # as saved (AutoTokenizer would rebuild it as a byte-level BPE)
    tokenizer.padding_side = "left"
    return model, tokenizer, path

# %% [markdown]
# The draft used in section 9, and the few-shot prompts of the long-tail workload.

# %%
# | export minirl/rollout/engine/workloads.py
DRAFT_POLICY = PolicyConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


def load_draft_policy(device: str = "cpu", progress: bool = False):
    """(model, tokenizer, path): a ~125 k-parameter policy warm-started like the embedded one (notebook 00).

    Same tokenizer and task as the embedded policy, about 8x fewer parameters: a draft for
    speculative decoding. Built once (about half a minute) and cached like the embedded policy.
    """
    return load_default_policy(policy_config=DRAFT_POLICY, device=device, progress=progress)


def few_shot_rows(n: int, length: int = 64, seed: int = 0) -> list[dict]:
    """n dataset rows {"prompt", "answer"}: solved sums of the arithmetic task, then one to solve.

    Each prompt is about `length` characters ("39+87=126,95+15=110,...,53+45="); the answer is
    the last sum's value, so the task's reward function scores completions as usual.
    """
    rows = make_task().rows("train")
    generator = torch.Generator().manual_seed(seed)
    pick = lambda: rows[int(torch.randint(len(rows), (1,), generator=generator))]   # noqa: E731
    out = []
    for _ in range(n):
        last = pick()
        text = ""
        while len(text) + len(last["prompt"]) < length:
            row = pick()
            text += f"{row['prompt']}{row['answer']},"
        out.append({"prompt": text + last["prompt"], "answer": last["answer"]})
    return out


def few_shot_prompts(n: int, length: int = 64, seed: int = 0) -> list[str]:
    """The prompts of `few_shot_rows(n, length, seed)`."""
    return [row["prompt"] for row in few_shot_rows(n, length, seed)]
