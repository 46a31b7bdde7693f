"""The paged forward pass's C kernels (minirl/runtime/paged_kernels.c) against torch's kernels and HF's model.

Each kernel is compared with the torch path it replaces on shapes that reach its edges (a row
tile cut short, a block partly seen, every query-per-key-head count it specializes), then the
whole forward pass with both against HF's logits, and the engine without a compiler.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from minirl.rollout.engine.attention import Chunk, PagedModel, gather_attention, make_step
from minirl.runtime import paged_kernels as kernels
from minirl.runtime import paged_ops as ops
from minirl.runtime.workloads import few_shot_prompts, load_long_tail_policy


@pytest.fixture
def torch_only(monkeypatch):
    """Everything built or run inside goes through torch's kernels, as without a compiler."""
    monkeypatch.setattr(kernels, "usable", lambda x, fits=True: False)


@pytest.fixture(scope="module")
def long_tail():
    model, tokenizer, _ = load_long_tail_policy()
    return model, tokenizer


def test_the_kernels_build_where_there_is_a_compiler():
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine: the engine runs torch's kernels (tested below)")
    assert kernels.build() is not None, kernels.why_not()
    assert kernels.usable(torch.zeros(1)) and not kernels.usable(torch.zeros(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 7, 8, 32, 37])             # MR = 8: tiles full, cut short, alone
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (100, 32)])
def test_the_product_kernel_equals_torch(rows, in_features, out_features):
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x, residual = torch.randn(rows, in_features), torch.randn(rows, out_features)
    for b in (None, bias):
        linear = ops.Linear(weight, b)
        assert linear.panels is not None, "float32 on a CPU, out_features a multiple of 32: the kernel's panels"
        want = F.linear(x, weight, b)
        torch.testing.assert_close(linear(x), want, atol=1e-5, rtol=1e-5)
        out = residual.clone()
        assert linear.add_to(out, x) is out
        torch.testing.assert_close(out, residual + want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x[:, ::1].t().contiguous().t()), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_rep", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 16)])
def test_the_attention_kernel_equals_the_gathered_read(n_rep, block_size, head_dim, monkeypatch):
    """Ragged contexts (one position, a block exactly full, a block partly seen), shuffled block tables,
    two key heads: the kernel = gather + SDPA = torch's embedding bags."""
    torch.manual_seed(n_rep)
    Hkv, NB = 2, 64
    H, D = Hkv * n_rep, head_dim
    contexts = [0, block_size - 1, block_size, 60]                    # < 64: one attention group
    tables = [torch.randperm(NB)[:-(-(n + 1) // block_size)].tolist() for n in contexts]
    step = make_step([Chunk([3], n, t) for n, t in zip(contexts, tables, strict=True)], block_size, n_rep, "cpu")
    (g,) = step.groups
    cache = torch.randn(2, Hkv, NB, block_size * D)
    keys, values = cache[0].view(Hkv, NB, D, block_size), cache[1].view(Hkv, NB, block_size, D)
    q = torch.randn(len(contexts), H, D)
    rows = ops.decode_rows(g, H, n_rep, NB, D, block_size)
    got = ops.decode_attention(q, keys, values, rows, D ** -0.5)
    bias = torch.zeros(g.mask.shape).masked_fill_(~g.mask, float("-inf"))
    torch.testing.assert_close(got, gather_attention(q, keys, values, g, bias, D ** -0.5), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(kernels, "usable", lambda x, fits=True: False)
    torch.testing.assert_close(got, ops.decode_attention(q, keys, values, rows, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_norm_activation_rotary_and_cache_writes_equal_torch(long_tail, monkeypatch):
    model = long_tail[0]
    layer = model.model.layers[0]
    x, gate_up = torch.randn(5, model.config.hidden_size), torch.randn(5, 2 * model.config.intermediate_size)
    paged = PagedModel(model)
    paged.allocate_cache(8, 16)
    H, Hkv, D = paged.num_heads, paged.num_kv_heads, paged.head_dim
    qkv = torch.randn(5, H + 2 * Hkv, D)
    cos, sin = paged.rotary(torch.tensor([0, 3, 17, 18, 40]))
    slots = torch.tensor([0, 3, 17, 18, 127])

    def run():
        paged.cache.zero_()
        rotated = ops.rotate(qkv.clone()[:, :H + Hkv], cos, sin)
        paged.write_cache(1, slots, qkv[:, H:])
        return (ops.rms_norm(x, layer.input_layernorm), ops.act_mul(layer.mlp.act_fn, gate_up), rotated,
                paged.cache.clone())

    fast = run()
    monkeypatch.setattr(kernels, "usable", lambda x, fits=True: False)
    slow = run()
    assert fast[3].count_nonzero() == slow[3].count_nonzero() == 5 * 2 * Hkv * D
    with torch.no_grad():
        torch.testing.assert_close(fast[0], layer.input_layernorm(x), atol=1e-5, rtol=1e-5)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_forward_pass_with_the_kernels_equals_hf_and_torch(long_tail, monkeypatch):
    """Block size 16 and head_dim 64: every kernel runs, the in-place read included."""
    model, tokenizer = long_tail
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in few_shot_prompts(3, length=40)]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]

    def logits():
        paged = PagedModel(model)
        paged.allocate_cache(30, 16)
        paged(make_step([Chunk(x[:-1], 0, t) for x, t in zip(ids, tables, strict=True)], 16, paged.n_rep, "cpu"))
        return paged(make_step([Chunk(x[-1:], len(x) - 1, t) for x, t in zip(ids, tables, strict=True)], 16,
                               paged.n_rep, "cpu"))

    fast = logits()
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
    torch.testing.assert_close(fast, want, atol=2e-5, rtol=1e-4)
    monkeypatch.setattr(kernels, "usable", lambda x, fits=True: False)
    torch.testing.assert_close(fast, logits(), atol=2e-5, rtol=1e-4)


def test_the_profiler_sees_the_kernels(long_tail):
    paged = PagedModel(long_tail[0])
    paged.allocate_cache(4, 16)
    step = make_step([Chunk([3, 4, 5], 0, [0])], 16, paged.n_rep, "cpu")
    with torch.profiler.profile() as prof, kernels.recorded():
        paged(step)
    names = {e.key for e in prof.key_averages()}
    assert {"minirl::linear", "minirl::rms_norm", "minirl::write_kv"} <= names, names


def test_a_queued_decode_step_equals_the_same_calls_made_one_by_one(long_tail, monkeypatch):
    """Notebook 05 queues the kernels of a step of decode rows (here three groups: contexts more than a
    bucket apart) and runs them in one C call: the same logits, bit for bit, as calling them in turn."""
    paged = PagedModel(long_tail[0])
    paged.allocate_cache(40, 16)
    paged.cache.normal_()
    contexts = [5, 16, 100, 150]
    step = make_step([Chunk([3], n, list(range(10 * i, 10 * i + 10))) for i, n in enumerate(contexts)], 16,
                     paged.n_rep, "cpu")
    assert len(step.groups) == 3 and all(g.q_index is None for g in step.groups)
    with kernels.recorded() as seconds:
        queued = paged(step)
    assert seconds["linear"] > 0 and seconds["decode_attention"] > 0, "the step's kernels ran in a queue"
    monkeypatch.setattr(ops, "queued", lambda enabled=True: contextlib.nullcontext())
    assert torch.equal(queued, paged(step))


def test_inside_a_queue_an_op_on_torchs_path_sees_the_calls_queued_before_it():
    """torch reads what a queued call writes only after the queue has run: an op taking torch's path
    (an activation the kernel lacks, a norm or a product of a strided view) runs the queue first."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    first, second = ops.Linear(torch.randn(64, 32)), ops.Linear(torch.randn(32, 32))
    norm, x = Qwen2RMSNorm(32), torch.randn(5, 32)

    def run():                                 # each op reads a product queued just before it (inside)
        ops_on_torchs_path = (lambda y: second(y[:, 32:]), lambda y: ops.act_mul(torch.nn.GELU(), y),
                              lambda y: ops.rms_norm(y[:, ::2], norm))
        return [op(first(x + i)) for i, op in enumerate(ops_on_torchs_path)] + [ops.rms_norm(second(x), norm)]

    with torch.no_grad(), kernels.queued():
        got = run()                                   # first: no earlier result lies in the memory it gets
    want = run()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_queue_keeps_what_its_calls_read_and_write_alive_and_drops_itself_on_an_error():
    """Buffers freed in Python before the queue runs (0.5-1 MB each, returned to the OS on free) stay
    alive until it has; an exception inside drops the queue and leaves no queue behind."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    up, down = ops.Linear(torch.randn(4096, 2048) / 45), ops.Linear(torch.randn(2048, 2048) / 45)
    norm, x = Qwen2RMSNorm(2048), torch.randn(64, 2048)

    def chain():
        h = x
        for _ in range(6):                              # each intermediate is freed when the next replaces it
            h = down(ops.act_mul(torch.nn.SiLU(), up(ops.rms_norm(h, norm))))
        return h

    with torch.no_grad():
        want = chain()
        with kernels.queued():
            got = chain()
    assert want.isfinite().all() and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="inside"), kernels.queued():
        up(x)
        raise RuntimeError("inside")
    assert kernels._waiting.queue is None and not kernels._waiting.keep
    assert torch.equal(up(x), up(x))


def test_threads_queue_their_own_calls():
    """Notebook 07's producers are threads, each with an engine: one thread's queue never takes another's calls."""
    torch.manual_seed(0)
    products = [ops.Linear(torch.randn(1024, 1024) / 32) for _ in range(4)]
    inputs = [torch.randn(32, 1024) for _ in range(4)]

    def chain(x):
        for p in products * 8:
            x = p(x)
        return x

    want = [chain(x) for x in inputs]
    got, start = [None] * 4, threading.Barrier(4)

    def run(i):
        start.wait()
        for _ in range(5):
            with kernels.queued():
                got[i] = chain(inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("compiler,said", [("missing", "no C compiler"), ("false", "failed on paged_kernels.c")])
def test_without_a_compiler_the_engine_says_so_once_and_runs_torchs_kernels(tmp_path, compiler, said):
    """No compiler, or one that fails: one warning naming why, torch's kernels, no half-built file left."""
    code = ("import warnings, torch\n"
            "from minirl.rollout.engine.attention import Chunk, PagedModel, make_step\n"
            "from minirl.runtime.workloads import load_long_tail_policy\n"
            "paged = PagedModel(load_long_tail_policy()[0]); paged.allocate_cache(4, 16)\n"
            "for n in (3, 1):\n"
            "    out = paged(make_step([Chunk([3] * n, 3 - n, [0])], 16, paged.n_rep, 'cpu'))\n"
            "print('logits', tuple(out.shape), bool(out.isfinite().all()))\n")
    cc = str(tmp_path / "no-such-cc") if compiler == "missing" else shutil.which("false")
    if cc is None:
        pytest.skip("no `false` program on this machine")
    cache = tmp_path / "cache"                                     # no library built before: cc must run
    env = os.environ | {"CC": cc, "HF_HUB_OFFLINE": "1", "MINIRL_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "logits (1, 70) True" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if said in line]
    assert len(warnings) == 1 and "torch's kernels" in warnings[0], done.stderr
    left = list((cache / "kernels").glob("*")) if (cache / "kernels").exists() else []
    assert not left, f"a failed build left {left}"
