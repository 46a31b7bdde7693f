"""The vLLM engine (minirl.rollout.vllm) and stage 4 on GPUs.

The first tests run everywhere: the engine's own logic (the options it gives vLLM, the
temporary copy of the model, which weight-loading path it takes and what it checks, memory
from the device's free memory, sleep and wake) against a stand-in `vllm` module and a
stand-in CUDA device. They show what minirl does with vLLM, not that vLLM does it: the tests
marked `vllm` or `gpu` run the real engine, only where vLLM and CUDA are. On a GPU machine:
    pip install -r requirements-gpu.txt && python -m pytest -m "vllm or gpu"
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not (HAVE_CUDA and HAVE_VLLM), reason="needs vLLM and a CUDA GPU")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
REPO = Path(__file__).resolve().parent.parent
GiB = 2 ** 30


# ------------------------------------------------------------------ a stand-in for vLLM and a CUDA device


class FakeDevice:
    """Free memory of a pretend 80 GiB GPU; the stand-in vLLM takes and gives back from it."""

    def __init__(self):
        self.free, self.total, self.syncs = 70 * GiB, 80 * GiB, 0


class FakeModel:
    """vLLM's model inside the worker: load_weights takes (name, tensor) pairs, as vLLM's models do."""

    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return {name for name, _ in weights}


class FakeLLM:
    """What VLLMEngine calls on vllm.LLM, recorded; generate returns two tokens per sample."""

    fail_to_build = False
    rpc = "reload"                        # "reload": collective_rpc works; "refuse": NotImplementedError; None: absent

    def __init__(self, model, tokenizer, **kwargs):
        self.path, self.kwargs = Path(model), kwargs
        self.files = sorted(p.name for p in self.path.iterdir())          # what vLLM could read while building
        if self.fail_to_build:
            raise RuntimeError("CUDA out of memory while profiling (stand-in)")
        DEVICE.free -= 3 * GiB                                            # weights + KV cache + graphs
        self.model, self.calls, self.resets = FakeModel(), [], 0
        runner = types.SimpleNamespace(model=self.model)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)))
        if FakeLLM.rpc is None:
            self.collective_rpc = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if FakeLLM.rpc == "refuse":
            raise NotImplementedError("this worker cannot reload weights (stand-in)")
        assert method == "reload_weights" and not args
        for name, tensor in kwargs["weights_iterator"]:
            self.model.loaded[name] = tensor.clone()

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        sample = types.SimpleNamespace(token_ids=[5, 6], logprobs=[{5: types.SimpleNamespace(logprob=-0.25)},
                                                                   {6: types.SimpleNamespace(logprob=-0.5)}])
        return [types.SimpleNamespace(outputs=[sample] * getattr(p, "n", 1)) for p in params]

    def sleep(self, level):
        assert level == 2
        self.calls.append("sleep")
        DEVICE.free += int(2.5 * GiB)

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        DEVICE.free -= GiB * len(tags)

    def reset_prefix_cache(self):
        self.resets += 1


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, max_tokens=16, logprobs=None, seed=None):
        self.n, self.temperature, self.max_tokens, self.logprobs, self.seed = n, temperature, max_tokens, logprobs, seed


DEVICE = FakeDevice()


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` module and CUDA device on this CPU machine; yields the device."""
    global DEVICE
    DEVICE = FakeDevice()
    FakeLLM.fail_to_build, FakeLLM.rpc = False, "reload"
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=SamplingParams))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(DEVICE, "syncs", DEVICE.syncs + 1))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (DEVICE.free, DEVICE.total))
    yield DEVICE


def test_options_reach_vllm_and_the_model_copy_is_removed(fake_vllm, tiny, tmp_path, monkeypatch):
    from minirl.rollout.vllm import VLLMEngine
    from minirl.runtime.vllm_setup import task_model_len

    model, tokenizer = tiny
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    length = task_model_len(tokenizer, ["12+34=", "5+6="], 4, model.config.max_position_embeddings)
    assert length == min(64, model.config.max_position_embeddings), "6 + 4 tokens, rounded up to 64, within context"
    engine = VLLMEngine(model, tokenizer, dtype="auto", gpu_memory_utilization=0.25, max_model_len=length)
    kw = engine.llm.kwargs
    assert kw["dtype"] == "bfloat16", "auto is bfloat16 on CUDA"
    assert kw["gpu_memory_utilization"] == 0.25 and kw["max_model_len"] == length
    assert kw["max_num_batched_tokens"] == 4096 and kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["distributed_executor_backend"] == "external_launcher"
    assert "config.json" in engine.llm.files and "tokenizer.json" in engine.llm.files, "vLLM read a full copy"
    assert not engine.llm.path.exists() and list(tmp_path.iterdir()) == [], "the copy is gone once vLLM has it"
    assert engine.memory_bytes() == 3 * GiB, "the drop in free device memory while vLLM was built"


def test_a_failed_build_removes_the_copy_and_bad_options_fail_first(fake_vllm, tiny, tmp_path, monkeypatch):
    from minirl.rollout.vllm import VLLMEngine
    from minirl.runtime.validate import ConfigError

    model, tokenizer = tiny
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    FakeLLM.fail_to_build = True
    with pytest.raises(RuntimeError, match="out of memory"):
        VLLMEngine(model, tokenizer)
    assert list(tmp_path.iterdir()) == [], "no copy left behind by a failed build"
    FakeLLM.fail_to_build = False
    for kwargs, name in ((dict(gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization"),
                         (dict(max_num_batched_tokens=0), "vllm_max_num_batched_tokens"),
                         (dict(dtype="float8_e4m3fn"), "rollout_dtype"),
                         (dict(max_model_len=10 ** 6), "max_model_len")):
        with pytest.raises(ConfigError, match=name):
            VLLMEngine(model, tokenizer, **kwargs)
    assert list(tmp_path.iterdir()) == [], "refused before anything was written"


def test_the_public_reload_is_used_and_every_tensor_checked(fake_vllm, tiny):
    from minirl.config import SamplingConfig
    from minirl.rollout.base import VersionMismatchError
    from minirl.rollout.vllm import VLLMEngine
    from minirl.runtime.vllm_setup import PUBLIC_API

    model, tokenizer = tiny
    engine = VLLMEngine(model, tokenizer, dtype="float32")
    assert engine.weight_api == PUBLIC_API
    state = list(model.state_dict().items())
    zeroed = [(n, torch.zeros_like(t)) for n, t in state]
    engine.load_weights(zeroed, 1)
    assert engine.llm.calls.count("reload_weights") == 1 and engine.llm.resets == 1 and engine.version == 1
    assert set(engine.llm.model.loaded) == set(model.state_dict())
    assert all(not t.any() for t in engine.llm.model.loaded.values()), "the pushed tensors, not the checkpoint's"
    with pytest.raises(ValueError, match="unexpected tensor 'model.up'"):
        engine.load_weights([("model.up", state[0][1])], 2)
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(["1+1="], SamplingConfig())
    with pytest.raises(ValueError, match="never pushed"):
        engine.load_weights(state[:-1], 2)
    with pytest.raises(VersionMismatchError, match="refusing to go back"):
        engine.load_weights(state, 0)
    engine.load_weights(state, 3)
    assert engine.version == 3 and engine.ready and engine.llm.resets == 2, "a prefix-cache reset per full push"


@pytest.mark.parametrize("rpc", [None, "refuse"])
def test_the_internal_chain_is_the_fallback_and_says_so(fake_vllm, tiny, rpc):
    from minirl.rollout.vllm import VLLMEngine
    from minirl.runtime.vllm_setup import INTERNAL_API, PUBLIC_API

    model, tokenizer = tiny
    FakeLLM.rpc = rpc
    engine = VLLMEngine(model, tokenizer)
    engine.load_weights(model.state_dict().items(), 1)
    assert set(engine.llm.model.loaded) == set(model.state_dict()) and engine.ready
    assert engine.weight_api.startswith(INTERNAL_API)
    if rpc == "refuse":
        assert f"{PUBLIC_API} refused: NotImplementedError" in engine.weight_api


def test_memory_follows_sleep_and_wake_and_generate_sleeps_after(fake_vllm, tiny):
    from minirl.config import SamplingConfig
    from minirl.rollout.vllm import VLLMEngine
    from minirl.runtime.memory_tracking import engine_bytes

    model, tokenizer = tiny
    engine = VLLMEngine(model, tokenizer, colocate=True)
    assert engine_bytes(engine) == 3 * GiB, "stage 4's memory tracker reads the engine's device memory"
    ro = engine.generate(["12+34=", "5+6="], SamplingConfig(num_generations=3, max_completion_length=2),
                         expected_version=0, generator=torch.Generator().manual_seed(0))
    assert len(ro) == 6 and ro.completion_ids.tolist() == [[5, 6]] * 6
    assert torch.allclose(ro.logprobs, torch.tensor([[-0.25, -0.5]] * 6))
    assert engine.llm.calls[-1] == "sleep" and not engine.ready, "colocated: asleep after generating"
    assert engine.memory_bytes() == int(0.5 * GiB), "sleep gave 2.5 of the 3 GiB back"
    engine.load_weights(model.state_dict().items(), 1)
    assert ("wake_up", ("weights",)) in engine.llm.calls and engine.memory_bytes() == int(1.5 * GiB)
    assert DEVICE.syncs > 0, "the device is synchronized before free memory is read"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.greedy_completions(["1" * 200], max_new_tokens=4)


def test_stage4_builds_vllm_with_the_task_length_and_the_flags(fake_vllm, tiny):
    from minirl.config import RLConfig
    from minirl.parallel.config import ParallelConfig
    from minirl.runtime.spmd_support import build_rank_engine

    model, tokenizer = tiny
    pconfig = ParallelConfig(vllm_gpu_memory_utilization=0.4, vllm_max_num_batched_tokens=2048)
    config = RLConfig.from_flat(device="cuda", max_completion_length=8, rollout_engine="vllm")
    engine = build_rank_engine(config, pconfig, model, tokenizer, "cuda", ["12+34=", "1+2+3+4+5+6+7+8+9="])
    kw = engine.llm.kwargs
    assert kw["gpu_memory_utilization"] == 0.4 and kw["max_num_batched_tokens"] == 2048
    assert kw["max_model_len"] == min(64, model.config.max_position_embeddings) and kw["dtype"] == "bfloat16"


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
    from minirl.runtime.launch import torchrun

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
    from minirl.runtime.launch import torchrun

    out = tmp_path / "vllm"
    job = torchrun(REPO / "chapters" / "04_fsdp_lora.py", 1,
                   ["--out", out, "--device", "cuda", "--rollout-engine", "vllm", "--zero", "3", "--lora-rank", "8",
                    "--steps", "3", "--eval-every", "3", "--prompts-per-step", "4", "--no-progress"], timeout=1200)
    assert job.returncode == 0, job.stdout[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0 <= summary["accuracy_after"] <= 1
