"""chapters/05_generation.py: the measurements on a locally saved HF model, and its bad flags."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import last_line, run_script

from minirl.runtime.workloads import LongTailConfig, build_long_tail_policy

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "05_generation.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Qwen2 with the long-tail policy's tokenizer, saved as an ordinary HF checkpoint."""
    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_long_tail_policy(LongTailConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                                             intermediate_size=64))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_quick_run_on_any_hf_model_writes_the_summary(tiny_model, tmp_path):
    proc = run("--model", tiny_model, "--draft", tiny_model, "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    kv = summary["kv_utilization"]
    assert 0 < kv["contiguous"] < kv["paged"] <= 1
    assert summary["continuous_vs_static"]["ratio"] > 0 and summary["continuous_vs_static"]["step_ratio"] >= 1
    assert summary["continuous_vs_static"]["row_ratio"] > 1
    assert 0 < summary["prefix_saved_share"] < 7 / 8 and summary["prefix_saved_share"] == \
        pytest.approx(summary["prefix"]["closed_form"])
    assert set(summary["spec_acceptance"]) == set(summary["spec_speedup"]) == {"1", "2"}
    assert summary["spec_acceptance"]["1"] == pytest.approx(1.0), "the draft is the target itself: all accepted"
    assert 0 < summary["radix_hit_rate"] < 1
    assert "prefix caching at G = 8" in proc.stdout and "agree" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--ks", "0,2"], "argument --ks"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--draft", "somewhere"], "argument --draft: only with --model"),
    (["--model", "/nonexistent"], "argument --model: /nonexistent: no such directory"),
])
def test_bad_flags_fail_before_loading(flags, message, tmp_path):
    proc = run(*flags, "--out", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_workload_longer_than_the_context_is_refused_before_any_model_loads(tiny_model, tmp_path):
    """Issue 22: --prompt-length 100000 used to fail with a traceback after loading three models."""
    proc, imported = run_script(SCRIPT, "--prompt-length", "100000", "--out", tmp_path)
    assert proc.returncode == 2 and last_line(proc) == (
        "05_generation.py: error: argument --prompt-length: 100000: prompts of about 100000 characters plus "
        "--max-new-tokens 256 need more than the 512 positions of the long-tail policy; use --prompt-length <= 256 "
        "(or fewer --max-new-tokens)")
    assert "torch" not in imported, "the context is known without loading torch"
    proc, _ = run_script(SCRIPT, "--model", tiny_model, "--quick", "--prompt-length", "500", "--out", tmp_path)
    assert proc.returncode == 2 and f"need more than the 512 positions of {tiny_model}; use --prompt-length <= 464" \
        in last_line(proc), "--quick's 48 new tokens, the context read from the model's config.json"
    assert not any(tmp_path.iterdir())


def test_the_long_tail_context_constant_is_the_policy_s():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter05", SCRIPT)
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    assert chapter.LONG_TAIL_CONTEXT == LongTailConfig().max_length


def test_a_mistyped_flag_or_a_missing_gpu_fails_in_one_line(tmp_path):
    proc, imported = run_script(SCRIPT, "--qiuck", "--out", tmp_path)
    assert proc.returncode == 2 and last_line(proc).endswith("error: unrecognized arguments: --qiuck")
    assert not {"torch", "transformers"} & imported
    if not torch.cuda.is_available():
        proc, imported = run_script(SCRIPT, "--device", "cuda", "--out", tmp_path)
        assert proc.returncode == 2 and "argument --device: 'cuda': this machine has no CUDA device" in last_line(proc)
        assert "transformers" not in imported


def load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_vs_hf_quick_smoke(tmp_path, capsys):
    """benchmarks/engine_vs_hf.py --quick on the long-tail workload: a summary and the last lines (no timing claim)."""
    assert load_script("engine_vs_hf").main(["--quick", "--workload", "long", "--threads", "1",
                                             "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads((tmp_path / "summary.json").read_text())
    pairs = summary["long"]["speedup_pairs"]
    assert summary["speedup_vs_hf"] == pairs["median"] == statistics.median(pairs["ratios"])
    assert lines[-1] == f"speedup_vs_hf: {pairs['median']:.2f} (min {pairs['min']:.2f}, max {pairs['max']:.2f}, n 1)"
    rss = summary["peak_rss_mb"]
    assert lines[-2] == f"peak_rss_mb paged={rss['paged']:.0f} hf={rss['hf']:.0f}" and min(rss.values()) > 100
    roof, limits = summary["roofline"], summary["machine_limits"]
    assert lines[-3] == f"decode_roofline_share: {roof['share']:.2f}"
    steps = roof["steps"]["seconds"]
    ratios = [h / p for h, p in zip(steps["hf"], steps["paged"], strict=True)]
    assert len(ratios) == 4 and lines[-4] == f"step_ratio_equal_rows: {statistics.median(ratios):.2f}"
    assert lines[-5] == (f"machine_limits: matmul_gflops_1t {limits['matmul_flops_1t'] / 1e9:.1f} "
                         f"copy_gbps {limits['copy_bytes_1t'] / 1e9:.1f}")
    assert (roof["matmul_flops"], roof["copy_bytes"]) == (limits["matmul_flops_1t"], limits["copy_bytes_1t"])
    assert roof["measured_s"] == statistics.median(steps["paged"]), "the share is the engine's step by CPU time"
    assert roof["ideal_s"] == max(roof["flops"] / roof["matmul_flops"], roof["bytes"] / roof["copy_bytes"])
    assert roof["kv_bytes"] == 32 * 161 * 2 * 8 * 1 * 64 * 4, "32 rows x 161 positions x K and V x 8 layers x 64 x fp32"
    kinds = roof["breakdown"]["kinds"]
    assert abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-9 and kinds["matrix products"]["share"] > 0.05
    inside = kinds["matrix products"]["seconds"] + kinds["attention, read in place"]["seconds"]
    assert roof["breakdown"]["bound"] == roof["ideal_s"] / inside >= roof["share"], "overhead removed only helps"
    work = summary["long"]
    assert work["paged_counts"]["cached_tokens"] > 0, "the G completions of a prompt share its full blocks"
    assert work["hf_rows_x_steps"] >= work["paged_counts"]["decode_tokens"], "HF decodes padding rows, the engine not"
    assert work["finish_speedup"] > 0 and len(work["finish_speedups"]) == 1


def test_machine_limits_keep_the_best_trial_of_at_least_min_seconds():
    """engine_measure.best_rate (machine_limits' trials): each trial calls the work until the clock has advanced
    min_seconds; the best trial's rate wins."""
    from minirl.runtime.engine_measure import best_rate

    ticks = iter([0.0, 0.4, 1.0,              # trial 1: two calls in 1.0 s -> 2 x amount / s
                  5.0, 5.9, 7.0])             # trial 2: two calls in 2.0 s -> 1 x amount / s
    calls = []
    rate = best_rate(lambda: calls.append(1), 3.0, lambda: next(ticks), 1.0, 2)
    assert rate == 6.0 and len(calls) == 4


def test_engine_vs_hf_uniform_workload_runs_every_completion_to_the_cap(tmp_path, capsys):
    assert load_script("engine_vs_hf").main(["--quick", "--workload", "uniform", "--threads", "1", "--no-memory",
                                             "--out", str(tmp_path)]) == 0
    work = json.loads((tmp_path / "summary.json").read_text())["uniform"]
    cap = work["prompts"] * work["num_generations"] * work["max_completion_length"]
    assert work["tokens"] == {"paged": [cap], "hf": [cap]}, "no completion ends early on either engine"
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("decode_roofline_share: ")


def test_grpo_vs_trl_long_workload_runs_the_paged_engine(tiny_model, tmp_path, capsys):
    bench = load_script("grpo_vs_trl")
    assert bench.main(["--workload", "long", "--model", tiny_model, "--steps", "1", "--warmup", "0",
                       "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "8",
                       "--threads", "1", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("speedup_vs_trl: ")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["workload"] == "long" and summary["max_completion_length"] == 8
    assert "generate" in " ".join(summary["minirl_stage_median_seconds"])
