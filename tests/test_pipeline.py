"""Pipeline schedules: the simulator against the closed forms and torch's DualPipeV, bad input, and a real
two-process pipeline under torchrun (minirl.parallel.pipeline, minirl.runtime.pipeline_job)."""

import pytest

from minirl.parallel.pipeline import (
    SCHEDULES,
    bubble_formulas,
    bubble_share,
    gpipe_order,
    one_f_one_b_order,
    one_f_one_b_schedule,
    schedule_orders,
    simulate_schedule,
)
from minirl.runtime.dualpipev import dualpipev_order
from minirl.runtime.moe_checks import PipelineError, check_pipeline
from minirl.runtime.pipeline_job import compare_with_simulator, launch_pipeline, measured_timelines, split_layers
from minirl.runtime.pipeline_sim import simulate
from minirl.runtime.pipeline_types import Costs, Op


@pytest.mark.parametrize("P, M", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 16)])
@pytest.mark.parametrize("backward", [1.0, 2.0, 3.5])
def test_gpipe_and_1f1b_bubble_is_exactly_the_closed_form(P, M, backward):
    costs = Costs(forward=1.0, backward=backward)
    for schedule in ("gpipe", "1f1b"):
        t = simulate_schedule(schedule, P, M, costs)
        assert t.bubble_ratio == pytest.approx((P - 1) / M), schedule
        assert t.bubble_share == pytest.approx((P - 1) / (M + P - 1)), schedule
        assert t.makespan == pytest.approx((M + P - 1) * (1.0 + backward))


@pytest.mark.parametrize("P, M", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 32)])
def test_dualpipev_halves_the_bubble_at_b_equals_f_and_matches_deepseeks_table_at_2f(P, M):
    even = simulate_schedule("dualpipev", P, M, Costs(1.0, 1.0))
    assert even.bubble_ratio == pytest.approx((P - 1) / (2 * M)), "the source's (P-1)/2M holds when B = F"
    usual = simulate_schedule("dualpipev", P, M, Costs(1.0, 2.0))
    assert usual.bubble_ratio == pytest.approx(bubble_formulas(P, M, Costs(1.0, 2.0))["dualpipev_table"])
    assert usual.bubble_ratio == pytest.approx((P - 1) / (3 * M))
    assert usual.bubble_ratio < simulate_schedule("1f1b", P, M, Costs(1.0, 2.0)).bubble_ratio


def test_dualpipev_order_is_torchs():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules.ScheduleDualPipeV, "_calculate_single_rank_operations"):
        pytest.skip("torch's private DualPipeV layout method moved")
    kinds = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B", schedules.BACKWARD_INPUT: "I",
             schedules.BACKWARD_WEIGHT: "W"}

    def ours(action):
        if action.computation_type == schedules.OVERLAP_F_B:
            return tuple(ours(a) for a in action.sub_actions)
        return Op(kinds[action.computation_type], action.microbatch_index, action.stage_index)
    for P, M in [(2, 4), (2, 9), (3, 6), (4, 8), (5, 13)]:
        torch_schedule = object.__new__(schedules.ScheduleDualPipeV)
        torch_schedule.pp_group_size, torch_schedule._n_microbatches = P, M
        for rank, actions in dualpipev_order(P, M).items():
            assert [ours(a) for a in torch_schedule._calculate_single_rank_operations(rank)] == actions, (P, M, rank)


def test_1f1b_keeps_at_most_stages_in_flight():
    P, M = 4, 10
    for stage in range(P):
        order = one_f_one_b_order(stage, P, M)
        in_flight = peak = 0
        for op in order:
            in_flight += 1 if op.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == P - stage, "1F1B bounds stored activations by the stages still ahead"
        assert [op.microbatch for op in order if op.kind == "B"] == list(range(M))
    gpipe_peak = max(sum(1 for op in gpipe_order(P, M)[0][:i] if op.kind == "F") for i in range(2 * M))
    assert gpipe_peak == M


def test_latency_adds_idle_time_and_per_stage_costs_work():
    free = simulate_schedule("1f1b", 4, 8, Costs(1.0, 2.0)).bubble_share
    slow = simulate_schedule("1f1b", 4, 8, Costs(1.0, 2.0, comm=0.5)).bubble_share
    assert slow > free
    uneven = simulate(one_f_one_b_schedule(2, 4), {0: Costs(1.0, 2.0), 1: Costs(3.0, 6.0)})
    assert uneven.bubble_share > simulate_schedule("1f1b", 2, 4).bubble_share, \
        "an unbalanced split idles the fast stage"


def test_bubble_share_of_a_hand_made_timeline():
    assert bubble_share([(0, 0.0, 1.0), (1, 1.0, 2.0)], 2) == pytest.approx(0.5)
    assert bubble_share([(0, 2.0, 3.0), (0, 3.0, 4.0)], 1) == 0.0, "the span starts at the first event, not at 0"
    with pytest.raises(ValueError, match="empty"):
        bubble_share([], 2)


def test_bad_pipelines_raise_named_errors():
    with pytest.raises(PipelineError, match="num_microbatches=8 exceeds the batch's 4 samples"):
        check_pipeline(2, 8, num_samples=4)
    with pytest.raises(PipelineError, match="num_stages=4 does not divide num_layers=10"):
        split_layers(10, 4)
    assert [list(r) for r in split_layers(6, 3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(PipelineError, match="num_stages=0"):
        gpipe_order(0, 4)
    with pytest.raises(PipelineError, match="DualPipeV needs at least"):
        dualpipev_order(4, 6)
    with pytest.raises(PipelineError, match="schedule='zb'"):
        schedule_orders("zb", 2, 4)
    with pytest.raises(PipelineError, match="stage=2"):
        one_f_one_b_order(2, 2, 4)
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate({0: [Op("B", 0, 0), Op("F", 0, 0)]})
    with pytest.raises(PipelineError, match="needs one forward"):
        simulate({0: [Op("F", 0, 0)]})
    with pytest.raises(PipelineError, match="scheduled twice"):
        simulate({0: [Op("F", 0, 0), Op("F", 0, 0), Op("B", 0, 0)]})
    with pytest.raises(PipelineError, match="appears on ranks"):
        simulate({0: [Op("F", 0, 0)], 1: [Op("B", 0, 0)]})
    with pytest.raises(PipelineError, match="exceeds the batch's 32 samples"):
        launch_pipeline(2, microbatches=(64,), batch=32)
    with pytest.raises(PipelineError, match="does not divide num_layers=7"):
        launch_pipeline(2, layers=7)


@pytest.mark.distributed
def test_real_pipeline_under_torchrun():
    """2 gloo ranks, every schedule at M = 4: the plain model's loss, every compute call timed, idle share sane."""
    result = launch_pipeline(2, microbatches=(4,), layers=4, hidden=32, batch=8, seq=8, repeats=1, timeout=300)
    rows = compare_with_simulator(result)
    assert [r["schedule"] for r in rows] == list(SCHEDULES)
    for r, run in zip(rows, result["runs"], strict=True):
        assert r["loss"] == pytest.approx(r["reference_loss"], abs=1e-5), "a pipeline only reorders the work"
        assert 0.0 < r["measured"] < 1.0 and 0.0 < r["simulated"] < 1.0
        timeline = measured_timelines(run)[0]
        stages = 4 if r["schedule"] == "dualpipev" else 2
        forwards = [e for e in timeline.events if e.op.kind == "F"]
        assert len(forwards) == 4 * stages, "one forward per micro-batch and stage"
        assert {(e.op.microbatch, e.op.stage) for e in forwards} == {(m, s) for m in range(4) for s in range(stages)}
        grads = {(e.op.microbatch, e.op.stage) for e in timeline.events if e.op.kind in ("B", "I")}
        assert len(grads) == 4 * stages
