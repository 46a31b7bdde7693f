"""Graded checks of notebook 03's exercises (training memory)."""

import pytest

GB = 1e9


@pytest.mark.exercise("3.1")
def test_bytes_per_param_mixed(ex):
    per = ex.bytes_per_param("mixed")
    assert per["weights"] == 2 and per["grads"] == 2, "mixed precision: BF16 weights and gradients are 2 B each"
    assert per["master"] == 4 and per["adam_m"] == 4 and per["adam_v"] == 4, "FP32 master, m and v are 4 B each"
    assert per["total"] == 16, "the total is the sum of the five components: 16 B"
    assert ex.bytes_per_param() == per, "precision defaults to 'mixed'"
    assert all(type(v) is int for v in per.values()), "all values are ints (bytes)"


@pytest.mark.exercise("3.1")
def test_bytes_per_param_variants(ex):
    assert ex.bytes_per_param("fp32") == dict(weights=4, grads=4, master=0, adam_m=4, adam_v=4, total=16), \
        "fp32: 4 B weights and gradients, no master copy, 4 B m and v: 16 B"
    assert ex.bytes_per_param("bf16") == dict(weights=2, grads=2, master=0, adam_m=2, adam_v=2, total=8), \
        "pure bf16: everything 2 B, no master copy: 8 B"
    with pytest.raises(ValueError, match="precision"):
        ex.bytes_per_param("int4")


@pytest.mark.exercise("3.2")
def test_zero_per_gpu_stages(ex):
    psi = 1e9
    z0, z1 = ex.zero_per_gpu(psi, 8, 0), ex.zero_per_gpu(psi, 8, 1)
    assert z0["total"] == pytest.approx(16e9), "stage 0 (DDP) replicates all 16 B/param"
    assert z1["adam_m"] == pytest.approx(4e9 / 8) and z1["weights"] == pytest.approx(2e9), \
        "stage 1 divides master, m and v by N, not weights"
    z2 = ex.zero_per_gpu(psi, 8, 2)
    assert z2["grads"] == pytest.approx(2e9 / 8) and z2["weights"] == pytest.approx(2e9), \
        "stage 2 also divides the gradients, weights stay whole"
    assert ex.zero_per_gpu(psi, 8, 3)["total"] == pytest.approx(2e9), "stage 3 divides everything: 16 B / 8"


@pytest.mark.exercise("3.2")
def test_zero_per_gpu_every_component(ex):
    whole = dict(weights=2e9, grads=2e9, master=4e9, adam_m=4e9, adam_v=4e9)
    sharded = {0: (), 1: ("master", "adam_m", "adam_v"), 2: ("grads", "master", "adam_m", "adam_v"),
               3: ("weights", "grads", "master", "adam_m", "adam_v")}
    for stage, parts in sharded.items():
        z = ex.zero_per_gpu(1e9, 4, stage)
        want = {k: v / 4 if k in parts else v for k, v in whole.items()}
        for k, v in want.items():
            assert z[k] == pytest.approx(v), f"stage {stage}: {k} should be {v:.3g} B per GPU, got {z[k]:.3g}"
        assert z["total"] == pytest.approx(sum(want.values())), f"stage {stage}: total is the sum of the five"


@pytest.mark.exercise("3.2")
def test_zero_per_gpu_total_and_precision(ex):
    z = ex.zero_per_gpu(70e9, 4, 2, "fp32")
    parts = sum(z[k] for k in ("weights", "grads", "master", "adam_m", "adam_v"))
    assert z["total"] == pytest.approx(parts), "'total' must be the sum of the five components"
    assert z["weights"] == pytest.approx(280e9) and z["master"] == 0, "fp32: 4 B weights, no master copy"
    assert ex.zero_per_gpu(1e9, 1, 3)["total"] == pytest.approx(16e9), "on one GPU every stage holds 16 B/param"


@pytest.mark.exercise("3.3")
def test_checkpointed_none_and_full(ex):
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 30.0, 8, "none") == pytest.approx(830), \
        "none: L * layer + head"
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 30.0, 8, "full") == pytest.approx(140), \
        "full: L * boundary + max(head, layer)"
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 300.0, 8, "full") == pytest.approx(340), \
        "full: when the head is larger than a layer, the head sets the peak"


@pytest.mark.exercise("3.3")
def test_checkpointed_sqrt_segments(ex):
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 0.0, 16, "sqrt") == pytest.approx(4 * 5 + 4 * 100), \
        "sqrt with L=16: k=4 segment inputs + one segment of 4 layers"
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 0.0, 10, "sqrt") == pytest.approx(4 * 5 + 3 * 100), \
        "sqrt with L=10: k=ceil(sqrt(10))=4 segments of ceil(10/4)=3 layers"
    assert ex.checkpointed_activation_bytes(100.0, 5.0, 1000.0, 16, "sqrt") == pytest.approx(4 * 5 + 1000), \
        "sqrt: when the head is larger than a segment (4 x 100), the head sets the peak"
    with pytest.raises(ValueError, match="recompute"):
        ex.checkpointed_activation_bytes(1.0, 1.0, 1.0, 4, "half")


@pytest.mark.exercise("3.4")
def test_min_gpus_zero3(ex):
    assert ex.min_gpus(70e9, 80 * GB, 3) == 14, "16 B x 70e9 = 1120 GB over 80 GB GPUs: 14"
    assert ex.min_gpus(70e9, 80 * GB, 3, activation_bytes=10 * GB) == 16, \
        "with 10 GB of activations per GPU only 70 GB is left for state: ceil(1120/70) = 16"
    assert ex.min_gpus(1e9, 80 * GB, 3) == 1, "a 1B model (16 GB) fits one 80 GB GPU"
    assert ex.min_gpus(70e9, 80 * GB, 3, "bf16") == 7, "precision counts: pure bf16 needs 8 B x 70e9 = 560 GB: 7"


@pytest.mark.exercise("3.4")
def test_min_gpus_exact_fit_and_max_gpus(ex):
    assert ex.min_gpus(1e9, 16 * GB, 0) == 1, "16 GB of state on a 16 GB GPU fits: the need may equal the memory"
    assert ex.min_gpus(1e9, 4 * GB, 3) == 4, "16 GB over 4 GB GPUs: exactly 4"
    assert ex.min_gpus(70e9, 80 * GB, 3, max_gpus=13) is None, "14 GPUs are needed: more than max_gpus gives None"
    assert ex.min_gpus(70e9, 80 * GB, 3, max_gpus=14) == 14


@pytest.mark.exercise("3.4")
def test_min_gpus_impossible(ex):
    assert ex.min_gpus(70e9, 80 * GB, 0) is None, "DDP never shrinks: 1120 GB never fits 80 GB"
    assert ex.min_gpus(70e9, 80 * GB, 2) is None, "ZeRO-2 keeps 2 B/param of weights (140 GB) replicated"
    assert ex.min_gpus(7e9, 80 * GB, 1) == 2, \
        "ZeRO-1, 7B: 28 GB replicated + 84 GB / N must fit 80 GB: N = 2 (70 GB), not 1 (112 GB)"
