"""Graded checks of notebook 04's exercises (python -m minirl.grade --only 04)."""

import weakref

import pytest
import torch

from minirl.algo.losses import aggregate_loss


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


# ---- 4.1: a rank's share of the loss ---------------------------------------------------------------

@pytest.mark.exercise("4.1")
def test_rank_loss_weight_values(ex):
    assert ex.rank_loss_weight("dapo", 3, 8, 2, 4, 2) == pytest.approx(0.75), \
        "dapo: world_size * local_tokens / global_tokens (2 * 3 / 8)"
    assert ex.rank_loss_weight("dapo", 5, 8, 2, 4, 2) == pytest.approx(1.25), "the ranks' dapo weights average to 1"
    assert ex.rank_loss_weight("grpo", 3, 8, 2, 4, 2) == pytest.approx(1.0), \
        "grpo: world_size * local_rows / global_rows, not tokens"
    assert ex.rank_loss_weight("dr_grpo", 7, 8, 1, 4, 2) == pytest.approx(0.5), "dr_grpo: by rows, like grpo"
    assert ex.rank_loss_weight("bnpo", 3, 8, 2, 4, 2) == pytest.approx(1.0), \
        "bnpo: TRL divides by each process's own tokens, so no weight"
    assert ex.rank_loss_weight("dapo", 0, 0, 2, 4, 2) == pytest.approx(2.0), \
        "token counts of 0 count as 1 (the loss clamps them): no division by zero"
    for loss_type in ("grpo", "dr_grpo"):
        assert ex.rank_loss_weight(loss_type, 0, 8, 0, 4, 2) == pytest.approx(0.0), \
            f"{loss_type}: a rank with no rows counts for nothing (w = 0), not 1"
        weights = [ex.rank_loss_weight(loss_type, t, 8, r, 4, 3) for t, r in ((5, 3), (0, 0), (3, 1))]
        assert sum(weights) == pytest.approx(3.0), \
            f"{loss_type}: the ranks' weights sum to world_size, a rank with no rows included ({weights})"
    with pytest.raises(ValueError, match="loss_type"):
        ex.rank_loss_weight("ppo", 1, 2, 1, 2, 2)


@pytest.mark.exercise("4.1")
def test_weighted_rank_gradients_average_to_the_whole_batch(ex):
    """Split a batch over 3 'ranks'; (1/W) sum_r w_r grad(loss_r) must be the whole batch's gradient."""
    g = torch.Generator().manual_seed(3)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) < 0.6).long()
    mask[:, 0] = 1
    rows = [slice(0, 2), slice(2, 4), slice(4, 6)]
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        x = per_token.clone().requires_grad_(True)
        aggregate_loss(x, mask, loss_type, 5).backward()
        whole = x.grad.clone()
        x.grad = None
        total = int(mask.sum())
        for part in rows:
            weight = ex.rank_loss_weight(loss_type, int(mask[part].sum()), total, 2, 6, 3)
            (weight / 3 * aggregate_loss(x[part], mask[part], loss_type, 5)).backward()
        assert torch.allclose(x.grad, whole, atol=1e-6), \
            f"{loss_type}: the ranks' weighted gradients, averaged, must equal the whole batch's gradient"


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
