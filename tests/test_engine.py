"""The paged engine (notebook 05, minirl/rollout/engine): correct first, then leak-free, then bad input."""

import os
import random
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from minirl.algo.logprobs import completion_logprobs
from minirl.config import SamplingConfig
from minirl.models.policy import PolicyConfig, build_policy, build_tokenizer, load_default_policy
from minirl.rollout.base import RolloutEngine, VersionMismatchError
from minirl.rollout.engine.attention import Chunk, PagedModel, gather_attention, make_step
from minirl.rollout.engine.blocks import BlockPool, block_hash, grow_table
from minirl.rollout.engine.engine import PagedEngine
from minirl.rollout.engine.prefix import PrefixCache, match_prefix
from minirl.rollout.engine.radix import RadixCache
from minirl.rollout.sampling import sample_tokens
from minirl.runtime.drafts import ModelDraft, NgramDraft, probabilities
from minirl.runtime.engine_core import AUTO_CACHE_TOKENS, Request
from minirl.runtime.paged_ops import Linear, decode_attention, decode_rows, zeros_on_demand
from minirl.runtime.workloads import few_shot_prompts, load_long_tail_policy
from minirl.tasks.arithmetic import format_prompt, make_task

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy():
    model, tokenizer, _ = load_default_policy(progress=False)
    return model, tokenizer


@pytest.fixture(scope="module")
def long_tail():
    model, tokenizer, _ = load_long_tail_policy()
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts():
    return [format_prompt(p) for p in make_task().test[:24]]


def encode(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_greedy(model, tokenizer, texts, max_new_tokens):
    """HF generate's greedy completions (cut after EOS) and the top-2 logit gap at every step."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack(out.logits, 1).float().topk(2, -1).values
    rows = []
    for row in out.sequences[:, enc.input_ids.shape[1]:].tolist():
        rows.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return rows, top2[..., 0] - top2[..., 1]


def assert_greedy_equal(got, want, gaps, tie=1e-4):
    """Token for token; where they part, HF's top two logits must tie within float rounding (tie)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            j = next((j for j in range(min(len(g), len(w))) if g[j] != w[j]), min(len(g), len(w)))
            assert gaps[i, j] < tie, f"row {i} differs from HF generate at token {j} ({g[j:j + 3]} vs {w[j:j + 3]}) " \
                                     f"where HF's top-2 logit gap is {float(gaps[i, j]):.2e}, not a tie"


# ---------------------------------------------------------------- blocks, hashes, trees


def test_pool_reference_counts_and_lru_free_order():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.num_free == 2
    pool.retain(a)
    pool.release(a)
    assert pool.num_free == 2, "a block with a holder left stays in use"
    pool.release(a)
    pool.release(b)
    assert list(pool.free) == [2, 3, 0, 1], "freed blocks go to the back: the longest-free block is reused first"
    pool.retain(b)                                                   # a cache hit on a freed block
    assert pool.ref[b] == 1 and b not in pool.free
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(a)
    pool.check()


def test_a_grown_pool_hands_out_its_new_blocks_before_freed_ones():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(), pool.allocate()
    pool.release(a)                                   # a: freed, its content still findable
    pool.grow(5)
    assert pool.num_blocks == 5 and pool.num_free == 4
    assert [pool.allocate() for _ in range(4)] == [3, 4, 2, a], "new blocks first, the freed one last"
    pool.release(b)
    pool.check()
    pool.grow(4)                                      # never shrinks
    assert pool.num_blocks == 5


def test_grow_table_takes_blocks_only_when_needed():
    pool = BlockPool(10, 4)
    table = []
    assert grow_table(table, 4, 4, pool.allocate) == 1 and grow_table(table, 4, 4, pool.allocate) == 0
    assert grow_table(table, 5, 4, pool.allocate) == 1 and len(table) == 2 and pool.num_free == 8


def test_match_prefix_chains_hashes_and_catches_collisions():
    tokens = list(range(10))                                         # blocks of 4: [0..3] [4..7], tail [8, 9]
    h1 = block_hash(None, tuple(tokens[:4]))
    h2 = block_hash(h1, tuple(tokens[4:8]))
    table = {h1: (7, tuple(tokens[:4])), h2: (3, tuple(tokens[4:8]))}
    assert match_prefix(tokens, 4, table) == [7, 3]
    assert match_prefix(tokens[:8], 4, table) == [7], "the last token is always computed: block 2 is not matched"
    assert match_prefix([9] + tokens[1:], 4, table) == [], "chained: a different first block breaks the chain"
    table[h1] = (7, (0, 0, 0, 0))                                    # same hash, other tokens
    assert match_prefix(tokens, 4, table) == []


def test_prefix_cache_forgets_blocks_that_are_reused():
    pool = BlockPool(3, 2)
    cache = PrefixCache(pool)
    table = [pool.allocate(), pool.allocate()]
    cache.insert([1, 2, 3, 4], table)
    assert cache.match([1, 2, 3, 4, 5]) == table
    for b in table:
        pool.release(b)
    assert cache.match([1, 2, 3, 4, 5]) == table, "freed blocks still hold their content until reused"
    pool.allocate(), pool.allocate()                                 # the free block 2, then block 0 (oldest freed)
    assert cache.match([1, 2, 3, 4, 5]) == [], "block 0 was handed out again: the chain is gone"


def test_radix_tree_shares_splits_and_evicts_least_recently_used_leaves():
    pool = BlockPool(8, 2)
    tree = RadixCache(pool)
    a = [pool.allocate() for _ in range(3)]
    tree.insert([1, 2, 3, 4, 5, 6], a)
    b = a[:1] + [pool.allocate() for _ in range(2)]
    pool.retain(a[0])
    tree.insert([1, 2, 9, 9, 7, 7], b)                              # shares block [1, 2]: the edge is split
    assert tree.match([1, 2, 3, 4, 5, 6, 0]) == a and tree.match([1, 2, 9, 9, 7, 7, 0]) == b
    assert len(tree.root.children) == 1 and len(next(iter(tree.root.children.values())).children) == 2
    for blocks in (a, b):
        for x in blocks:
            pool.release(x)                                          # the sequences end; only the tree holds them
    assert tree.evictable() == 5
    tree.match([1, 2, 9, 9, 0])                                      # touch branch b: branch a is older
    assert tree.evict(2) == 2 and tree.match([1, 2, 3, 4, 5, 6, 0]) == a[:1], "the LRU leaf (a's) goes first"
    assert tree.match([1, 2, 9, 9, 7, 7, 0]) == b
    assert tree.evict(10) == 3 and pool.num_free == 8
    pool.check()


# ---------------------------------------------------------------- the forward pass and the engine


def test_paged_forward_matches_hf_logits(long_tail):
    model, tokenizer = long_tail
    ids = encode(tokenizer, few_shot_prompts(3, length=40))
    paged = PagedModel(model)
    paged.allocate_cache(30, 8)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]
    prefill = make_step([Chunk(x[:-1], 0, t) for x, t in zip(ids, tables, strict=True)], 8, paged.n_rep, "cpu")
    paged(prefill)
    decode = make_step([Chunk(x[-1:], len(x) - 1, t) for x, t in zip(ids, tables, strict=True)], 8, paged.n_rep, "cpu")
    got = paged(decode)                                              # [3, V]: the next-token logits
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_kv_heads,block_size", [(1, 16), (2, 4), (4, 1)])
def test_the_in_place_read_equals_the_gathered_one(num_kv_heads, block_size):
    """Decode attention through embedding bags (no copy) = gather + SDPA, over distinct key heads, ragged contexts
    and padded tables; a wrong key-head mapping, block order or mask makes them differ."""
    torch.manual_seed(0)
    H, D, NB = 4, 8, 40
    contexts = [1, 7, 19, 33]
    tables = [torch.randperm(NB)[:-(-(n + 1) // block_size)].tolist() for n in contexts]
    chunks = [Chunk([3], n, t) for n, t in zip(contexts, tables, strict=True)]
    step = make_step(chunks, block_size, H // num_kv_heads, "cpu")
    cache = torch.randn(2, num_kv_heads, NB, block_size * D)
    keys, values = cache[0].view(num_kv_heads, NB, D, block_size), cache[1].view(num_kv_heads, NB, block_size, D)
    (g,) = step.groups                                                                # one bucket: all contexts < 64
    q = torch.randn(len(contexts), H, D)
    bias = torch.zeros(g.mask.shape).masked_fill_(~g.mask, float("-inf"))
    got = decode_attention(q, keys, values, decode_rows(g, H, H // num_kv_heads, NB, D, block_size), D ** -0.5)
    torch.testing.assert_close(got, gather_attention(q, keys, values, g, bias, D ** -0.5), atol=1e-5, rtol=1e-5)
    for j, (n, t) in enumerate(zip(contexts, tables, strict=True)):                # by hand, in token order
        k = keys[:, t].transpose(2, 3).reshape(num_kv_heads, -1, D)[:, :n + 1]        # [Hkv, n+1, D]
        v = values[:, t].reshape(num_kv_heads, -1, D)[:, :n + 1]
        k, v = k.repeat_interleave(H // num_kv_heads, 0), v.repeat_interleave(H // num_kv_heads, 0)
        p = torch.softmax((q[j][:, None] * k).sum(-1) * D ** -0.5, -1)                # [H, n+1]
        torch.testing.assert_close(got[j], (p[..., None] * v).sum(1).flatten(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_features", [48, 128])       # 48: transposed for torch.mm; 128: the C kernel's panels
def test_products_equal_plain_ones_and_add_into_the_residual(out_features):
    weight, bias = torch.randn(out_features, 32), torch.randn(out_features)
    for rows in (1, 5, 64):
        x, residual = torch.randn(rows, 32), torch.randn(rows, out_features)
        for b in (bias, None):
            want = torch.nn.functional.linear(x, weight, b)
            torch.testing.assert_close(Linear(weight, b)(x), want)
            out = residual.clone()
            assert Linear(weight, b).add_to(out, x) is out, "the residual is added in place"
            torch.testing.assert_close(out, residual + want)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set size from /proc (Linux)")
def test_an_untouched_cache_costs_no_memory():
    def resident_mb():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    before = resident_mb()
    cache = zeros_on_demand((64, 2**20), torch.float32, "cpu")                        # 256 MiB of zeros
    assert resident_mb() - before < 32, "pages are committed only when touched"
    cache[3, :10] = 1.0
    assert cache[3, :20].sum() == 10 and cache.shape == (64, 2**20)


def test_greedy_equals_hf_generate_on_the_embedded_policy(policy, prompts):
    model, tokenizer = policy
    engine = PagedEngine(model, tokenizer, block_size=4)
    got = [s.completion for s in engine.run([Request(x, 5, 0.0) for x in encode(tokenizer, prompts)])]
    want, gaps = hf_greedy(model, tokenizer, prompts, 5)
    assert_greedy_equal(got, want, gaps)


def test_greedy_equals_hf_generate_on_the_larger_policy(long_tail):
    model, tokenizer = long_tail
    texts = few_shot_prompts(4)
    engine = PagedEngine(model, tokenizer, block_size=16)
    got = [s.completion for s in engine.run([Request(x, 48, 0.0) for x in encode(tokenizer, texts)])]
    want, gaps = hf_greedy(model, tokenizer, texts, 48)
    assert_greedy_equal(got, want, gaps)


@pytest.mark.parametrize("cache", ["prefix", "radix", "none"])
def test_sampled_logprobs_match_the_trainers_recomputation(policy, prompts, cache):
    model, tokenizer = policy
    engine = PagedEngine(model, tokenizer, block_size=4, cache=cache)
    assert isinstance(engine, RolloutEngine)
    ro = engine.generate(prompts[:6], SamplingConfig(num_generations=4, max_completion_length=4, temperature=0.7),
                         generator=torch.Generator().manual_seed(0))
    assert ro.prompts == [p for p in prompts[:6] for _ in range(4)] and ro.version == 0
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens, 0.7)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(ro.logprobs[m], trainer[m], atol=1e-5, rtol=0)
    assert (ro.logprobs[~m] == 0).all()
    assert tokenizer.batch_decode(ro.completion_ids * ro.completion_mask, skip_special_tokens=True) == ro.completions


def test_generator_makes_sampling_repeatable_and_leaves_the_global_rng(policy, prompts):
    model, tokenizer = policy
    engine = PagedEngine(model, tokenizer, block_size=4)
    sampling = SamplingConfig(num_generations=4, max_completion_length=4)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a = engine.generate(prompts[:4], sampling, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), before)
    b = engine.generate(prompts[:4], sampling, generator=torch.Generator().manual_seed(7))
    c = engine.generate(prompts[:4], sampling, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, c.completion_ids)


def test_versions_and_weight_loading_empty_the_cache(policy, prompts):
    model, tokenizer = policy
    engine = PagedEngine(model, tokenizer, block_size=4)
    sampling = SamplingConfig(num_generations=2, max_completion_length=4)
    with pytest.raises(VersionMismatchError, match="version 0"):
        engine.generate(prompts[:2], sampling, expected_version=3)
    engine.run([Request(x, 4, 0.0) for x in encode(tokenizer, prompts)])        # fills the prefix cache
    other = build_policy(PolicyConfig(seed=5), build_tokenizer()).eval()
    engine.load_weights(other.state_dict().items(), version=1)
    assert engine.version == 1 and not engine.cache.table, "old weights' keys/values must not be reused"
    got = [s.completion for s in engine.run([Request(x, 4, 0.0) for x in encode(tokenizer, prompts)])]
    want, gaps = hf_greedy(other, tokenizer, prompts, 4)
    assert_greedy_equal(got, want, gaps)


def test_the_cache_is_sized_to_the_work_and_keeps_its_prefixes_when_it_grows(long_tail):
    model, tokenizer = long_tail
    engine = PagedEngine(model, tokenizer, block_size=16)
    assert engine.num_blocks == 512 // 16, "one sequence of max_model_len until there is work"
    ids = encode(tokenizer, few_shot_prompts(2))
    per_row = -(-(max(len(x) for x in ids) + 20) // 16)                     # blocks of the longest request
    want = [s.completion for s in engine.run([Request(x, 20, 0.0) for x in ids])]
    assert engine.num_blocks == max(32, 2 * per_row)
    seqs = engine.run([Request(x, 20, 0.0) for x in ids for _ in range(4)])  # 8 rows x their longest
    assert engine.num_blocks == 8 * per_row > 32
    assert engine.stats.cached_tokens > 0, "the first run's prompt blocks are found after the cache grew"
    assert [s.completion for s in seqs] == [w for w in want for _ in range(4)]
    engine.pool.check()
    engine.run([Request(ids[0], 20, 0.0)])
    assert engine.num_blocks == 8 * per_row, "it never shrinks"
    capped = PagedEngine(model, tokenizer, block_size=16, max_num_seqs=2)
    capped.run([Request(x, 20, 0.0) for x in ids for _ in range(4)])
    assert capped.num_blocks == max(32, 2 * per_row), "only max_num_seqs sequences hold blocks at once"
    assert AUTO_CACHE_TOKENS // 16 >= capped.num_blocks
    budget = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=100 * 2**20)
    assert budget.num_blocks == 100 * 2**20 // budget.model.cache_bytes_per_block(16)
    budget.run([Request(x, 20, 0.0) for x in ids for _ in range(4)])
    assert budget.num_blocks == 100 * 2**20 // budget.model.cache_bytes_per_block(16), "a budget is fixed"


def test_add_grows_a_cache_sized_to_the_work_so_that_step_runs_the_whole_batch(long_tail):
    model, tokenizer = long_tail
    ids = encode(tokenizer, few_shot_prompts(2))
    requests = [Request(x, 20, 0.0) for x in ids for _ in range(4)]
    want = [s.completion for s in PagedEngine(model, tokenizer, block_size=16).run(requests)]
    engine = PagedEngine(model, tokenizer, block_size=16)
    seqs = [engine.add(r) for r in requests]
    per_row = -(-(max(len(x) for x in ids) + 20) // 16)
    assert engine.num_blocks >= 8 * per_row, "add() grows the cache to the queued work, as run() does"
    while engine.scheduler.has_work():
        engine.step()
    assert max(row["running"] for row in engine.scheduler.timeline) == 8 and engine.stats.preemptions == 0
    assert [s.completion for s in seqs] == want
    engine.pool.check()
    fixed = PagedEngine(model, tokenizer, block_size=16, num_blocks=32)
    fixed.add(requests[0])
    assert fixed.num_blocks == 32, "a cache the caller sized stays as it is"


@pytest.mark.parametrize("seed", range(10))
def test_block_accounting_never_leaks_and_outputs_do_not_depend_on_the_schedule(policy, prompts, seed):
    """Property: any cache, policy, block size, cache size, slots and budget: same greedy outputs, all blocks freed."""
    model, tokenizer = policy
    rng = random.Random(seed)
    requests = [Request(x, rng.randint(1, 8), 0.0) for x in encode(tokenizer, prompts)
                for _ in range(rng.randint(1, 3))]
    want = [s.completion for s in PagedEngine(model, tokenizer, block_size=4, cache="none").run(requests)]
    for _ in range(3):
        block_size = rng.choice([1, 2, 4, 8])
        engine = PagedEngine(model, tokenizer, block_size=block_size, cache=rng.choice(["prefix", "radix", "none"]),
                             policy=rng.choice(["continuous", "static"]),
                             reserve=rng.choice(["on_demand", "max_length"]),
                             num_blocks=rng.randint(-(-32 // block_size), 60), max_num_seqs=rng.randint(1, 40),
                             max_num_batched_tokens=rng.randint(1, 96))
        got = engine.run(requests)
        assert [s.completion for s in got] == want, (engine.cache_kind, engine.policy, engine.reserve)
        assert all(s.block_table == [] for s in got) and not engine.scheduler.has_work()
        if engine.cache is not None:
            engine.cache.evict(engine.num_blocks)
        engine.pool.check()
        assert engine.pool.num_free == engine.num_blocks, "every block is free again after the workload"


def test_continuous_batching_refills_slots_and_static_batching_pads(policy, prompts):
    model, tokenizer = policy
    requests = [Request(x, 6, 0.0) for x in encode(tokenizer, prompts)]
    runs = {}
    for policy_name in ("continuous", "static"):
        engine = PagedEngine(model, tokenizer, block_size=4, max_num_seqs=4, policy=policy_name, cache="none")
        runs[policy_name] = (engine.run(requests), engine)
    cont, static = runs["continuous"][1], runs["static"][1]
    assert [s.completion for s in runs["continuous"][0]] == [s.completion for s in runs["static"][0]]
    assert cont.stats.padding_tokens == 0 and static.stats.padding_tokens > 0
    assert cont.stats.steps < static.stats.steps
    assert max(r["running"] for r in cont.scheduler.timeline) == 4


# ---------------------------------------------------------------- speculation in the engine


@pytest.fixture(scope="module")
def small_draft(policy):
    return build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=3),
                        build_tokenizer()).eval()


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_speculation_changes_nothing(policy, prompts, small_draft, draft):
    model, tokenizer = policy
    requests = [Request(x, 6, 0.0) for x in encode(tokenizer, prompts)]
    want = [s.completion for s in PagedEngine(model, tokenizer, block_size=4).run(requests)]
    make = {"model": lambda: ModelDraft(small_draft), "ngram": lambda: NgramDraft(2)}[draft]
    for k in (1, 3):
        engine = PagedEngine(model, tokenizer, block_size=4, draft=make(), num_speculative_tokens=k, num_blocks=20,
                             max_num_seqs=8)
        assert [s.completion for s in engine.run(requests)] == want
        assert engine.stats.draft_tokens > 0
        engine.pool.check()


def test_the_model_draft_draws_from_the_distribution_it_reports():
    """q (what accept_draft divides by) is sample_tokens' distribution: exact speculation needs the very one."""
    logits = torch.randn(6, 1, 30)
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.0, 2.0])
    tokens, logprobs = sample_tokens(logits[:, 0], temperatures, torch.Generator().manual_seed(0))
    q = probabilities(logits, temperatures)[:, 0]                                   # [6, 30]
    sampled = temperatures > 0
    torch.testing.assert_close(q.gather(1, tokens[:, None])[sampled, 0], logprobs.exp()[sampled])
    torch.testing.assert_close(q.sum(1), torch.ones(6))
    assert (q[~sampled].gather(1, tokens[~sampled, None]) == 1).all(), "greedy rows: a point mass on the argmax"


def test_speculative_sampling_keeps_the_targets_distribution(policy, small_draft):
    """Chi-square test of the first two tokens of 3000 speculative samples against the target's exact joint.

    Cells with fewer than 5 expected samples are merged. The test rejects at p < 1e-3: a
    correct engine fails it with probability 0.1 % for a random seed (the seed is fixed, so
    the outcome is deterministic on one machine); a draft-biased sampler fails it by far.
    """
    model, tokenizer = policy
    prompt = "37+45="
    engine = PagedEngine(model, tokenizer, block_size=4, draft=ModelDraft(small_draft), num_speculative_tokens=2)
    n = 3000
    ro = engine.generate([prompt], SamplingConfig(num_generations=n, max_completion_length=2),
                         generator=torch.Generator().manual_seed(0))
    assert engine.stats.accepted_tokens < engine.stats.draft_tokens, "the rejection path must be exercised"
    V = model.config.vocab_size
    ids = torch.tensor(encode(tokenizer, [prompt])[0])
    with torch.no_grad():
        first = torch.softmax(model(ids[None]).logits[0, -1], -1)                          # [V]
        both = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], 1)
        second = torch.softmax(model(both).logits[:, -1], -1)                              # [V, V]
    second[tokenizer.eos_token_id] = 0                                                     # nothing follows EOS
    second[tokenizer.eos_token_id, tokenizer.pad_token_id] = 1
    expected = (first[:, None] * second).flatten().double() * n
    tokens = ro.completion_ids.clone()
    if tokens.shape[1] == 1:
        tokens = torch.cat([tokens, torch.full_like(tokens, tokenizer.pad_token_id)], 1)
    observed = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).double()
    big = expected >= 5
    observed = torch.cat([observed[big], observed[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((len(expected) - 1) / 2, dtype=torch.double)
    pvalue = float(torch.special.gammaincc(df, chi2 / 2))
    assert pvalue > 1e-3, f"speculative samples do not follow the target: chi2={float(chi2):.1f}, p={pvalue:.2e}"


# ---------------------------------------------------------------- bad input


def test_requests_that_cannot_be_served_fail_alone(policy, prompts):
    model, tokenizer = policy
    engine = PagedEngine(model, tokenizer, block_size=4)
    good = encode(tokenizer, prompts[:3])
    seqs = engine.run([Request(good[0], 4, 0.0), Request([5] * 40, 4, 0.0), Request(good[1], 0, 0.0),
                       Request([], 4, 0.0), Request(good[2], 4, 0.0)])
    assert [s.finish_reason for s in seqs] == ["eos", "error", "error", "error", "eos"]
    assert "prompt of 40 tokens + max_tokens=4 = 44 tokens exceeds max_model_len=32" in seqs[1].error
    assert "max_tokens=0 must be an int >= 1" in seqs[2].error and "empty" in seqs[3].error
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt of 40 tokens .* max_model_len=32"):
        engine.generate([prompts[0], "1" * 40], SamplingConfig(num_generations=2, max_completion_length=4))


def test_bad_engine_settings_name_the_value_and_the_limit(policy, small_draft):
    model, tokenizer = policy
    with pytest.raises(ValueError, match=r"num_blocks \* block_size = 2 \* 4 = 8 tokens, fewer than one sequence of "
                                         r"max_model_len=32; raise num_blocks to >= 8"):
        PagedEngine(model, tokenizer, block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match=r"kv_cache_bytes=1000 holds 0 blocks of 8192 B, fewer than one sequence of "
                                         r"max_model_len=32; raise it to >= 65536"):
        PagedEngine(model, tokenizer, block_size=4, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="num_blocks=20 and kv_cache_bytes=8192: pass one"):
        PagedEngine(model, tokenizer, block_size=4, num_blocks=20, kv_cache_bytes=8192)
    with pytest.raises(ValueError, match="cache='lru'"):
        PagedEngine(model, tokenizer, cache="lru")
    with pytest.raises(ValueError, match="num_speculative_tokens=2 with draft=None"):
        PagedEngine(model, tokenizer, num_speculative_tokens=2)
    long_model, _, _ = load_long_tail_policy()
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"draft's vocab_size=70 differs from the target's {vocab}"):
        PagedEngine(model, tokenizer, draft=ModelDraft(long_model), num_speculative_tokens=2)


def test_weights_or_models_of_another_architecture_are_refused(policy):
    model, tokenizer = policy
    vocab = model.config.vocab_size
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                      bos_token_id=1, eos_token_id=2))
    with pytest.raises(ValueError, match="model_type='gpt2'.*not supported"):
        PagedEngine(gpt2, tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4)
    with pytest.raises(ValueError, match=r"load_weights\(version=1\): missing \['model.embed_tokens.weight'.*"
                                         r"unexpected \['transformer.h.0.attn.c_attn.bias'"):
        engine.load_weights(gpt2.state_dict().items(), version=1)
    wider = build_policy(PolicyConfig(hidden_size=64), build_tokenizer())
    with pytest.raises(ValueError, match=rf"wrong shape \['lm_head.weight \({vocab}, 64\) != \({vocab}, 128\)'"):
        engine.load_weights(wider.state_dict().items(), version=1)
    assert engine.version == 0, "nothing is loaded when anything is wrong"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_equals_hf_generate_on_cuda(policy, prompts):
    model, tokenizer = policy
    cuda = type(model)(model.config).to("cuda").eval()
    cuda.load_state_dict(model.state_dict())
    engine = PagedEngine(cuda, tokenizer, block_size=4, device="cuda")
    got = [s.completion for s in engine.run([Request(x, 5, 0.0) for x in encode(tokenizer, prompts)])]
    want, gaps = hf_greedy(cuda, tokenizer, prompts, 5)
    assert_greedy_equal(got, want, gaps.cpu(), tie=1e-3)
    ro = engine.generate(prompts[:4], SamplingConfig(num_generations=4, max_completion_length=4),
                         generator=torch.Generator(device="cuda").manual_seed(0))
    assert ro.completion_ids.device.type == "cuda" and ro.version == 0
