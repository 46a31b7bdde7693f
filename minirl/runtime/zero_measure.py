"""Training memory per rank, measured under torchrun: DDP, ZeRO-1 and FSDP2 as ZeRO-2 and ZeRO-3.

Hand-written (a measurement harness): notebook 03 runs it and sets its figures beside the calculator.

`memory_worker` is the body of a `torchrun` job that trains a small Qwen2 two steps under each
strategy and reports, per rank, the bytes of parameters, gradients and optimizer state that
rank actually holds (DTensor shards counted by their local storage; on CUDA also the caching
allocator's peak, `torch.cuda.max_memory_allocated`). `launch_measurement` starts that job
and returns its table; `compare_measured` sets it beside the calculator's prediction. The
models are wrapped by `minirl.memory.wrap`, the code notebook 04
trains with; `minirl.runtime.launch.torchrun` starts the job.

Simplified on purpose: FP32 throughout (gloo has little BF16 support), one small model.
"""


import gc
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from minirl.memory.calculator import zero_per_gpu
from minirl.memory.measure import MEASURE_SIZES, STRATEGIES, build_measure_model, random_batch, storage_bytes
from minirl.memory.wrap import make_optimizer, wrap_model
from minirl.runtime.launch import output_ends, torchrun


def _wrap(model, strategy: str, device: torch.device):
    """(module to call, optimizer, module whose parameters are counted) for `strategy`: the wrappers notebook 04
    trains with."""
    wrapped = wrap_model(model, STRATEGIES[strategy], device)
    return wrapped.wrapper, make_optimizer(wrapped, torch.optim.Adam, lr=1e-4), wrapped.module


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


def memory_worker(argv=None) -> None:
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
    """Run `memory_worker` under `torchrun --standalone --nproc-per-node world_size`; one dict per rank and strategy.

    Launched with `minirl.runtime.launch.torchrun` (a timeout ends every rank, then raises
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
            job = torchrun("minirl.runtime.zero_measure:memory_worker", world_size, flags, timeout=timeout,
                           threads=threads)
            if job.returncode == 0 and out.exists():
                return json.loads(out.read_text())
            failure = (f"measurement job (world_size={world_size}) failed with code {job.returncode}:\n"
                       f"{output_ends(job.stdout)}")
            if attempt < attempts:
                warnings.warn(f"{failure.splitlines()[0]} (attempt {attempt} of {attempts}); running it again",
                              stacklevel=2)
        raise RuntimeError(failure)


def chapter_measurement(root: Path) -> dict:
    """The summary of `chapters/03_memory.py --measure`, kept in `root/runs/03_measure/summary.json`.

    Runs the chapter (activations, LoRA, then torchrun at 1, 2 and 4 ranks; a few minutes on two
    cores), streaming its output live, when there is no summary yet or one timed by an older
    version; delete the directory to measure again. RuntimeError when the chapter fails.
    """
    import codecs  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cached = Path(root) / "runs" / "03_measure" / "summary.json"
    timing = json.loads(cached.read_text()).get("activations", {}).get("timing", {}) if cached.exists() else {}
    if timing.get("clock") != "process_time, 1 thread":       # no measurement yet, or one by an older version
        print("measuring with chapters/03_memory.py --measure: activations, LoRA, then torchrun at 1, 2 and 4 ranks")
        proc = subprocess.Popen([sys.executable, str(Path(root) / "chapters" / "03_memory.py"), "--measure",
                                 "--out", str(cached.parent)], cwd=root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        for chunk in iter(lambda: proc.stdout.read1(256), b""):   # its progress bar and tables, live
            sys.stdout.write(decode(chunk))
        if proc.wait():
            raise RuntimeError(f"chapters/03_memory.py --measure failed with code {proc.returncode} (output above)")
    print(f"measured by chapters/03_memory.py --measure: {cached.relative_to(root)}")
    return json.loads(cached.read_text())
