"""Expert parallelism across 2 gloo ranks (minirl.parallel.expert): the single-process layer's output and
gradients, the rows exchanged, and bad settings."""

import pytest

from minirl.parallel.expert import local_experts
from minirl.runtime.expert_job import launch_expert_parallel


def test_experts_split_evenly_or_a_named_error():
    assert [list(local_experts(8, 2, r)) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(local_experts(6, 3, 2)) == [4, 5]
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by world_size=4"):
        local_experts(6, 4, 0)
    with pytest.raises(ValueError, match="num_experts=6"):
        launch_expert_parallel(4, experts=6)
    with pytest.raises(ValueError, match="tokens=255"):
        launch_expert_parallel(2, tokens=255)


@pytest.mark.distributed
def test_expert_parallel_equals_the_single_process_layer():
    """Outputs and gradients match; every (token, slot) row is computed once; a hot spot loads one rank."""
    result = launch_expert_parallel(2, hidden=32, experts=4, top_k=2, tokens=256, skew=0.5, repeats=1, timeout=300)
    rows = {(r["scenario"], r["rank"]): r for r in result["rows"]}
    assert len(rows) == 4
    for r in rows.values():
        assert r["max_abs_output"] < 1e-5 and r["max_abs_input_grad"] < 1e-5 and r["max_abs_expert_grad"] < 1e-5
        assert r["tokens"] == 128
        assert 0 < r["rows_sent_away"] < 128 * 2
        assert r["bytes_sent"] > r["rows_sent_away"] * 32 * 4, "dispatch and combine both cross ranks"
    for scenario in ("router as built", "skewed router"):
        assert rows[(scenario, 0)]["rows_received"] + rows[(scenario, 1)]["rows_received"] == 256 * 2
    hot = rows[("skewed router", 0)]["rows_received"]
    assert hot > 1.5 * rows[("skewed router", 1)]["rows_received"], "the hot experts live on rank 0"
