"""Stage 9: the time decomposition of run directories (shares, nesting, overlap, bad files), FLOP counting and peaks,
and the profiler callback on a real run (trace, operators, stages; the run computes what it computes without it).

The synthetic run directories built here (`make_run`) are shared with tests/test_profiling_rules.py and
tests/test_chapter09.py.
"""

import dataclasses
import gzip
import json
import math

import pytest
import torch
from transformers import Qwen2Config

from minirl.config import RLConfig
from minirl.profiling.decompose import CATEGORIES, decompose, stage_shares
from minirl.profiling.mfu import (
    forward_flops,
    generation_flops,
    group_forward_flops,
    run_mfu,
    step_flops,
    training_flops,
)
from minirl.runtime.diagnosis_report import decomposition_table
from minirl.runtime.mfu_inputs import (
    GPU_PEAK_TFLOPS,
    FlopShape,
    FlopShapeError,
    UnknownPeakError,
    flat_config,
    gpu_peak_flops,
    measure_cpu_peak,
    peak_flops,
)
from minirl.runtime.run_records import MetricsFileError, MixedRunsError, NoMetricsError, rank_imbalance

CONFIG = RLConfig.from_flat(steps=10, prompts_per_step=4, num_generations=2, eval_every=0)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=18, max_position_embeddings=32)


def step_record(step: int, *, generate=0.40, score=0.01, reference=0.002, advantages=0.001, update=0.50, sync=0.02,
                other=0.017, prompt_tokens=48, completion_tokens=24, longest=4.0, **extra) -> dict:
    """A stage-1 step record with these stage seconds (time/step = their sum + other)."""
    times = {"time/generate": generate, "time/score": score, "time/reference": reference,
             "time/advantages": advantages, "time/update": update, "time/sync": sync}
    rows = CONFIG.run.prompts_per_step * CONFIG.sampling.num_generations
    record = {"step": step, "reward": 0.5, "loss": 0.1, "version": step, "generated_version": step - 1,
              "completion_length": completion_tokens / rows, "completion_length_max": longest,
              "tokens/prompt": prompt_tokens, "tokens/completion": completion_tokens, **times}
    return record | {"time/step": sum(times.values()) + other} | extra


def make_run(path, records, *, config=CONFIG, model=True, summary=None, eval_record=True, run_info=None, text=None):
    """A run directory as stage 1 leaves it: run.json, metrics.jsonl (text verbatim if given), final/config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "run.json").write_text(json.dumps({"config": dataclasses.asdict(config), "model": None}
                                              | (run_info or {})))
    lines = ([{"step": 0, "version": 0, "accuracy": 0.5, "time/eval": 0.3}] if eval_record else []) + records
    (path / "metrics.jsonl").write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in lines))
    if model:
        Qwen2Config(**TINY, tie_word_embeddings=True).save_pretrained(path / "final")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


# ---------------------------------------------------------------- the decomposition


def test_shares_of_a_stage1_run(tmp_path):
    run = make_run(tmp_path / "r", [step_record(1, update=1.0), step_record(2), step_record(3)])
    d = decompose(run)
    assert d.steps == [1, 2, 3] and list(d.shares) == list(CATEGORIES)
    assert abs(sum(d.shares.values()) - 1) < 1e-12
    total = sum(step_record(s, update=1.0 if s == 1 else 0.5)["time/step"] for s in (1, 2, 3))
    assert abs(d.total_seconds - total) < 1e-12
    assert abs(d.shares["update"] - 2.0 / total) < 1e-12, "a ratio of totals: the slow step weighs more"
    assert abs(d.shares["reference/values"] - 3 * 0.003 / total) < 1e-12
    assert abs(d.shares["other"] - 3 * 0.017 / total) < 1e-9, "what no timer covers"
    assert d.bottleneck == "update" and d.partial == []
    assert len(d.step_shares) == 3 and all(abs(sum(s.values()) - 1) < 1e-9 for s in d.step_shares)
    assert "update" in decomposition_table(d) and "generation" in decomposition_table(d)


def test_sub_timers_move_out_of_their_stage(tmp_path):
    run = make_run(tmp_path / "r", [step_record(1, update=1.0, **{"time/update/all_reduce": 0.3,
                                                                   "time/update/queue_wait": 0.1,
                                                                   "time/update/forward": 0.2})])
    d = decompose(run)
    step = d.step_seconds[0]
    assert abs(d.shares["communication"] - 0.3 / step) < 1e-12
    assert abs(d.shares["waiting"] - 0.1 / step) < 1e-12
    assert abs(d.shares["update"] - 0.6 / step) < 1e-12, "update keeps its own 0.4 s and its forward part"
    assert abs(sum(d.shares.values()) - 1) < 1e-12, "nothing counted twice"


def test_stage4_colocation_timers_are_inside_generate_and_sync(tmp_path):
    run = make_run(tmp_path / "r", [step_record(1, **{"time/sleep": 0.05, "time/wake": 0.01})])
    d = decompose(run)
    assert abs(sum(d.shares.values()) - 1) < 1e-12
    assert abs(d.stage_shares["generate"] + d.stage_shares["sleep"] - 0.40 / d.step_seconds[0]) < 1e-12
    assert abs(d.shares["sync"] - 0.02 / d.step_seconds[0]) < 1e-12


def test_top_level_waiting_and_unknown_stages(tmp_path):
    rec = step_record(1, **{"time/wait": 0.2, "time/data": 0.1})
    rec["time/step"] += 0.3
    d = decompose(make_run(tmp_path / "r", [rec]))
    assert abs(d.shares["waiting"] - 0.2 / rec["time/step"]) < 1e-12
    assert any("data" in note and "other" in note for note in d.partial), d.partial


def test_overlapping_stages_are_shares_of_their_sum(tmp_path):
    rec = step_record(1, generate=1.0, update=1.0)
    rec["time/step"] = 1.2                               # an asynchronous run: rollout and update overlap
    d = decompose(make_run(tmp_path / "r", [rec]))
    assert d.overlapped == 1 and any("overlap" in note for note in d.partial)
    assert abs(sum(d.shares.values()) - 1) < 1e-12 and d.shares["other"] == 0.0


def test_profiled_steps_are_left_out(tmp_path):
    run = make_run(tmp_path / "r", [step_record(1), step_record(2, update=5.0), step_record(3)])
    (run / "profile").mkdir()
    (run / "profile" / "summary.json").write_text(json.dumps({"steps": [2], "per_step": {}}))
    d = decompose(run)
    assert d.steps == [1, 3] and any("profiler" in note for note in d.partial)
    assert decompose(run, exclude_steps=()).steps == [1, 2, 3]


def test_stage_shares_by_hand():
    records = [{"step": 0, "time/eval": 9.0}, {"step": 1, "time/a": 1.0, "time/b": 1.0, "time/step": 4.0},
               {"step": 2, "time/a": 6.0, "time/step": 6.0, "time/eval": 5.0}]
    assert stage_shares(records) == {"a": 0.7, "b": 0.1, "other": pytest.approx(0.2)}
    assert stage_shares([{"step": 0, "time/eval": 1.0}]) == {}


def test_rank_imbalance_from_per_rank_times():
    records = [{"time_by_rank": [{"time/update": 1.0, "time/update/all_reduce": 0.5}, {"time/update": 3.0}]},
               {"time_by_rank": [{"time/update": 2.0}, {"time/update": 2.0}]}]
    assert rank_imbalance(records) == pytest.approx((1.5 + 1.0) / 2)
    assert rank_imbalance([{"time/update": 1.0}]) is None


# ---------------------------------------------------------------- bad run directories


def test_no_run_directory_or_no_metrics(tmp_path):
    with pytest.raises(NoMetricsError, match="not a directory"):
        decompose(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoMetricsError, match="holds no metrics.jsonl"):
        decompose(tmp_path / "empty")
    run = make_run(tmp_path / "r", [], text="")
    with pytest.raises(NoMetricsError, match="holds no metrics.jsonl"):
        decompose(run)
    run = make_run(tmp_path / "eval-only", [])
    with pytest.raises(NoMetricsError, match="no step records"):
        decompose(run)


def test_truncated_last_line_is_left_out_and_said(tmp_path):
    lines = [json.dumps(step_record(s)) for s in (1, 2, 3)]
    text = "\n".join(lines[:2]) + "\n" + lines[2][:40]          # a crash in the middle of the last append
    d = decompose(make_run(tmp_path / "r", [], text=text))
    assert d.steps == [1, 2] and any("cut short" in note for note in d.partial)


def test_damaged_line_in_the_middle_is_an_error(tmp_path):
    lines = [json.dumps(step_record(s)) for s in (1, 2, 3)]
    text = "\n".join([lines[0], lines[1][:30], lines[2]]) + "\n"
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not a JSON record"):
        decompose(make_run(tmp_path / "r", [], text=text))
    with pytest.raises(MetricsFileError, match="time/update"):
        decompose(make_run(tmp_path / "neg", [step_record(1, update=-1.0)]))
    with pytest.raises(MetricsFileError, match="not a record"):
        decompose(make_run(tmp_path / "list", [], text="[1, 2]\n" + lines[0] + "\n"))


def test_two_runs_mixed_in_one_file_are_an_error(tmp_path):
    interleaved = [step_record(1), step_record(2), step_record(1), step_record(3)]
    with pytest.raises(MixedRunsError, match=r"line 4 holds step 1 after step 2"):
        decompose(make_run(tmp_path / "a", interleaved, eval_record=True))
    repeated = [step_record(1), step_record(2), step_record(2)]
    with pytest.raises(MixedRunsError, match="more than one run"):
        decompose(make_run(tmp_path / "b", repeated))


def test_records_of_an_older_version_are_left_out_and_said(tmp_path):
    old = {k: v for k, v in step_record(2).items() if k != "time/step"}
    d = decompose(make_run(tmp_path / "r", [step_record(1), old, step_record(3)]))
    assert d.steps == [1, 3] and any("no time/step" in note for note in d.partial)


# ---------------------------------------------------------------- FLOPs, shapes, peaks, MFU


def test_forward_flops_by_hand():
    assert forward_flops(10, 0, 0, 3, 2) == 2 * (2 * 10 * 3)
    assert forward_flops(0, 1, 1, 3, 1) == 4 * (1 + 2 + 3), "QK and AV, 2 FLOPs each, over 6 causal pairs"
    assert training_flops(10, 1, 4, 5, 0, 1, 3) == 3 * forward_flops(10, 1, 4, 5, 3)


def test_group_sharing_counts_the_prompt_once():
    args = (1000.0, 2, 16)
    one_row = group_forward_flops(*args, prompt_len=6, completion_len=4, group_size=1, groups=3)
    assert one_row == pytest.approx(forward_flops(*args, 10, 3)), "a group of one is a plain forward"
    shared = group_forward_flops(*args, prompt_len=6, completion_len=4, group_size=8, groups=1)
    unshared = forward_flops(*args, 10, 8)
    assert shared == pytest.approx(unshared - 7 * forward_flops(*args, 6, 1)), "7 of 8 prompt forwards saved"
    assert generation_flops(*args, 6, 1, 8, 1) == pytest.approx(forward_flops(*args, 6, 1)), \
        "one new token: the prompt's forward only (the token is sampled, never fed back)"


def test_model_shape_from_configs():
    tied = FlopShape.from_config(Qwen2Config(**TINY, tie_word_embeddings=True))
    untied = FlopShape.from_config(Qwen2Config(**TINY, tie_word_embeddings=False))
    assert tied.params == tied.total_params, "tied: the embedding is also the output matmul"
    assert untied.total_params - untied.params == 18 * 32, "untied: only the lookup is free"
    assert (tied.layers, tied.attn_dim) == (2, 32)
    from transformers import Qwen2MoeConfig
    moe = FlopShape.from_config(Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                vocab_size=18, num_experts=8, num_experts_per_tok=2,
                                                shared_expert_intermediate_size=16))
    assert moe.params < moe.total_params - 18 * 32, "a MoE token multiplies only its top-k experts"


def test_six_n_agrees_with_torchs_flop_counter(make_tiny_policy):
    model, _ = make_tiny_policy(seed=2, num_layers=2)
    shape = FlopShape.from_config(model.config)
    ids = torch.randint(3, 18, (8, 12), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(with_flops=True) as prof:
        model(ids, labels=ids).loss.backward()
    counted = sum(e.flops for e in prof.key_averages())
    assert counted / (3 * forward_flops(shape.params, 0, 0, 12, 8)) == pytest.approx(1.0, abs=0.01)


def test_step_flops_counts_the_passes_of_the_algorithm():
    shape = FlopShape.from_config(Qwen2Config(**TINY))
    record = step_record(1)
    grpo = step_flops(record, flat_config(dataclasses.asdict(CONFIG)), shape)
    ppo = step_flops(record, flat_config(dataclasses.asdict(CONFIG.replace(algo="ppo", beta=0.05))), shape)
    forward = grpo["trainer"] / 3
    assert ppo["trainer"] == pytest.approx(forward * (1 + 1 + 1 + 3 + 3)), \
        "forwards for the reference, pi_old and the values; then actor and critic updates, 3 forwards each"
    assert grpo["trainer_hardware"] == grpo["trainer"]
    config = flat_config(dataclasses.asdict(CONFIG)) | {"gradient_checkpointing": True}
    assert step_flops(record, config, shape)["trainer_hardware"] == pytest.approx(grpo["trainer"] * 4 / 3)


def test_gpu_peaks_from_the_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert gpu_peak_flops("NVIDIA H200", "float32") == 67e12
    assert gpu_peak_flops("NVIDIA H200", "float8_e4m3fn") == 989e12, "minirl's FP8 rollout computes in bfloat16"
    assert gpu_peak_flops("NVIDIA L40S", "bfloat16") == 362e12
    for name, dtype in (("NVIDIA L40", "bfloat16"), ("NVIDIA A10G", "bfloat16"), ("Tesla T4", "bfloat16"),
                        ("Some Future GPU", "float32")):
        with pytest.raises(UnknownPeakError, match="--peak-tflops"):
            gpu_peak_flops(name, dtype)
    assert all(p is None or all(v > 0 for v in p.values()) for _, p in GPU_PEAK_TFLOPS)


def test_peaks_given_measured_or_unknown():
    assert peak_flops("cuda", "bfloat16", peak_tflops=100)[0] == 100e12
    with pytest.raises(ValueError, match="peak_tflops"):
        peak_flops("cpu", "float32", peak_tflops=0)
    with pytest.raises(UnknownPeakError, match="--peak-tflops"):
        peak_flops("xla:0", "float32")
    if not torch.cuda.is_available():
        with pytest.raises(UnknownPeakError, match="no CUDA device"):
            peak_flops("cuda", "bfloat16")
    measured = measure_cpu_peak("float32", 1, 0.05, (64,))
    assert 1e8 < measured < 1e13 and math.isfinite(measured)
    assert torch.get_num_threads() >= 1


def test_run_mfu_and_the_lower_bound_of_old_records(tmp_path):
    run = make_run(tmp_path / "r", [step_record(1), step_record(2)])
    d = decompose(run)
    shape, config = FlopShape.from_run_dir(run), flat_config(dataclasses.asdict(CONFIG))
    report = run_mfu(d.records, config, shape, 1e9, 2e9)
    flops = step_flops(d.records[0], config, shape)
    assert report.trainer == pytest.approx(2 * flops["trainer"] / (1e9 * 2 * (0.002 + 0.001 + 0.5)))
    assert report.rollout == pytest.approx(2 * flops["rollout"] / (2e9 * 2 * 0.4))
    assert report.partial == []
    old = [{k: v for k, v in r.items() if not k.startswith("tokens/")} for r in d.records]
    lower = run_mfu(old, config, shape, 1e9, 2e9)
    assert lower.trainer < report.trainer and any("lower bound" in n for n in lower.partial)
    with pytest.raises(FlopShapeError, match="config.json"):
        FlopShape.from_run_dir(make_run(tmp_path / "nomodel", [step_record(1)], model=False))


# ---------------------------------------------------------------- the profiler callback on a real run


def test_profiler_callback_writes_a_trace_and_observes_only(tmp_path, make_tiny_policy):
    from minirl.profiling.profiler import TorchProfiler
    from minirl.train.run import train

    config = RLConfig.from_flat(steps=3, prompts_per_step=4, num_generations=2, eval_every=0, checkpoint_every=0,
                                rollout_engine="hf")
    runs = {}
    for name, profiled in (("plain", False), ("profiled", True)):
        model, tokenizer = make_tiny_policy(seed=3, num_layers=1)
        callbacks = [TorchProfiler(tmp_path / name, steps=[2])] if profiled else []
        torch.manual_seed(0)
        runs[name] = train(config, model, tokenizer, out_dir=tmp_path / name, progress=False,
                           extra_callbacks=callbacks)
    strip = [[{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs] for rs in runs.values()]
    assert strip[0] == strip[1], "the profiler only observes: the run computes the same records"
    profile = tmp_path / "profiled" / "profile"
    summary = json.loads((profile / "summary.json").read_text())
    assert summary["steps"] == [2]
    step = summary["per_step"]["2"]
    with gzip.open(step["trace"]) as f:
        trace = json.load(f)
    assert len(trace["traceEvents"]) > 1000
    assert (profile / "ops_step-000002.txt").read_text().count("aten::") > 10
    names = [op["name"] for op in step["top_operators"]]
    assert any(n in ("aten::mm", "aten::addmm") for n in names) and all(n.startswith("aten::") for n in names)
    assert step["matmul"]["flops"] > 0 and 0 < step["matmul"]["share_of_step"] < 1
    assert {"generate", "score", "update", "sync"} <= set(step["stages"])
    assert step["stages"]["update"]["flops"] > 0 and step["stages"]["generate"]["operator_calls"] > 10
    assert 0 < step["cpu_share"] <= 1 and step["memory"]["process_peak_resident_bytes"] > 0
    assert decompose(tmp_path / "profiled").steps == [1, 3]


def test_profiler_rejects_steps_that_never_run(tmp_path, make_tiny_policy):
    from minirl.profiling.profiler import TorchProfiler
    from minirl.train.run import train

    with pytest.raises(ValueError, match="step numbers >= 1"):
        TorchProfiler(tmp_path, steps=[0])
    model, tokenizer = make_tiny_policy(seed=3, num_layers=1)
    config = RLConfig.from_flat(steps=2, prompts_per_step=2, num_generations=2, eval_every=0)
    with pytest.raises(ValueError, match=r"step\(s\) \[5\] will not run"):
        train(config, model, tokenizer, progress=False, extra_callbacks=[TorchProfiler(tmp_path, steps=[5])])
