"""Measured memory against the calculator: activations and LoRA (memory.measure), ZeRO under torchrun (.distributed)."""

import pytest
import torch

from minirl.memory.calculator import ModelShape, activation_memory
from minirl.memory.measure import (
    SavedActivationMeter,
    build_measure_model,
    measure_activations,
    measure_lora,
    padded_mask,
    random_batch,
    storage_bytes,
    time_recomputation,
)
from minirl.runtime.zero_measure import compare_measured, launch_measurement


@pytest.fixture(scope="module")
def tiny():
    return build_measure_model("tiny")


def test_meter_counts_a_storage_once_and_frees_it():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivationMeter(exclude=[w]) as meter:
        y = (x @ w).relu()            # matmul saves x (and w, excluded); relu saves its output
        z = (x * 2).sum() + y.sum()   # x * 2 saves nothing for x's grad (a constant)
        assert meter.live == x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
        z.backward()
    assert meter.live == 0, "every saved tensor is released after backward"
    assert meter.peak == 2 * 4 * 8 * 4


@pytest.mark.parametrize("checkpointing, mode", [(False, "none"), (True, "full")])
def test_activations_match_the_calculator(tiny, checkpointing, mode):
    x = random_batch(2, 24)
    measured = measure_activations(tiny, x, checkpointing)["peak_bytes"]
    tiny.zero_grad(set_to_none=True)
    calc = activation_memory(ModelShape.from_config(tiny.config), 2, 24, "fp32", "sdpa", mode)["total"]
    assert measured == pytest.approx(calc, rel=0.05), f"{mode}: measured {measured} vs calculator {calc}"


def test_padded_batch_matches_the_padded_formula(tiny):
    """SDPA with a padding mask keeps full-width K/V and the mask: measured against both formulas (item 17)."""
    x, mask = random_batch(2, 32), padded_mask(2, 32)
    assert mask[0, :8].sum() == 0 and mask[1].all()
    measured = measure_activations(tiny, x, attention_mask=mask)["peak_bytes"]
    tiny.zero_grad(set_to_none=True)
    shape = ModelShape.from_config(tiny.config)
    padded = activation_memory(shape, 2, 32, "fp32", padding_mask=True)["total"]
    plain = activation_memory(shape, 2, 32, "fp32")["total"]
    assert measured == pytest.approx(padded, rel=0.02)
    assert measured > 1.03 * plain, "the unpadded formula undercounts a padded batch"


def test_recomputation_timing_reports_median_and_spread(tiny):
    threads = torch.get_num_threads()
    t = time_recomputation(tiny, random_batch(1, 8), repeats=3)
    assert t["slowdown_low"] <= t["slowdown"] <= t["slowdown_high"] and t["repeats"] == 3
    assert t["clock"] == "process_time, 1 thread" and torch.get_num_threads() == threads
    assert t["plain_s"] > 0 and t["checkpointed_s"] > 0
    with pytest.raises(ValueError, match="repeats=0"):
        time_recomputation(tiny, random_batch(1, 8), repeats=0)


def test_checkpointing_saves_activations(tiny):
    x = random_batch(2, 32)
    plain = measure_activations(tiny, x, False)["peak_bytes"]
    tiny.zero_grad(set_to_none=True)
    ckpt = measure_activations(tiny, x, True)["peak_bytes"]
    tiny.zero_grad(set_to_none=True)
    assert ckpt < 0.7 * plain


def test_lora_state_matches_the_calculator():
    lo = measure_lora("tiny", rank=4, batch=2, seq=16)
    assert lo["trainable_params"] == lo["trainable_calculator"]
    assert lo["grads"] == lo["grads_calculator"] and lo["adam"] == lo["adam_calculator"]
    assert lo["frozen_with_grad"] == 0
    assert lo["trainable_params"] < 0.1 * lo["base_params"]


def test_storage_bytes_counts_views_once():
    t = torch.zeros(10)
    assert storage_bytes([t, t[:5], t.view(2, 5), None]) == 40


def test_bad_strategy_and_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        launch_measurement(0)
    with pytest.raises(ValueError, match=r"strategies=\['zero4'\]"):
        launch_measurement(2, strategies=("zero4",))
    with pytest.raises(ValueError, match="size='huge'"):
        build_measure_model("huge")


@pytest.mark.distributed
def test_zero_stages_under_torchrun_match_the_calculator():
    """World size 2, tiny model, all four strategies in one torchrun job (gloo on CPU)."""
    rows = launch_measurement(2, size="tiny", batch=2, seq=16, timeout=300)
    assert {r["rank"] for r in rows} == {0, 1} and len(rows) == 8
    table = compare_measured(rows)
    assert all(r["verdict"] in ("agree", "explained") for r in table), \
        [r for r in table if r["verdict"] == "DIFFER"]
    by = {(r["strategy"], r["component"]): r for r in table}
    for strategy in ("ddp", "zero1", "fsdp_noreshard", "fsdp"):
        for comp in ("grads", "adam_m", "adam_v"):
            assert by[(strategy, comp)]["ratio"] == pytest.approx(1, abs=0.05), (strategy, comp)
    assert by[("fsdp", "state")]["ratio"] == pytest.approx(1, abs=0.05)
    assert by[("fsdp_noreshard", "weights_step")]["ratio"] == pytest.approx(1.5, abs=0.05)
    psi = rows[0]["num_params"]
    assert by[("fsdp", "state")]["measured_mean"] == pytest.approx(16 * psi / 2, rel=0.05)
    assert by[("ddp", "state")]["measured_mean"] == pytest.approx(16 * psi, rel=0.01)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measurement_on_cuda_adds_the_allocator_peaks():
    """On a GPU the same job runs on NCCL and adds torch.cuda.max_memory_allocated to each row."""
    rows = launch_measurement(1, strategies=("ddp", "fsdp"), size="tiny", batch=2, seq=16, timeout=300)
    assert {r["strategy"] for r in rows} == {"ddp", "fsdp"}
    for r in rows:
        assert r["device"].startswith("cuda") and r["cuda_peak"] >= r["cuda_at_rest"] > 0
        assert r["cuda_peak"] >= r["weights"] + r["grads"] + r["adam_m"] + r["adam_v"]


def test_measurement_model_uses_the_embedded_vocabulary():
    from minirl.memory.measure import VOCAB_SIZE
    from minirl.models.policy import build_tokenizer

    assert VOCAB_SIZE == len(build_tokenizer())


def test_a_failed_job_runs_again_then_reports_both_ends(monkeypatch):
    """A gloo job that aborts on an overloaded machine is retried; a second failure shows the rank's own error."""
    import subprocess
    import warnings

    import minirl.runtime.zero_measure as distributed

    calls = []

    def aborting(target, nproc, args=(), **kwargs):          # the one launcher, minirl.runtime.launch.torchrun
        calls.append((target, nproc, list(args), kwargs))
        return subprocess.CompletedProcess(target, -6, stdout="rank 0: terminate called\n" + "x" * 9000, stderr="")

    monkeypatch.setattr(distributed, "torchrun", aborting)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError) as err:
        warnings.simplefilter("always")
        launch_measurement(2, size="tiny")
    assert len(calls) == 2 and "attempt 1 of 2" in str(caught[0].message)
    assert calls[0][:2] == ("minirl.runtime.zero_measure:memory_worker", 2) and calls[0][3]["timeout"] == 600
    assert "failed with code -6" in str(err.value) and "rank 0: terminate called" in str(err.value)
