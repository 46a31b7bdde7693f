# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The vLLM engine behind the rollout protocol: paged KV cache, prefix caching, sleep mode, in-place weight loads.

Written against vLLM's offline API as TRL's colocate mode uses it: one `vllm.LLM` per
training process (`distributed_executor_backend="external_launcher"` under torchrun, so the
engine and its worker run inside this process), prefix caching on, log-probs after the
temperature (`logprobs_mode="processed_logprobs"`), `SamplingParams(n=G, logprobs=0,
seed=...)` per prompt, `sleep(level=2)` after generating and `wake_up(tags=...)` before
loading weights and before generating, and `reset_prefix_cache()` after every push.

Sizing (what a user sets on a shared GPU): `gpu_memory_utilization` (the share of the GPU
vLLM may take for weights, activations and KV cache; the trainer needs the rest),
`max_model_len` (the longest prompt plus completion the task needs, `task_model_len`;
without it vLLM reserves room for the model's whole context, e.g. 32k tokens, which may not
fit beside a trainer) and `max_num_batched_tokens` (the tokens of one scheduler step; 4096
as TRL, whose comment says vLLM's memory profiler is misled by its larger default).

Weights, in two ways, the first that this vLLM offers:
1. vLLM's public API: `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`,
   the worker's in-place reload that vLLM's sleep-mode documentation uses after a level-2
   sleep, given the trainer's tensors instead of the checkpoint's (it maps Hugging Face names
   onto vLLM's fused layers and runs `process_weights_after_loading`). The tensors are passed
   as an iterator, one at a time: the external launcher runs the worker in this process, so
   nothing is serialized or copied. vLLM's weight-transfer engines (`LLM.update_weights` with
   the "nccl" or "ipc" backend) move weights between processes: a trainer on other GPUs
   (NCCL needs two ranks) or in another process (CUDA IPC cannot reopen a handle in the
   process that exported it), so they do not fit an engine inside the trainer's process.
2. Fallback, when `collective_rpc` is missing or refuses before it took a tensor: vLLM's
   internal chain `llm.llm_engine.model_executor.driver_worker.model_runner.model` and the
   model's `load_weights`, what TRL's colocate mode uses. It is internal and moves between
   vLLM versions. `weight_api` says which path the engine uses.

Memory: vLLM allocates outside PyTorch's caching allocator, so the engine's device bytes are
read from `torch.cuda.mem_get_info` (free memory before and after the engine is built, and
around each sleep and wake): `memory_bytes()`. Simplified: anything else that allocates in
those windows is counted too. The model is written to a temporary directory for vLLM to
read and removed as soon as the engine is built (also when building fails).

Needs vLLM and a CUDA GPU (`pip install -r requirements-gpu.txt`); CI has neither: the tests
marked `vllm` run it on a GPU machine, and CPU tests run this code against a stand-in for
vLLM (tests/test_vllm.py). Simplified vs TRL: tensor parallel size 1, no server mode, no
LoRA adapters inside vLLM (push merged weights).
"""

__all__ = ["PUBLIC_API", "INTERNAL_API", "import_vllm", "task_model_len", "vllm_settings",
           "start_llm", "padded_rollout", "VLLMSleepMode", "VLLMEngine"]

import os
import shutil
import socket
import tempfile
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import SamplingConfig, auto_dtype
from minirl.data import Rollout
from minirl.rollout.base import VersionMismatchError, check_request, check_tokenizer, draw_seed, make_rollout
from minirl.rollout.colocated import prompt_seed
from minirl.rollout.registry import VLLM_DTYPES, VLLM_INSTALL
from minirl.runtime.validate import ConfigError, check_float, check_int

PUBLIC_API = "collective_rpc('reload_weights')"
INTERNAL_API = "llm_engine.model_executor.driver_worker.model_runner.model.load_weights"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_vllm():
    """The vllm module, or ConfigError saying how to get it (and that it needs a CUDA GPU)."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError("rollout_engine", "vllm", f"vLLM is not installed ({err}); {VLLM_INSTALL}") from None
    if not torch.cuda.is_available():
        raise ConfigError("rollout_engine", "vllm", "vLLM's engine needs a CUDA GPU and this machine has none; use "
                                                    "--rollout-engine shared_prefix")
    return vllm


def task_model_len(tokenizer, prompts: list[str], max_completion_length: int, context: int | None = None) -> int:
    """vLLM's max_model_len for a task: its longest prompt (tokens) plus `max_completion_length`.

    Rounded up to a multiple of 64 (room for held-out prompts a little longer than the
    training ones); at most `context`, the model's positions. ConfigError when the longest
    prompt and its completion do not fit the context at all.
    """
    longest = max((len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]), default=0)
    need = longest + max_completion_length
    if context is not None and need > context:
        raise ConfigError("max_completion_length", max_completion_length,
                          f"the longest prompt has {longest} tokens, and with {max_completion_length} new ones they "
                          f"exceed the model's {context} positions; shorten the prompts or the completions")
    rounded = -(-need // 64) * 64
    return rounded if context is None else min(rounded, context)


def vllm_settings(model, dtype: str, gpu_memory_utilization: float, max_model_len: int | None,
                  max_num_batched_tokens: int) -> tuple[str, int | None]:
    """(vLLM's compute dtype, max_model_len: the given one or the model's context), or ConfigError naming the
    setting."""
    dtype = auto_dtype(dtype, "cuda")
    if dtype not in VLLM_DTYPES:
        raise ConfigError("rollout_dtype", dtype, f"vLLM computes in {', '.join(VLLM_DTYPES)} (its FP8 is a "
                                                  "quantization mode); pick one of those")
    check_float("vllm_gpu_memory_utilization", gpu_memory_utilization, low=0.0, high=1.0, low_open=True)
    check_int("vllm_max_num_batched_tokens", max_num_batched_tokens, low=1)
    context = getattr(model.config, "max_position_embeddings", None)
    max_model_len = max_model_len or context
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, low=1, high=context, why="the model's positions")
    return dtype, max_model_len


def start_llm(vllm, model, tokenizer, **options):
    """`vllm.LLM` on a temporary copy of the policy (removed once read, also when building fails), with the
    options every minirl engine uses (prefix caching, processed log-probs, the external launcher) and `options`."""
    path = tempfile.mkdtemp(prefix="minirl-vllm-")
    try:                                                 # the copy lives only while vLLM reads it
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return vllm.LLM(model=path, tokenizer=path, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                        distributed_executor_backend="external_launcher", **options)
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Stream:
    """The tensors of a push, checked by name as vLLM takes them; counts what it took."""

    def __init__(self, named: Iterable[tuple[str, Tensor]], known: set[str], version: int):
        self.named, self.known, self.version = iter(named), known, version
        self.seen: set[str] = set()
        self.taken = 0

    def __iter__(self):
        for name, tensor in self.named:
            if name not in self.known:
                raise ValueError(f"VLLMEngine.load_weights(version={self.version}): unexpected tensor {name!r}; "
                                 "push the policy's tensors under their Hugging Face names")
            self.taken += 1
            self.seen.add(name)
            yield name, tensor


def padded_rollout(tokenizer, prompts: list[str], G: int, rows: list[tuple], version: int) -> Rollout:
    """The rollout of vLLM's (prompt ids, completion ids, log-probs) rows: prompts left-padded, completions
    right-padded (log-probs with 0.0), rows i*G .. i*G+G-1 continuing prompts[i]."""
    P, width = max(len(p) for p, _, _ in rows), max(1, max(len(t) for _, t, _ in rows))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p, _, _ in rows])               # [N, P]
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _, _ in rows])
    completion_ids = torch.tensor([list(t) + [pad] * (width - len(t)) for _, t, _ in rows])       # [N, C]
    logprobs = torch.tensor([list(lp) + [0.0] * (width - len(lp)) for _, _, lp in rows])
    return make_rollout(tokenizer, prompts, G, prompt_ids, prompt_mask, completion_ids, logprobs, version)


class VLLMSleepMode:
    """The sleep and memory side of `VLLMEngine` (a mixin: it uses the engine's llm, device, held, sleeping
    and ready)."""

    def _free_bytes(self) -> int:
        """Free device memory now: vLLM's own allocator is invisible to torch.cuda.memory_allocated."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()                             # torch's cached blocks are not vLLM's
        return torch.cuda.mem_get_info(self.device)[0]

    def memory_bytes(self) -> int:
        """Device bytes the engine holds now (weights, KV cache, ...), from mem_get_info around its transitions."""
        return self.held

    def _wake(self, tags: tuple[str, ...]) -> None:
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            free = self._free_bytes()
            self.llm.wake_up(tags=tags)
            self.sleeping -= set(tags)
            self.held += max(0, free - self._free_bytes())

    def sleep(self) -> None:
        """Discard weights and KV cache (vLLM sleep level 2); the next push refills the weights."""
        if not self.sleeping:
            free = self._free_bytes()
            self.llm.sleep(level=2)
            self.sleeping = {"weights", "kv_cache"}
            self.ready = False                                # level 2 discarded the weights
            self.held = max(0, self.held - max(0, self._free_bytes() - free))

    def wake_up(self) -> None:
        self._wake(("weights", "kv_cache"))


class VLLMEngine(VLLMSleepMode):
    """A vLLM `LLM` in this process, holding version `version` of the policy.

    model, tokenizer: the policy to start from (written to a temporary directory that vLLM
    loads, then removed); dtype: vLLM's compute dtype ("auto": bfloat16); colocate: sleep
    after generating, wake before loading weights and before generating;
    gpu_memory_utilization: the share of the GPU vLLM may take; max_model_len: the longest
    prompt plus completion (None: the model's context; see `task_model_len`);
    max_num_batched_tokens: tokens per scheduler step (at least max_model_len).
    """

    def __init__(self, model, tokenizer, dtype: str = "auto", device=None, *, colocate: bool = True,
                 gpu_memory_utilization: float = 0.3, seed: int = 0, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 4096):
        dtype, max_model_len = vllm_settings(model, dtype, gpu_memory_utilization, max_model_len,
                                             max_num_batched_tokens)
        vllm = import_vllm()
        check_tokenizer(tokenizer)
        self.tokenizer, self.dtype, self.colocate, self.max_model_len = tokenizer, dtype, colocate, max_model_len
        self.device = torch.device(device if device is not None else "cuda")
        self.names = list(model.state_dict())
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)                # external_launcher reads torchrun's variables
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        free_before = self._free_bytes()
        self.llm = start_llm(vllm, model, tokenizer, dtype=dtype, seed=seed, enable_sleep_mode=colocate,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             max_num_batched_tokens=max(max_num_batched_tokens, max_model_len or 0))
        self.held = max(0, free_before - self._free_bytes())   # weights, KV cache, CUDA graphs: vLLM's
        self.SamplingParams = vllm.SamplingParams
        self.weight_api = PUBLIC_API if callable(getattr(self.llm, "collective_rpc", None)) else INTERNAL_API
        self.version, self.ready, self.sleeping = 0, True, set()   # sleeping: the tags vLLM has released

    def generate(self, prompts: list[str], sampling: SamplingConfig, expected_version: int | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """G samples per prompt with the sampled tokens' log-probs (after temperature); rows i*G .. i*G+G-1
        continue prompts[i]. With a generator, each prompt samples from `prompt_seed(s, prompt)`, s drawn
        from it, so a batch's samples do not depend on how it is split over ranks."""
        check_request(self, prompts, sampling, expected_version)
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep, or the last load_weights did not "
                               "complete); push the trainer's weights before generating")
        G, C, tok = sampling.num_generations, sampling.max_completion_length, self.tokenizer
        ids = self._prompt_ids(prompts, C)
        self._wake(("weights", "kv_cache"))
        seed = draw_seed(generator)
        params = [self.SamplingParams(n=G, temperature=sampling.temperature, max_tokens=C, logprobs=0,
                                      seed=None if seed is None else prompt_seed(seed, p)) for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        rows = [(p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
                for p, out in zip(ids, outputs, strict=True) for c in out.outputs]                   # N = B * G rows
        if self.colocate:
            self.sleep()
        return padded_rollout(tok, prompts, G, rows, self.version)

    def _prompt_ids(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Token ids of `prompts`; ValueError when one and its completion would not fit max_model_len."""
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        longest = max(len(p) for p in ids)
        if self.max_model_len is not None and longest + max_tokens > self.max_model_len:
            raise ValueError(f"VLLMEngine: a prompt of {longest} tokens and {max_tokens} new ones exceed "
                             f"max_model_len={self.max_model_len}; build the engine with a larger max_model_len "
                             "(task_model_len over every prompt it will see)")
        return ids

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream the trainer's tensors (Hugging Face names) into vLLM's model in place; then reset the prefix cache.

        Raises VersionMismatchError for an older version, ValueError for an unknown name or
        names missing at the end (after which the engine refuses to generate until a full push).
        """
        if version < self.version:
            raise VersionMismatchError(f"load_weights(version={version}) but the vLLM engine holds version "
                                       f"{self.version}: refusing to go back to older weights")
        self._wake(("weights",))                              # the KV cache stays released until generate
        self.ready = False
        stream = _Stream(named_tensors, set(self.names), version)
        self._push(stream)
        missing = [n for n in self.names if n not in stream.seen]
        if missing:
            raise ValueError(f"VLLMEngine.load_weights(version={version}): {len(missing)} tensors never pushed "
                             f"(first: {missing[0]}); push all of them")
        self.llm.reset_prefix_cache()                         # cached prefixes belong to the old weights
        self.version, self.ready = version, True

    def named_weights(self):
        raise NotImplementedError("vLLM keeps its weights fused inside its worker (qkv_proj, gate_up_proj); compare "
                                  "log-probs instead (notebook 02) to check a vLLM sync")

    def _push(self, stream: _Stream) -> None:
        """Into vLLM's worker: the public reload, or (refused before it took a tensor) the internal chain."""
        if self.weight_api == PUBLIC_API:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stream)})
                return
            except (AttributeError, NotImplementedError, TypeError) as err:
                if stream.taken:
                    raise
                self.weight_api = f"{INTERNAL_API} ({PUBLIC_API} refused: {type(err).__name__}: {err})"
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in stream:
            model.load_weights([(name, tensor)])

    def greedy_completions(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy completions as text (for held-out accuracy), from the weights the engine holds."""
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep or half-loaded); push the weights first")
        ids = self._prompt_ids(prompts, max_new_tokens)
        self._wake(("kv_cache",))
        params = self.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return [self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]
