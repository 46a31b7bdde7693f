"""Training memory, measured on one process: saved activations, recomputation, LoRA.

Hand-written (a measurement harness): notebook 03 runs it and sets its figures beside the calculator.

`SavedActivationMeter` counts the unique storages autograd saves for backward (works on CPU
and GPU); `measure_single` sets them beside the calculator's activation formula, with and
without gradient checkpointing, and `measure_lora` does the same for LoRA's state. The small
Qwen2 models and the storage counting (`storage_bytes`, DTensor shards by their local
storage) are shared with `minirl.runtime.zero_measure`, which measures per-rank state under
DDP, ZeRO-1 and FSDP2 in a torchrun job. The models are wrapped (checkpointing, LoRA) by
`minirl.memory.wrap`, the code notebook 04 trains with, so what is
measured here is what trains there.

Simplified on purpose: FP32 throughout, one small model, a few steps. Counting storages shows
*what* is held; the allocator's peak (CUDA only) adds what a count of named tensors cannot
see: communication buffers, temporaries, fragmentation.
"""


import statistics
import time
import weakref

import torch
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from minirl.memory.calculator import LORA_TARGETS, ModelShape, activation_memory, lora_memory, lora_params
from minirl.memory.wrap import apply_lora, set_checkpointing

MEASURE_SIZES = {
    "small": dict(hidden_size=512, num_hidden_layers=6, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=4),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2),
}
STRATEGIES = {"ddp": 0, "zero1": 1, "fsdp_noreshard": 2, "fsdp": 3}  # strategy -> ZeRO stage it implements
VOCAB_SIZE = 19  # the embedded policy's character tokenizer (len(build_tokenizer()))


def build_measure_model(size: str = "small", seed: int = 0, attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    """A randomly initialized FP32 Qwen2 of `size` ("small" ~24 M parameters, "tiny" ~0.4 M)."""
    if size not in MEASURE_SIZES:
        raise ValueError(f"size={size!r}: use one of {', '.join(map(repr, MEASURE_SIZES))}")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=True,
                         attn_implementation=attn_implementation, use_cache=False, **MEASURE_SIZES[size])
    return Qwen2ForCausalLM(config)


def random_batch(batch: int, seq: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """input_ids [batch, seq] of ordinary (non-special) tokens; used as their own labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (batch, seq), generator=g).to(device)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivationMeter:
    """Peak bytes of the distinct storages autograd saves for backward, inside a `with` block.

    Storages in `exclude` (pass the parameters) are not counted. Keep the block open through
    backward, so the recomputation of checkpointed layers is counted too. Recomputation must
    run under these hooks: use reentrant checkpointing (`use_reentrant=True`); non-reentrant
    checkpointing installs hooks of its own that hide the saved tensors from this meter.
    """

    def __init__(self, exclude=()):
        self.exclude = {storage_key(t) for t in exclude}
        self.count, self.size = {}, {}
        self.live = self.peak = 0

    def _release(self, key):
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key]
            self.live -= self.size.pop(key)

    def _pack(self, t):
        key = storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key in self.exclude or nbytes == 0:
            return t
        if key not in self.count:
            self.count[key], self.size[key] = 0, nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.count[key] += 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def _unpack(holder):
        return holder.tensor if isinstance(holder, _Saved) else holder

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def measure_activations(model, input_ids: torch.Tensor, checkpointing: bool = False,
                        attention_mask: torch.Tensor | None = None) -> dict:
    """One forward + backward of `model` on input_ids [B, T] (labels = inputs) under the meter.

    attention_mask: optional [B, T] of 0/1 (0 = padding). Returns {"peak_bytes", "seconds"}:
    the peak of saved activations (parameters excluded) and the wall time of the forward +
    backward. Gradients are left in place; zero them yourself. Checkpointing is the reentrant
    kind, whose recomputation the saved-tensor meter can see.
    """
    model.train()
    set_checkpointing(model, checkpointing, reentrant=True)
    start = time.perf_counter()
    with SavedActivationMeter(exclude=list(model.parameters())) as meter:
        model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
    seconds = time.perf_counter() - start
    set_checkpointing(model, False, reentrant=True)
    return {"peak_bytes": meter.peak, "seconds": seconds}


def time_recomputation(model, input_ids: torch.Tensor, repeats: int = 9, progress: bool = False) -> dict:
    """How much more compute a forward + backward takes with per-layer checkpointing: median and spread.

    Times CPU seconds of this process (`time.process_time`), not wall time: on a shared machine
    wall time includes everybody else's work, and single wall-clock rounds of one setting can
    differ several-fold; on an idle machine with one thread the two agree. Torch runs on one
    thread meanwhile (restored after): idle intra-op threads spin, and spinning counts as CPU
    time. (CPU only: on a GPU the kernels run asynchronously and this would time the launches.)
    Each of `repeats` rounds,
    after one untimed warm-up round, times both modes back to back in alternating order and
    takes their ratio. Returns {"plain_s", "checkpointed_s" (median CPU seconds), "slowdown"
    (median ratio - 1), "slowdown_low", "slowdown_high" (quartiles of the rounds' ratios - 1),
    "repeats", "clock"}. progress=True shows a bar over the rounds.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an int >= 1")
    times = {False: [], True: []}
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _timed_rounds(model, input_ids, repeats, times, progress)
    finally:
        torch.set_num_threads(threads)
        set_checkpointing(model, False, reentrant=True)
    ratios = sorted(c / p for p, c in zip(times[False], times[True], strict=True))
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"plain_s": statistics.median(times[False]), "checkpointed_s": statistics.median(times[True]),
            "slowdown": statistics.median(ratios) - 1, "slowdown_low": low - 1, "slowdown_high": high - 1,
            "repeats": repeats, "clock": "process_time, 1 thread"}


def _timed_rounds(model, input_ids, repeats: int, times: dict, progress: bool = False) -> None:
    """`repeats` + 1 rounds of both modes, alternating which goes first; CPU seconds into `times`."""
    for i in tqdm(range(repeats + 1), desc="timed rounds (1 warm-up)", disable=not progress):
        for on in ((False, True) if i % 2 else (True, False)):
            set_checkpointing(model, on, reentrant=True)
            start = time.process_time()
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            if i:
                times[on].append(time.process_time() - start)
            model.zero_grad(set_to_none=True)


def padded_mask(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] attention mask whose first row is left-padded by a quarter (the rest unpadded)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :seq // 4] = 0
    return mask


def measure_single(size: str = "small", batch: int = 2, seq: int = 64, repeats: int = 9, seed: int = 0,
                   progress: bool = False) -> dict:
    """Activations with and without per-layer checkpointing, beside the calculator, and the slowdown.

    One process, FP32, SDPA attention. Returns {"none": {...}, "full": {...}, "padded": {...},
    "timing": {...}}: each mode has "measured", "calculator" and "ratio" (bytes); "padded" is
    "none" on a batch with padding (see `activation_memory(padding_mask=True)`); "timing" is
    `time_recomputation`'s. progress=True prints a line per metered pass and a bar over the timed rounds.
    """
    model = build_measure_model(size, seed)
    shape = ModelShape.from_config(model.config)
    x = random_batch(batch, seq, seed)
    out = {"size": size, "batch": batch, "seq": seq, "num_params": shape.param_count()}
    for mode, on, mask in (("none", False, None), ("full", True, None), ("padded", False, padded_mask(batch, seq))):
        measured = measure_activations(model, x, on, attention_mask=mask)["peak_bytes"]
        model.zero_grad(set_to_none=True)
        calc = activation_memory(shape, batch, seq, "fp32", "sdpa", "full" if on else "none",
                                 padding_mask=mask is not None)["total"]
        out[mode] = {"measured": measured, "calculator": calc, "ratio": measured / calc}
        if progress:
            print(f"metered pass '{mode}': {measured / 2**20:.2f} MiB saved", flush=True)
    out["timing"] = time_recomputation(model, x, repeats, progress)
    return out


def measure_lora(size: str = "small", rank: int = 8, batch: int = 2, seq: int = 32, seed: int = 0) -> dict:
    """One Adam step of `peft` LoRA (every linear, rank `rank`) on the measurement model, FP32.

    Returns the measured trainable parameters, gradient bytes (frozen weights must have none),
    Adam m and v bytes and saved-activation peak, each beside the calculator's figure.
    """
    model = build_measure_model(size, seed)
    shape = ModelShape.from_config(model.config)
    base = shape.param_count()
    lora = apply_lora(model, rank, 2 * rank, LORA_TARGETS)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=1e-4)
    x = random_batch(batch, seq, seed)
    lora.train()
    with SavedActivationMeter(exclude=list(lora.parameters())) as meter:
        lora(input_ids=x, labels=x).loss.backward()
    opt.step()
    m = [s["exp_avg"] for s in opt.state.values()]
    v = [s["exp_avg_sq"] for s in opt.state.values()]
    calc = lora_memory(base, lora_params(shape, rank, LORA_TARGETS), 1, 0, "fp32")
    return {"rank": rank, "base_params": base, "trainable_params": sum(p.numel() for p in trainable),
            "trainable_calculator": lora_params(shape, rank, LORA_TARGETS),
            "grads": storage_bytes(p.grad for p in lora.parameters()), "grads_calculator": calc["grads"],
            "frozen_with_grad": sum(p.grad is not None for p in lora.parameters() if not p.requires_grad),
            "adam": storage_bytes(m) + storage_bytes(v), "adam_calculator": calc["adam_m"] + calc["adam_v"],
            "activations": meter.peak,
            "activations_full_model": activation_memory(shape, batch, seq, "fp32")["total"]}


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (FSDP2's shards), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t: torch.Tensor) -> tuple:
    s = local(t).untyped_storage()
    return (str(t.device), s.data_ptr())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared storages count once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = local(t).untyped_storage()
            seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())
