"""Chapter 03: training memory per GPU, computed (ZeRO 0-3, activations, LoRA) and measured.

    python chapters/03_memory.py --params 70e9 --gpus 8 --gpu-mem-gb 80           # the tables
    python chapters/03_memory.py --model Qwen/Qwen2.5-7B --gpus 8 --gpu-mem-gb 80    # shape from a config
    python chapters/03_memory.py --params 1.3e9 --layers 24 --hidden 2048 --intermediate 5504 \\
        --heads 16 --kv-heads 16 --vocab 32000                                       # a shape by hand
    python chapters/03_memory.py --params 70e9 --gpus 8 --json                    # one JSON object
    python chapters/03_memory.py --measure                                          # measure under torchrun

The calculator reads only a config (`--model` id or directory; no weights are loaded). The
activation and LoRA figures need a model shape: from `--model`, else Llama-2-70B's, and the
shape flags (`--layers`, `--hidden`, ...) replace any of its sizes; the output always says
which shape it used. Activations assume an unpadded batch unless `--padding-mask`
(HF's SDPA then repeats K/V to every head and keeps the mask). `--measure` trains a small
Qwen2 under DDP, ZeRO-1 and FSDP2 (ZeRO-2/3 behaviour) with torchrun for each of
`--world-sizes` (gloo on CPU, NCCL on GPUs, where CUDA's allocator peaks are added), measures
activations with and without checkpointing, the recomputation slowdown (median and spread of
`--repeats` rounds) and LoRA's state, and writes `--out/summary.json`.

Every flag is checked before anything is loaded; a bad one exits with status 2 and one line
naming the flag, the value and the valid range.
"""

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from minirl.memory.calculator import (
    GB,
    LLAMA2_70B,
    PRECISIONS,
    RECOMPUTE,
    ZERO_LEVELS,
    ModelShape,
    activation_memory,
    bytes_per_param,
    lora_memory,
    lora_params,
    min_gpus,
    zero_communication,
    zero_per_gpu,
)
from minirl.runtime.argtypes import float_in, int_in, int_list
from minirl.runtime.cli import ConfigFileParser, merged_settings
from minirl.runtime.io import write_summary
from minirl.runtime.smollm2 import resolve_model_name

RUNS = Path(__file__).resolve().parent.parent / "runs"
SHAPE_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
               "heads": "num_heads", "kv_heads": "num_kv_heads", "vocab": "vocab_size"}
MEASURE_SIZES = ("small", "tiny")   # minirl.memory.measure.MEASURE_SIZES (not imported: it loads torch)
MAX_MEASURE_SEQ = 1024              # the measurement model's max_position_embeddings


def parse_args(argv=None) -> argparse.Namespace:
    parser = ConfigFileParser(description=__doc__.split("\n\n")[0],   # --config FILE.yaml, as every chapter
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=RUNS / "03_measure", help="directory for --measure's summary.json")
    parser.add_argument("--model", default=None, type=resolve_model_name,
                        help="HF model id or local directory (or smollm2): its config gives the shape")
    parser.add_argument("--params", type=float_in(0, low_open=True), default=None,
                        help="parameter count (default: the shape's)")
    parser.add_argument("--gpus", type=int_in(1), default=8, help="data-parallel GPUs N")
    parser.add_argument("--gpu-mem-gb", type=float_in(0, low_open=True), default=80.0, help="memory of one GPU, GB")
    parser.add_argument("--precision", default="mixed", choices=PRECISIONS)
    parser.add_argument("--global-batch", type=int_in(1), default=None, help="sequences per step (default: --gpus)")
    parser.add_argument("--seq", type=int_in(1), default=4096, help="tokens per sequence for the activations")
    parser.add_argument("--padding-mask", action="store_true",
                        help="activations of a padded batch (HF SDPA repeats K/V to every head)")
    parser.add_argument("--lora-rank", type=int_in(1), default=16)
    shape = parser.add_argument_group("model shape (default: --model's config, else Llama-2-70B's)")
    for flag_name, field in SHAPE_FLAGS.items():
        shape.add_argument("--" + flag_name.replace("_", "-"), dest=flag_name, type=int_in(1), default=None,
                           help=f"ModelShape.{field}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    measure = parser.add_argument_group("--measure (on this machine, under torchrun)")
    measure.add_argument("--measure", action="store_true", help="measure instead of computing")
    measure.add_argument("--world-sizes", type=int_list(1), default=[1, 2, 4], help="comma-separated ranks per job")
    measure.add_argument("--size", default="small", choices=MEASURE_SIZES, help="model size")
    measure.add_argument("--batch", type=int_in(1), default=2, help="sequences per rank")
    measure.add_argument("--seq-measure", type=int_in(1, MAX_MEASURE_SEQ), default=64, help="tokens per sequence")
    measure.add_argument("--repeats", type=int_in(1), default=9, help="timed rounds for the recomputation slowdown")
    args = parser.parse_args(argv)
    args.global_batch = args.global_batch or args.gpus
    if args.global_batch % args.gpus:
        parser.error(f"argument --global-batch: {args.global_batch}: not divisible by --gpus {args.gpus} "
                     "(every GPU gets the same number of sequences)")
    args.settings = merged_settings(parser, args)   # after the config file and the flags: summary.json's
    if args.measure:
        import torch  # only for --measure: the calculator's flags are checked without it

        if torch.cuda.is_available() and max(args.world_sizes) > torch.cuda.device_count():
            parser.error(f"argument --world-sizes: {max(args.world_sizes)}: this machine has "
                         f"{torch.cuda.device_count()} GPUs")
        return args
    args.shape, args.shape_source = model_shape(parser, args)
    return args


def model_shape(parser: argparse.ArgumentParser, args) -> tuple[ModelShape, str]:
    """The shape the activation and LoRA figures use, and a phrase saying where it came from."""
    if args.model is not None:
        # imported here: it loads torch and transformers, which the plain calculator does not need
        from minirl.runtime.model_loading import ModelSourceError, check_model_source

        try:
            check_model_source(args.model, need_tokenizer=False)
            base, source = ModelShape.from_pretrained(args.model), f"from {args.model}'s config"
        except ModelSourceError as err:                       # its message starts with the name
            parser.error(f"argument --model: {err}")
        except (ValueError, OSError) as err:
            parser.error(f"argument --model: {args.model}: {err}")
    else:
        base, source = LLAMA2_70B, "Llama-2-70B's (assumed: no --model)"
    given = {field: getattr(args, name) for name, field in SHAPE_FLAGS.items() if getattr(args, name) is not None}
    if not given:
        return base, source
    try:
        shape = replace(base, **given, num_params=None)       # the count follows the new sizes
    except ValueError as err:
        flags = " ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in SHAPE_FLAGS if getattr(args, n))
        parser.error(f"shape flags {flags}: {err}")
    if len(given) == len(SHAPE_FLAGS):
        return shape, "from the shape flags"
    return shape, source + " with " + ", ".join(f"{k}={v}" for k, v in given.items())


def calculate(args) -> dict:
    """Everything the tables print, as one JSON-able dict."""
    shape = args.shape
    num_params = args.params if args.params is not None else shape.param_count()
    dtype = "fp32" if args.precision == "fp32" else "bf16"
    micro = args.global_batch // args.gpus
    acts = {rc: activation_memory(shape, micro, args.seq, dtype, recompute=rc, padding_mask=args.padding_mask)["total"]
            for rc in RECOMPUTE}
    gpu_bytes = args.gpu_mem_gb * GB
    zero = {}
    for stage in ZERO_LEVELS:
        per = zero_per_gpu(num_params, args.gpus, stage, args.precision)
        comm = zero_communication(num_params, args.gpus, stage, args.precision)
        zero[str(stage)] = {**per, "comm_bytes": comm["bytes"],
                            "fits_with_checkpointing": per["total"] + acts["full"] <= gpu_bytes,
                            "min_gpus_with_checkpointing": min_gpus(num_params, gpu_bytes, stage, args.precision,
                                                                    acts["full"])}
    n_lora = lora_params(shape, args.lora_rank)
    lora = lora_memory(num_params, n_lora, args.gpus, 3, args.precision)
    return {"num_params": num_params, "num_gpus": args.gpus, "gpu_mem_gb": args.gpu_mem_gb,
            "precision": args.precision, "bytes_per_param": bytes_per_param(args.precision),
            "zero": zero,
            "activations": {**acts, "micro_batch": micro, "seq": args.seq, "dtype": dtype,
                            "padding_mask": args.padding_mask,
                            "shape": dict(vars(shape)), "shape_source": args.shape_source,
                            "shape_params": shape.param_count()},
            "lora": {"rank": args.lora_rank, "trainable_params": n_lora, "zero3_per_gpu": lora}}


def print_tables(calc: dict) -> None:
    n, psi = calc["num_gpus"], calc["num_params"]
    a = calc["activations"]
    print(f"{psi / 1e9:.2f} B parameters, {calc['precision']} precision, {n} GPUs of {calc['gpu_mem_gb']} GB")
    print(f"bytes per parameter: {calc['bytes_per_param']}")
    print(f"model shape {a['shape_source']}: {ModelShape(**a['shape']).describe()}")
    if abs(a["shape_params"] / psi - 1) > 0.25:
        print(f"  note: this shape has {a['shape_params'] / 1e9:.3g} B parameters, not {psi / 1e9:.3g} B: the "
              "activation and LoRA figures follow the shape; give --model or --layers/--hidden/... for yours")
    print(f"activations per GPU ({a['micro_batch']} x {a['seq']} tokens, {a['dtype']}, "
          f"{'padded batch' if a['padding_mask'] else 'no padding'}): "
          + ", ".join(f"{k} {a[k] / GB:.1f} GB" for k in RECOMPUTE))
    print(f"\n{'stage':>5} | {'weights':>8} | {'grads':>8} | {'master':>8} | {'adam_m':>8} | {'adam_v':>8} | "
          f"{'state GB':>9} | {'+ckpt act':>9} | fits? | min GPUs")
    for stage, z in calc["zero"].items():
        total = z["total"] + a["full"]
        parts = " | ".join(f"{z[k] / GB:8.1f}" for k in ("weights", "grads", "master", "adam_m", "adam_v"))
        print(f"{stage:>5} | " + parts
              + f" | {z['total'] / GB:9.1f} | {total / GB:9.1f} | {'yes' if z['fits_with_checkpointing'] else 'no':>5}"
              + f" | {z['min_gpus_with_checkpointing'] or 'never'}")
    lo = calc["lora"]
    print(f"\nLoRA r={lo['rank']} on every linear: {lo['trainable_params'] / 1e6:.1f} M trainable; "
          f"ZeRO-3 per GPU {(lo['zero3_per_gpu']['total'] + a['full']) / GB:.1f} GB with checkpointed activations")


def measure(args) -> dict:
    from tqdm.auto import tqdm

    from minirl.memory.measure import measure_lora, measure_single
    from minirl.runtime.zero_measure import compare_measured, launch_measurement

    started = time.perf_counter()
    single = measure_single(args.size, args.batch, args.seq_measure, repeats=args.repeats)
    lora = measure_lora(args.size, rank=8, batch=args.batch, seq=args.seq_measure)
    rows = []
    for ws in tqdm(args.world_sizes, desc="torchrun world sizes"):
        rows.extend(launch_measurement(ws, size=args.size, batch=args.batch, seq=args.seq_measure))
    table = compare_measured(rows)
    summary = {"size": args.size, "world_sizes": args.world_sizes, "dtype": "fp32", "rows": rows,
               "comparison": table, "activations": single, "lora": lora, "seconds": time.perf_counter() - started,
               "settings": args.settings, "config_file": None if args.config is None else str(args.config)}
    write_summary(args.out, summary)
    components = ("weights_step", "weights_rest", "grads", "adam_m", "adam_v", "state")
    cells = {(r["strategy"], r["world_size"], r["component"]): r for r in table}
    print("measured / calculator per rank (mean over ranks; 1.000 = exact)")
    print(f"{'strategy':>15} {'N':>2} " + " ".join(f"{c:>12}" for c in components))
    for strategy, n in dict.fromkeys((r["strategy"], r["world_size"]) for r in table):
        print(f"{strategy:>15} {n:>2} " + " ".join(f"{cells[(strategy, n, c)]['ratio']:12.3f}" for c in components))
    for note in dict.fromkeys(r["note"] for r in table if r["note"]):
        print(f"  note: {note}")
    for mode in ("none", "full", "padded"):
        m = single[mode]
        print(f"activations ({mode}): measured {m['measured'] / 2**20:.2f} MiB, calculator "
              f"{m['calculator'] / 2**20:.2f} MiB ({m['ratio'] - 1:+.1%})")
    t = single["timing"]
    print(f"checkpointing slowdown: {t['slowdown']:+.0%} (median of {t['repeats']} rounds; middle half "
          f"{t['slowdown_low']:+.0%} to {t['slowdown_high']:+.0%})")
    print(f"LoRA r=8: {lora['trainable_params']:,} trainable (calculator {lora['trainable_calculator']:,}), "
          f"{lora['frozen_with_grad']} frozen tensors with a gradient")
    print(f"summary: {args.out / 'summary.json'}")
    return summary


def main(argv=None) -> int:
    """0 when the tables (or the measurement) are printed; 1 with a one-line error when a measurement job fails."""
    args = parse_args(argv)
    if args.measure:
        try:
            measure(args)
        except (RuntimeError, subprocess.TimeoutExpired) as err:    # the job's output is in the message
            print(f"{err}\nerror: the measurement job failed: {str(err).splitlines()[0]}", file=sys.stderr)
            return 1
        return 0
    calc = calculate(args)
    if args.json:
        print(json.dumps(calc))
    else:
        print_tables(calc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
