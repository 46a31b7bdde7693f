"""Graded checks of notebook 03's exercises (training memory)."""

import pytest

GB = 1e9


@pytest.mark.exercise("3.1")
def test_bytes_per_param_mixed(ex):
    per = ex.bytes_per_param("mixed")
    assert per["weights"] == 2 and per["grads"] == 2, "mixed precision: BF16 weights and gradients are 2 B each"
    assert per["master"] == 4 and per["adam_m"] == 4 and per["adam_v"] == 4, "FP32 master, m and v are 4 B each"
    assert per["total"] == 16, "the total is the sum of the five components: 16 B"


@pytest.mark.exercise("3.1")
def test_bytes_per_param_variants(ex):
    fp32 = ex.bytes_per_param("fp32")
    assert (fp32["weights"], fp32["master"], fp32["total"]) == (4, 0, 16), "fp32: 4 B weights, no master copy, 16 B"
    bf16 = ex.bytes_per_param("bf16")
    assert (bf16["adam_m"], bf16["total"]) == (2, 8), "pure bf16: Adam moments are 2 B, total 8 B"
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
    with pytest.raises(ValueError, match="recompute"):
        ex.checkpointed_activation_bytes(1.0, 1.0, 1.0, 4, "half")


@pytest.mark.exercise("3.4")
def test_min_gpus_zero3(ex):
    assert ex.min_gpus(70e9, 80 * GB, 3) == 14, "16 B x 70e9 = 1120 GB over 80 GB GPUs: 14"
    assert ex.min_gpus(70e9, 80 * GB, 3, activation_bytes=10 * GB) == 16, \
        "with 10 GB of activations per GPU only 70 GB is left for state: ceil(1120/70) = 16"
    assert ex.min_gpus(1e9, 80 * GB, 3) == 1, "a 1B model (16 GB) fits one 80 GB GPU"


@pytest.mark.exercise("3.4")
def test_min_gpus_impossible(ex):
    assert ex.min_gpus(70e9, 80 * GB, 0) is None, "DDP never shrinks: 1120 GB never fits 80 GB"
    assert ex.min_gpus(70e9, 80 * GB, 2) is None, "ZeRO-2 keeps 2 B/param of weights (140 GB) replicated"
    assert ex.min_gpus(7e9, 80 * GB, 1) == 2, \
        "ZeRO-1, 7B: 28 GB replicated + 84 GB / N must fit 80 GB: N = 2 (70 GB), not 1 (112 GB)"
