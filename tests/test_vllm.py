"""The vLLM engine (minirl.rollout.vllm) and stage 4 on GPUs: run only where vLLM and CUDA are.

CI has neither: every test here is marked `vllm` or `gpu` and skips cleanly. On a GPU machine:
    pip install -r requirements-gpu.txt && python -m pytest -m "vllm or gpu"
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not (HAVE_CUDA and HAVE_VLLM), reason="needs vLLM and a CUDA GPU")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine_and_policy():
    from minirl.models.policy import load_default_policy
    from minirl.rollout.vllm import VLLMEngine

    model, tokenizer, _ = load_default_policy(device="cuda", progress=False)
    engine = VLLMEngine(model, tokenizer, dtype="float32", colocate=True, gpu_memory_utilization=0.2)
    return engine, model, tokenizer


@pytest.mark.vllm
@needs_vllm
def test_vllm_samples_g_completions_with_the_temperature_applied(engine_and_policy):
    from minirl.algo.logprobs import completion_logprobs
    from minirl.config import SamplingConfig

    engine, model, _ = engine_and_policy
    sampling = SamplingConfig(num_generations=4, max_completion_length=4, temperature=0.7)
    ro = engine.generate(["12+34=", "5+6="], sampling, expected_version=0, generator=torch.Generator().manual_seed(0))
    assert len(ro) == 8 and ro.prompts[:4] == ["12+34="] * 4 and ro.version == 0
    mask = ro.completion_mask.bool()
    assert (ro.logprobs[mask] <= 1e-4).all()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ro.input_ids.cuda(), ro.attention_mask.cuda(),
                                         ro.num_completion_tokens, temperature=0.7)
    gap = (trainer.cpu() - ro.logprobs)[mask].abs().mean().item()
    assert gap < 0.02, f"vLLM's log-probs are not the trainer's at temperature 0.7 (mean gap {gap}): processed?"


@pytest.mark.vllm
@needs_vllm
def test_vllm_same_seed_same_samples_whatever_the_split(engine_and_policy):
    from minirl.config import SamplingConfig

    engine, _, _ = engine_and_policy
    sampling = SamplingConfig(num_generations=4, max_completion_length=4)
    prompts = ["12+34=", "5+6=", "70+8=", "9+9="]
    whole = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(3))
    halves = [engine.generate(prompts[i:i + 2], sampling, generator=torch.Generator().manual_seed(3)) for i in (0, 2)]
    assert whole.completions == halves[0].completions + halves[1].completions


@pytest.mark.vllm
@needs_vllm
def test_vllm_loads_weights_in_place_checks_names_and_versions(engine_and_policy):
    from minirl.config import SamplingConfig
    from minirl.rollout.base import VersionMismatchError

    engine, model, tokenizer = engine_and_policy
    sampling = SamplingConfig(num_generations=2, max_completion_length=4)
    state = list(model.state_dict().items())
    engine.generate(["1+1="], sampling)                           # colocated: asleep after this
    assert engine.sleeping == {"weights", "kv_cache"}
    with pytest.raises(ValueError, match="unexpected tensor"):
        engine.load_weights([(n.replace("up_proj", "up"), t) for n, t in state], 1)
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(["1+1="], sampling)
    with pytest.raises(ValueError, match="never pushed"):
        engine.load_weights(state[:-2], 1)
    zeroed = [(n, torch.zeros_like(t) if n == "lm_head.weight" or "embed" in n else t) for n, t in state]
    engine.load_weights(zeroed, 2)
    flat = engine.generate(["1+1="], SamplingConfig(num_generations=8, max_completion_length=2), expected_version=2)
    uniform = torch.tensor(1 / model.config.vocab_size)
    assert torch.allclose(flat.logprobs[flat.completion_mask.bool()].exp(), uniform, atol=1e-3), \
        "zero embeddings make every token equally likely: the new weights are in use (and no stale prefix cache)"
    with pytest.raises(VersionMismatchError, match="refusing to go back"):
        engine.load_weights(state, 1)
    engine.load_weights(state, 3)
    assert engine.version == 3


@pytest.mark.vllm
@needs_vllm
def test_vllm_sleep_releases_gpu_memory(engine_and_policy):
    from minirl.config import SamplingConfig

    engine, model, _ = engine_and_policy
    engine.load_weights(model.state_dict().items(), engine.version + 1)
    engine._wake(("kv_cache",))
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep > free_awake, "sleep(level=2) gives the weights' and the KV cache's memory back"
    engine.load_weights(model.state_dict().items(), engine.version + 1)
    assert len(engine.generate(["2+2="], SamplingConfig(num_generations=2))) == 2


@pytest.mark.gpu
@pytest.mark.distributed
@needs_cuda
def test_chapter_on_one_gpu_with_nccl_bf16_and_offload(tmp_path):
    from minirl.parallel.launch import torchrun

    out = tmp_path / "gpu"
    job = torchrun(REPO / "chapters" / "04_fsdp_lora.py", 1,
                   ["--out", out, "--device", "cuda", "--zero", "3", "--mixed-precision", "bf16", "--cpu-offload",
                    "--lora-rank", "8", "--steps", "3", "--eval-every", "0", "--prompts-per-step", "4",
                    "--no-progress"], timeout=900)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["sync_bytes"] > 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["memory/cuda_peak_bytes"][0] > 0 for m in metrics if "memory/cuda_peak_bytes" in m)


@pytest.mark.vllm
@pytest.mark.distributed
@needs_vllm
def test_chapter_with_vllm_rollout(tmp_path):
    from minirl.parallel.launch import torchrun

    out = tmp_path / "vllm"
    job = torchrun(REPO / "chapters" / "04_fsdp_lora.py", 1,
                   ["--out", out, "--device", "cuda", "--rollout", "vllm", "--zero", "3", "--lora-rank", "8",
                    "--steps", "3", "--eval-every", "3", "--prompts-per-step", "4", "--no-progress"], timeout=1200)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0 <= summary["accuracy_after"] <= 1
