"""Graded checks of notebook 06's exercises (python -m minirl.grade --only 06): no Ray cluster needed."""

import pytest
import torch

from minirl.data import Batch, Rollout


def error_of(fn, *args):
    """The exception fn(*args) raises, or None (checked with an assert: a missing error fails the check)."""
    try:
        fn(*args)
    except Exception as err:  # any exception is an answer to check
        return err
    return None


def rollout_of(n_prompts: int, G: int = 2) -> Rollout:
    N = n_prompts * G
    return Rollout(torch.arange(N * 3).view(N, 3), torch.ones(N, 3, dtype=torch.long), torch.arange(N * 2).view(N, 2),
                   torch.ones(N, 2, dtype=torch.long), torch.zeros(N, 2), [f"c{i}" for i in range(N)],
                   [f"p{i // G}" for i in range(N)], 0, num_generations=G)


@pytest.mark.exercise("6.2")
def test_split_by_rank_lists_are_contiguous_and_in_order(ex):
    out = ex.split_by_rank(3, ["a", "b", "c", "d", "e", "f"], "sampling", 7)
    assert out == [(["a", "b"], "sampling", 7), (["c", "d"], "sampling", 7), (["e", "f"], "sampling", 7)], \
        "rank r gets the r-th contiguous slice, followed by the other arguments unchanged"
    assert ex.split_by_rank(1, ["a", "b"]) == [(["a", "b"],)], "one rank gets everything"


@pytest.mark.exercise("6.2")
def test_split_by_rank_keeps_groups_whole_and_concat_gives_the_batch_back(ex):
    ro = rollout_of(4, G=2)
    parts = ex.split_by_rank(2, ro)
    assert len(parts) == 2 and all(len(p) == 1 for p in parts), "one (part,) tuple per rank"
    assert [p[0].prompts for p in parts] == [["p0", "p0", "p1", "p1"], ["p2", "p2", "p3", "p3"]], \
        "contiguous parts of whole groups: a prompt's completions stay together"
    back = Batch.concat([p[0] for p in parts])
    assert torch.equal(back.completion_ids, ro.completion_ids) and back.completions == ro.completions


@pytest.mark.exercise("6.2")
def test_split_by_rank_refuses_unequal_parts(ex):
    err = error_of(ex.split_by_rank, 2, ["a", "b", "c", "d", "e"])
    assert isinstance(err, ValueError) and "5" in str(err), "5 prompts do not split into 2 equal parts: ValueError"
    err = error_of(ex.split_by_rank, 2, rollout_of(3, G=2))
    assert isinstance(err, ValueError), "6 rows are 3 groups of 2, which do not halve into whole groups: ValueError"


NODES = [{"node_id": "n0", "CPU": 2.0, "GPU": 0.0}, {"node_id": "n1", "CPU": 2.0, "GPU": 0.0}]


@pytest.mark.exercise("6.1")
def test_plan_placement_first_fit_in_order(ex):
    pools = {"train": ex.ResourcePool([2], cpus_per_device=1.0), "rollout": ex.ResourcePool([1], cpus_per_device=1.0)}
    assert ex.plan_placement(pools, NODES) == {"train": [0], "rollout": [1]}, \
        "train fills node0 (2 x 1 CPU); rollout goes to the first node with room left: node1"
    small = {"a": ex.ResourcePool([1]), "b": ex.ResourcePool([3])}
    assert ex.plan_placement(small, NODES) == {"a": [0], "b": [0]}, "0.25 + 3 x 0.25 CPU fit node0"


@pytest.mark.exercise("6.1")
def test_plan_placement_spans_distinct_nodes(ex):
    assert ex.plan_placement({"train": ex.ResourcePool([1, 1])}, NODES) == {"train": [0, 1]}, \
        "a pool's entries go to different nodes, even when the first has room for both"
    err = error_of(ex.plan_placement, {"train": ex.ResourcePool([1, 1, 1])}, NODES)
    assert isinstance(err, ex.PlacementError) and "train" in str(err), \
        "three entries need three different nodes; with two, raise PlacementError naming the pool"


@pytest.mark.exercise("6.1")
def test_plan_placement_counts_what_earlier_pools_took(ex):
    pools = {"a": ex.ResourcePool([2], cpus_per_device=1.0), "b": ex.ResourcePool([2], cpus_per_device=1.0),
             "c": ex.ResourcePool([1], cpus_per_device=1.0)}
    err = error_of(ex.plan_placement, pools, NODES)
    assert isinstance(err, ex.PlacementError) and "'c'" in str(err), \
        "a and b take both nodes' CPUs: pool 'c' does not fit, raise PlacementError naming it"


@pytest.mark.exercise("6.1")
def test_plan_placement_fractional_cpus_and_gpus(ex):
    node = [{"CPU": 0.3, "GPU": 0.0}]
    assert ex.plan_placement({"x": ex.ResourcePool([3], cpus_per_device=0.1)}, node) == {"x": [0]}, \
        "3 x 0.1 CPU is 0.30000000000000004 in floating point: compare with the 1e-9 tolerance"
    err = error_of(ex.plan_placement, {"gpus": ex.ResourcePool([1], "gpu")}, NODES)
    assert isinstance(err, ex.PlacementError) and "gpus" in str(err), \
        "a GPU pool on nodes without GPUs: raise PlacementError naming the pool"
    cluster = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 4.0}]
    assert ex.plan_placement({"g": ex.ResourcePool([4], "gpu", 1.0)}, cluster) == {"g": [1]}, \
        "4 GPUs: node0 has only 2"


def record(step, sync, critic=False, **times):
    base = {"step": step, "time/generate": 1.0 * step, "time/score": 0.1, "time/reference": 0.2,
            "time/advantages": 0.01, "time/update": 2.0, "time/sync": sync, "time/step": 4.0}
    return base | ({"time/update_critic": 0.5} if critic else {}) | times


@pytest.mark.exercise("6.3")
def test_driver_cycles_shift_the_sync_by_one_step(ex):
    cycles = ex.driver_cycles([record(1, 0.3), record(2, 0.4), record(3, 0.5)])
    assert [c["sync"] for c in cycles] == [0.0, 0.3, 0.4], \
        "iteration k starts with the sync that ended step k-1 (0.0 before the first)"
    assert [c["generate"] for c in cycles] == [1.0, 2.0, 3.0], "the other stages are the step's own"


@pytest.mark.exercise("6.3")
def test_driver_cycles_read_in_the_source_order(ex):
    cycles = ex.driver_cycles([record(1, 0.3, critic=True)])
    assert list(cycles[0]) == ["sync", "generate", "score", "reference", "advantages", "update", "update_critic"]
    grpo = ex.driver_cycles([record(1, 0.3)])
    assert "update_critic" not in grpo[0], "a stage no record has (GRPO has no critic) is left out"


@pytest.mark.exercise("6.3")
def test_driver_cycles_skip_records_without_a_step(ex):
    cycles = ex.driver_cycles([{"step": 0, "accuracy": 0.5}, record(1, 0.3), record(2, 0.4, accuracy=0.6)])
    assert len(cycles) == 2 and cycles[1]["sync"] == 0.3, "the step-0 evaluation record is not a step"
