"""Setting up minirl's vLLM engine: importing vLLM, sizing it, starting it, and reading its memory.

Hand-written plumbing behind `minirl.rollout.vllm.VLLMEngine` (notebook 04 builds the
engine; this module holds what it needs around it). `import_vllm` imports vLLM or says how to
get it; `task_model_len` sizes `max_model_len` from a task's prompts (without it vLLM
reserves room for the model's whole context, e.g. 32k tokens, which may not fit beside a
trainer); `vllm_settings` checks the engine's settings before vLLM is imported; `start_llm`
builds the `vllm.LLM` from a temporary copy of the policy (removed as soon as vLLM has read
it, also when building fails), after `prepare_vllm` (the settings checked, vLLM imported,
torchrun's variables set where missing); `PushStream` checks a push by name as vLLM takes it;
`padded_rollout` turns vLLM's rows into notebook 01's `Rollout`. `VLLMSupport` is the base
class of `VLLMEngine` that builds the `LLM`, sleeps and wakes it, checks prompt lengths,
completes greedily for held-out accuracy, and pushes weights (vLLM's public reload, else the
internal chain TRL uses): vLLM allocates outside PyTorch's caching allocator, so its device
bytes are read from `torch.cuda.mem_get_info` around building, sleeping and waking.

Needs vLLM and a CUDA GPU only when an engine is built; importing this module needs neither.
"""

import os
import shutil
import socket
import tempfile
from typing import Iterable

import torch
from torch import Tensor

from minirl.config import auto_dtype
from minirl.data import Rollout
from minirl.rollout.base import check_tokenizer, make_rollout
from minirl.runtime.validate import ConfigError, check_float, check_int
from minirl.runtime.vllm_check import VLLM_DTYPES, VLLM_INSTALL

PUBLIC_API = "collective_rpc('reload_weights')"
INTERNAL_API = "llm_engine.model_executor.driver_worker.model_runner.model.load_weights"


def free_port() -> int:
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


def prepare_vllm(model, tokenizer, dtype: str, gpu_memory_utilization: float, max_model_len: int | None,
                 max_num_batched_tokens: int):
    """Before `start_llm`: the settings checked (`vllm_settings`), vLLM imported, the tokenizer checked, and the
    variables torchrun sets put in place where they are missing (vLLM's external launcher reads them).
    Returns (the vllm module, vLLM's compute dtype, max_model_len)."""
    dtype, max_model_len = vllm_settings(model, dtype, gpu_memory_utilization, max_model_len, max_num_batched_tokens)
    vllm = import_vllm()
    check_tokenizer(tokenizer)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return vllm, dtype, max_model_len


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


class PushStream:
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

    def check_complete(self, names: list[str]) -> None:
        """ValueError naming the engine's tensors this push never brought."""
        missing = [n for n in names if n not in self.seen]
        if missing:
            raise ValueError(f"VLLMEngine.load_weights(version={self.version}): {len(missing)} tensors never "
                             f"pushed (first: {missing[0]}); push all of them")


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


class VLLMSupport:
    """The building, sleep, memory, prompt-length and evaluation side of `VLLMEngine` (a base class).

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
        vllm, dtype, max_model_len = prepare_vllm(model, tokenizer, dtype, gpu_memory_utilization, max_model_len,
                                                  max_num_batched_tokens)
        self.tokenizer, self.dtype, self.colocate, self.max_model_len = tokenizer, dtype, colocate, max_model_len
        self.device = torch.device(device if device is not None else "cuda")
        self.names = list(model.state_dict())
        free_before = self._free_bytes()
        self.llm = start_llm(vllm, model, tokenizer, dtype=dtype, seed=seed, enable_sleep_mode=colocate,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             max_num_batched_tokens=max(max_num_batched_tokens, max_model_len or 0))
        self.held = max(0, free_before - self._free_bytes())   # weights, KV cache, CUDA graphs: vLLM's
        self.SamplingParams = vllm.SamplingParams
        self.weight_api = PUBLIC_API if callable(getattr(self.llm, "collective_rpc", None)) else INTERNAL_API
        self.version, self.ready, self.sleeping = 0, True, set()   # sleeping: the tags vLLM has released

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

    def _prompt_ids(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Token ids of `prompts`; ValueError when one and its completion would not fit max_model_len."""
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        longest = max(len(p) for p in ids)
        if self.max_model_len is not None and longest + max_tokens > self.max_model_len:
            raise ValueError(f"VLLMEngine: a prompt of {longest} tokens and {max_tokens} new ones exceed "
                             f"max_model_len={self.max_model_len}; build the engine with a larger max_model_len "
                             "(task_model_len over every prompt it will see)")
        return ids

    def greedy_completions(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy completions as text (for held-out accuracy), from the weights the engine holds."""
        if not self.ready:
            raise RuntimeError("VLLMEngine: no complete weights (asleep or half-loaded); push the weights first")
        ids = self._prompt_ids(prompts, max_new_tokens)
        self._wake(("kv_cache",))
        params = self.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return [self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]

    def named_weights(self):
        raise NotImplementedError("vLLM keeps its weights fused inside its worker (qkv_proj, gate_up_proj); compare "
                                  "log-probs instead (notebook 02) to check a vLLM sync")

    def _push(self, stream: PushStream) -> None:
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
