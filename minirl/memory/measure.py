# Generated from notebooks/03_training_memory.py by tools/build.py -- edit the notebook, not this file.
"""Training memory, measured: saved activations, and per-rank state under DDP, ZeRO-1 and FSDP2.

`SavedActivationMeter` counts the unique storages autograd saves for backward (works on CPU
and GPU). `worker_main` is the body of a `torchrun` job that trains a small Qwen2 one step
at a time under four strategies and reports, per rank, the bytes of parameters, gradients and
optimizer state each rank actually holds (DTensor shards counted by their local storage);
`launch_measurement` starts that job and returns its table. On CUDA it adds the caching
allocator's own peak, `torch.cuda.max_memory_allocated`. The models are wrapped (DDP, ZeRO-1,
FSDP2, checkpointing, LoRA) by `minirl.parallel.wrap`, the code notebook 04 trains with, so
what is measured here is what trains there.

Simplified on purpose: FP32 throughout (gloo has little BF16 support), one small model, three
steps. Counting storages shows *what* is held; the allocator's peak (CUDA only) adds what a
count of named tensors cannot see: communication buffers, temporaries, fragmentation.
"""

__all__ = ["MEASURE_SIZES", "STRATEGIES", "VOCAB_SIZE", "build_measure_model", "random_batch",
           "local", "storage_key", "storage_bytes", "SavedActivationMeter", "set_checkpointing",
           "measure_activations", "time_recomputation", "padded_mask", "measure_single",
           "measure_strategy", "worker_main", "launch_measurement", "NOTES", "compare_measured",
           "LORA_TARGETS", "measure_lora"]

import gc
import json
import os
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from minirl.memory.calculator import ModelShape, activation_memory, lora_memory, lora_params, zero_per_gpu
from minirl.parallel import wrap
from minirl.parallel.launch import output_ends, torchrun

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


def set_checkpointing(model, on: bool) -> None:
    """Per-layer gradient checkpointing on a transformers model (reentrant, so it can be metered)."""
    wrap.set_checkpointing(model, on, reentrant=True)


def measure_activations(model, input_ids: torch.Tensor, checkpointing: bool = False,
                        attention_mask: torch.Tensor | None = None) -> dict:
    """One forward + backward of `model` on input_ids [B, T] (labels = inputs) under the meter.

    attention_mask: optional [B, T] of 0/1 (0 = padding). Returns {"peak_bytes", "seconds"}:
    the peak of saved activations (parameters excluded) and the wall time of the forward +
    backward. Gradients are left in place; zero them yourself.
    """
    model.train()
    set_checkpointing(model, checkpointing)
    start = time.perf_counter()
    with SavedActivationMeter(exclude=list(model.parameters())) as meter:
        model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
    seconds = time.perf_counter() - start
    set_checkpointing(model, False)
    return {"peak_bytes": meter.peak, "seconds": seconds}


def time_recomputation(model, input_ids: torch.Tensor, repeats: int = 9) -> dict:
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
    "repeats", "clock"}.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an int >= 1")
    times = {False: [], True: []}
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _timed_rounds(model, input_ids, repeats, times)
    finally:
        torch.set_num_threads(threads)
        set_checkpointing(model, False)
    ratios = sorted(c / p for p, c in zip(times[False], times[True]))
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"plain_s": statistics.median(times[False]), "checkpointed_s": statistics.median(times[True]),
            "slowdown": statistics.median(ratios) - 1, "slowdown_low": low - 1, "slowdown_high": high - 1,
            "repeats": repeats, "clock": "process_time, 1 thread"}


def _timed_rounds(model, input_ids, repeats: int, times: dict) -> None:
    """`repeats` + 1 rounds of both modes, alternating which goes first; CPU seconds into `times`."""
    for i in range(repeats + 1):                                    # the first round warms up, untimed
        for on in ((False, True) if i % 2 else (True, False)):
            set_checkpointing(model, on)
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


def measure_single(size: str = "small", batch: int = 2, seq: int = 64, repeats: int = 9, seed: int = 0) -> dict:
    """Activations with and without per-layer checkpointing, beside the calculator, and the slowdown.

    One process, FP32, SDPA attention. Returns {"none": {...}, "full": {...}, "padded": {...},
    "timing": {...}}: each mode has "measured", "calculator" and "ratio" (bytes); "padded" is
    "none" on a batch with padding (see `activation_memory(padding_mask=True)`); "timing" is
    `time_recomputation`'s.
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
    out["timing"] = time_recomputation(model, x, repeats)
    return out


def _wrap(model, strategy: str, device: torch.device):
    """(module to call, optimizer, module whose parameters are counted) for `strategy`: notebook 04's wrappers."""
    wrapped = wrap.wrap_model(model, STRATEGIES[strategy], device)
    return wrapped.wrapper, wrap.make_optimizer(wrapped, torch.optim.Adam, lr=1e-4), wrapped.module


def measure_strategy(strategy: str, size: str = "small", batch: int = 2, seq: int = 32, seed: int = 0,
                     device: torch.device = torch.device("cpu")) -> dict:
    """Train `size` two steps under `strategy` in the current process group; this rank's bytes.

    Returns {"weights", "weights_step", "grads", "adam_m", "adam_v", "opt_other", "step_s",
    "num_params", ...}: storage bytes held by this rank at rest (after the step) and, for
    "weights_step", right after the forward pass of the second step. On CUDA also
    "cuda_peak" (max_memory_allocated over the second step) and "cuda_at_rest".
    """
    import torch.distributed as dist

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {', '.join(map(repr, STRATEGIES))}")
    model = build_measure_model(size, seed).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    call, opt, counted = _wrap(model, strategy, device)
    shards = [p for p in counted.parameters()]                     # at rest: what the rank owns
    seen = {}

    def after_forward(module, args, output):
        registered = list(counted.parameters())                    # FSDP2 swaps in gathered tensors
        seen["weights_step"] = storage_bytes(shards + registered)

    hook = counted.register_forward_hook(after_forward)
    x = random_batch(batch, seq, seed + dist.get_rank(), device)
    result = {}
    for step in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        call(input_ids=x, labels=x).loss.backward()
        result["grads"] = storage_bytes(p.grad for p in counted.parameters())
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["step_s"] = time.perf_counter() - start
        if step == 0:
            opt.zero_grad(set_to_none=False)                       # keep grads allocated, as in training
    hook.remove()
    state = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeroRedundancyOptimizer wraps one
    tensors = {"exp_avg": [], "exp_avg_sq": [], "other": []}
    for per_param in state.values():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[name if name in tensors else "other"].append(value)
    result.update(strategy=strategy, stage=STRATEGIES[strategy], rank=dist.get_rank(),
                  world_size=dist.get_world_size(), num_params=num_params, size=size, batch=batch, seq=seq,
                  device=str(device), dtype="fp32", weights=storage_bytes(counted.parameters()),
                  weights_step=seen["weights_step"], adam_m=storage_bytes(tensors["exp_avg"]),
                  adam_v=storage_bytes(tensors["exp_avg_sq"]), opt_other=storage_bytes(tensors["other"]))
    if device.type == "cuda":
        result["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        result["cuda_at_rest"] = torch.cuda.memory_allocated(device)
    return result


def worker_main(argv=None) -> None:
    """Body of the torchrun job: every strategy in turn; rank 0 writes all ranks' results as JSON."""
    import argparse

    import torch.distributed as dist

    parser = argparse.ArgumentParser(description="minirl memory measurement worker (run under torchrun)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--size", default="small", choices=list(MEASURE_SIZES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rows = []
    try:
        for strategy in args.strategies.split(","):
            mine = measure_strategy(strategy, args.size, args.batch, args.seq, device=device)
            gc.collect()                                           # the strategy's model and optimizer are gone
            if cuda:
                torch.cuda.empty_cache()                           # so the next strategy's CUDA peak starts clean
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            rows.extend(everyone)
        if dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
        dist.barrier()   # leave together: a rank whose peer already closed its gloo pairs can abort at exit
    finally:
        dist.destroy_process_group()


def launch_measurement(world_size: int, strategies=tuple(STRATEGIES), size: str = "small", batch: int = 2,
                       seq: int = 32, timeout: float = 600, attempts: int = 2) -> list[dict]:
    """Run `worker_main` under `torchrun --standalone --nproc-per-node world_size`; one dict per rank and strategy.

    Launched with notebook 04's `torchrun` (a timeout ends every rank, then raises
    subprocess.TimeoutExpired). Uses every visible GPU's NCCL when CUDA is available
    (world_size must then be <= the GPU count), else gloo on CPU processes sharing the cores.
    On an overloaded machine a gloo job occasionally aborts, so a failed job is run again
    (with a warning that says why) up to `attempts` times in all; the last failure raises
    RuntimeError with the start and the end of the job's output (a rank's own error comes
    before torchrun's long summary).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if torch.cuda.is_available() and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size={world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"strategies={unknown!r}: use names from {', '.join(STRATEGIES)}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        flags = ["--strategies", ",".join(strategies), "--size", size, "--batch", batch, "--seq", seq, "--out", out]
        for attempt in range(1, attempts + 1):
            job = torchrun("minirl.memory.measure:worker_main", world_size, flags, timeout=timeout, threads=threads)
            if job.returncode == 0 and out.exists():
                return json.loads(out.read_text())
            failure = (f"measurement job (world_size={world_size}) failed with code {job.returncode}:\n"
                       f"{output_ends(job.stdout)}")
            if attempt < attempts:
                warnings.warn(f"{failure.splitlines()[0]} (attempt {attempt} of {attempts}); running it again")
        raise RuntimeError(failure)


NOTES = {
    ("zero1", "adam"): "ZeroRedundancyOptimizer gives each rank whole tensors, so ranks differ; their mean is exact",
    ("fsdp_noreshard", "weights_step"): "FSDP2 keeps its 1/N shard beside the gathered copy: +1/N "
                                        "(with mixed precision that shard is the FP32 master)",
    ("fsdp_noreshard", "weights_rest"): "FSDP2 reshards after backward, so between steps it holds ZeRO-3's 1/N; "
                                        "DeepSpeed's ZeRO-2 keeps the full copy",
    ("fsdp", "weights_step"): "seen after the forward; the one layer gathered at a time (a transient) is "
                              "already freed (torch.cuda.max_memory_allocated sees it)",
}


def compare_measured(rows: list[dict], tolerance: float = 0.05) -> list[dict]:
    """Measured bytes (mean and max over ranks) against the calculator's FP32 figures.

    rows: the per-rank dicts of `launch_measurement`. Returns one dict per (strategy, world
    size, component) with "calculator", "measured_mean", "measured_max", "ratio" (mean /
    calculator), "verdict" ("agree" within `tolerance`, "explained" when a note says why,
    else "DIFFER") and "note".
    """
    groups = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["world_size"]), []).append(r)
    table = []
    for (strategy, n), ranks in sorted(groups.items(), key=lambda kv: (STRATEGIES[kv[0][0]], kv[0][1])):
        stage, psi = STRATEGIES[strategy], ranks[0]["num_params"]
        calc = zero_per_gpu(psi, n, stage, "fp32")
        expected = {"weights_step": calc["weights"], "weights_rest": calc["weights"], "grads": calc["grads"],
                    "adam_m": calc["adam_m"], "adam_v": calc["adam_v"],
                    "state": calc["weights"] + calc["grads"] + calc["adam_m"] + calc["adam_v"]}
        measured = {"weights_step": [r["weights_step"] for r in ranks], "weights_rest": [r["weights"] for r in ranks],
                    "grads": [r["grads"] for r in ranks], "adam_m": [r["adam_m"] for r in ranks],
                    "adam_v": [r["adam_v"] for r in ranks],
                    "state": [r["weights_step"] + r["grads"] + r["adam_m"] + r["adam_v"] for r in ranks]}
        for comp, values in measured.items():
            mean = sum(values) / len(values)
            ratio = mean / expected[comp]
            note = NOTES.get((strategy, "adam" if comp.startswith("adam") else comp), "")
            if comp == "state" and strategy == "fsdp_noreshard" and n > 0:
                note = NOTES[(strategy, "weights_step")]
            spread = max(values) / mean - 1
            if strategy == "zero1" and comp.startswith("adam") and spread > tolerance:
                note = f"{NOTES[('zero1', 'adam')]} (largest rank +{spread:.0%})"
            verdict = "agree" if abs(ratio - 1) <= tolerance else ("explained" if note else "DIFFER")
            shown = note if verdict != "agree" or spread > tolerance else ""
            table.append(dict(strategy=strategy, stage=stage, world_size=n, component=comp,
                              calculator=expected[comp], measured_mean=mean, measured_max=max(values),
                              ratio=ratio, verdict=verdict, note=shown))
    return table


LORA_TARGETS = wrap.LORA_TARGETS


def measure_lora(size: str = "small", rank: int = 8, batch: int = 2, seq: int = 32, seed: int = 0) -> dict:
    """One Adam step of `peft` LoRA (every linear, rank `rank`) on the measurement model, FP32.

    Returns the measured trainable parameters, gradient bytes (frozen weights must have none),
    Adam m and v bytes and saved-activation peak, each beside the calculator's figure.
    """
    model = build_measure_model(size, seed)
    shape = ModelShape.from_config(model.config)
    base = shape.param_count()
    lora = wrap.apply_lora(model, rank, 2 * rank, LORA_TARGETS)
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
