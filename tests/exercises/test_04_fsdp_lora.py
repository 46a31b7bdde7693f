"""Graded checks of notebook 04's exercises (python -m minirl.grade --only 04)."""

import math
import weakref

import pytest
import torch


def _group():
    """A one-process gloo group (the checks need DTensors, which need a process group)."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="minirl-ex4-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (1,))


# ---- 4.1: the ranks' records as one -----------------------------------------------------------------

RECORDS = [{"loss": 1.0, "entropy": 2.0, "ratio/min": 0.9, "ratio/max": 1.1, "skipped": 0, "grad_norm": 3.0,
            "note": "rank 0"},
           {"loss": 3.0, "entropy": 4.0, "ratio/min": 0.8, "ratio/max": 1.3, "skipped": 1, "grad_norm": 3.5,
            "note": "rank 1"}]


@pytest.mark.exercise("4.1")
def test_reduce_metrics_values(ex):
    out = ex.reduce_metrics([dict(r) for r in RECORDS], [30.0, 10.0], [0.5, 1.5])
    assert out["entropy"] == pytest.approx(2.5), \
        "a per-token mean is the token-weighted mean of the ranks' ((30 * 2 + 10 * 4) / 40), not the plain mean"
    assert out["loss"] == pytest.approx((0.5 * 1.0 + 1.5 * 3.0) / 2), "the loss is (1 / W) sum_r w_r loss_r"
    assert out["ratio/min"] == 0.8 and out["ratio/max"] == 1.3, "'/min' keys: the smallest; '/max': the largest"
    assert out["skipped"] == 1, "a step one rank skipped, every rank skipped (the max)"
    assert out["grad_norm"] == 3.0, "grad_norm is rank 0's: the norm of the averaged gradients, already global"
    assert out["note"] == "rank 0", "what is not a number is rank 0's"
    assert ex.reduce_metrics([dict(r) for r in RECORDS], [30.0, 10.0])["loss"] == pytest.approx(1.5), \
        "without loss weights the loss is token-weighted like any other mean"


@pytest.mark.exercise("4.1")
def test_reduce_metrics_edge_cases(ex):
    assert ex.reduce_metrics([dict(RECORDS[0])], [30.0], [2.0]) == RECORDS[0], "one rank: its record unchanged"
    flags = [{"ok": True, "value_loss": 1.0}, {"ok": False, "value_loss": 2.0}]
    out = ex.reduce_metrics(flags, [1.0, 1.0], [1.0, 1.0])
    assert out["ok"] is True, "a bool is not a number: rank 0's"
    assert out["value_loss"] == pytest.approx(1.5), "value_loss is a loss too: (1 / W) sum_r w_r loss_r"
    empty = ex.reduce_metrics([{"entropy": 1.0}, {"entropy": 3.0}], [0.0, 0.0])
    assert math.isfinite(empty["entropy"]), "ranks without tokens: no division by zero"
    same = [{"loss": 2.0, "entropy": 2.0}, {"loss": 2.0, "entropy": 2.0}]
    a = ex.reduce_metrics([dict(r) for r in same], [3.0, 5.0], [0.75, 1.25])
    b = ex.reduce_metrics([dict(r) for r in same], [3.0, 5.0], [0.75, 1.25])
    assert a == b == {"loss": 2.0, "entropy": 2.0}, "every rank that reduces the same lists gets the same record"


# ---- 4.2: gathering a sharded state for the engine -----------------------------------------------

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight",
         "lm_head.weight"]


def _sharded_state():
    """Shards (DTensors on a one-rank mesh) for all but the last tensor, which stays plain."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _group()
    g = torch.Generator().manual_seed(4)
    whole = {n: torch.randn(4, 3, generator=g) for n in NAMES}
    named = [(n, distribute_tensor(t.clone(), mesh, [Shard(0)]) if n != "lm_head.weight" else t.clone())
             for n, t in whole.items()]
    return named, whole


class _CountGathers:
    """Counts DTensor.full_tensor calls; each returns a fresh tensor (as a real all-gather does)."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor
        self.cls, self.original, self.count = DTensor, DTensor.full_tensor, 0

        def counted(dtensor, *args, **kwargs):
            self.count += 1
            return self.original(dtensor, *args, **kwargs).clone()
        DTensor.full_tensor = counted
        return self

    def __exit__(self, *exc):
        self.cls.full_tensor = self.original


@pytest.mark.exercise("4.2")
def test_gather_by_layer_groups_and_gathers(ex):
    named, whole = _sharded_state()
    with _CountGathers():
        layers = list(ex.gather_by_layer(iter(named)))
    assert [[n for n, _ in layer] for layer in layers] == [NAMES[:1], NAMES[1:3], NAMES[3:5], NAMES[5:6], NAMES[6:]], \
        "one list per decoder layer (consecutive names with the same layer_key), any other tensor alone, in order"
    for layer in layers:
        for name, tensor in layer:
            assert type(tensor) is torch.Tensor, f"{name}: yield whole tensors (full_tensor()), not DTensor shards"
            assert torch.equal(tensor, whole[name]), f"{name}: the gathered tensor must equal the whole one"


@pytest.mark.exercise("4.2")
def test_gather_by_layer_gathers_lazily_and_lets_go(ex):
    named, _ = _sharded_state()
    with _CountGathers() as gathers:
        stream = ex.gather_by_layer(iter(named))
        seen, alive = 0, []
        for layer in stream:
            seen += sum(1 for n, _ in layer if n != "lm_head.weight")
            assert gathers.count == seen, \
                "gather a layer only when it is asked for: the whole state gathered up front costs a model's memory"
            assert not any(ref() is not None for ref in alive), \
                "the generator kept an earlier layer alive: drop it once it is yielded"
            alive = [weakref.ref(t) for _, t in layer]
            del layer
    assert gathers.count == len(NAMES) - 1, "every shard gathered exactly once; plain tensors are not gathered"


# ---- 4.3: merging a LoRA adapter by hand ----------------------------------------------------------

@pytest.mark.exercise("4.3")
def test_merge_lora_against_peft(ex):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    base = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False))
    lora = get_peft_model(base, LoraConfig(r=2, lora_alpha=6, target_modules=["0"], lora_dropout=0.0))
    layer = lora.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    W, A, B = (layer.base_layer.weight.detach().clone(), layer.lora_A["default"].weight.detach(),
               layer.lora_B["default"].weight.detach())
    before = W.clone()
    merged = ex.merge_lora(W, A, B, 6 / 2)
    assert merged.shape == (4, 6), "the merged weight has the base weight's shape [out, in]"
    assert torch.equal(W, before), "return a new tensor; the base weight must stay as it is"
    expected = lora.merge_and_unload()[0].weight.detach()
    assert torch.allclose(merged, expected, atol=1e-6), "W + scaling * B @ A, with scaling = alpha / r (peft's merge)"


@pytest.mark.exercise("4.3")
def test_merge_lora_dtype_and_precision(ex):
    g = torch.Generator().manual_seed(6)
    W = torch.randn(8, 5, generator=g).to(torch.bfloat16)
    A, B = torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(8, 3, generator=g).to(torch.bfloat16)
    merged = ex.merge_lora(W, A, B, 0.37)
    assert merged.dtype == torch.bfloat16, "return the base weight's dtype"
    expected = (W.float() + 0.37 * (B.float() @ A.float())).to(torch.bfloat16)
    assert torch.equal(merged, expected), "compute the product and the sum in float32, then cast once"
