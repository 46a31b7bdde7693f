"""Chapter 03: training memory per GPU, computed (ZeRO 0-3, activations, LoRA) and measured.

    python chapters/03_memory.py --params 70e9 --gpus 8 --gpu-mem-gb 80         # the tables
    python chapters/03_memory.py --model Qwen/Qwen2.5-7B --gpus 8 --gpu-mem-gb 80  # shape from a config
    python chapters/03_memory.py --params 70e9 --gpus 8 --json                  # one JSON object
    python chapters/03_memory.py --measure --out runs/03                         # measure under torchrun

The calculator reads only a config (`--model` id or directory; no weights are loaded). Without
`--model` the activation figures use Llama-2-70B's shape. `--measure` trains a small Qwen2 under
DDP, ZeRO-1 and FSDP2 (ZeRO-2/3 behaviour) with torchrun for each of `--world-sizes` (gloo on
CPU, NCCL on GPUs, where CUDA's allocator peaks are added), measures activations with and
without checkpointing, the recomputation slowdown and LoRA's state, and writes
`--out/summary.json`.
"""

import json
import time

from minirl.utils.cli import common_parser, seed_everything, write_summary
from minirl.memory.calculator import (GB, LLAMA2_70B, PRECISIONS, RECOMPUTE, STAGES, ModelShape,
                           activation_memory, bytes_per_param, lora_memory, lora_params, min_gpus,
                           zero_communication, zero_per_gpu)


def calculate(args) -> dict:
    """Everything the tables print, as one JSON-able dict."""
    shape = ModelShape.from_pretrained(args.model) if args.model else LLAMA2_70B
    num_params = args.params if args.params is not None else shape.param_count()
    if num_params <= 0:
        raise SystemExit(f"--params={num_params}: must be a positive number of parameters")
    dtype = "fp32" if args.precision == "fp32" else "bf16"
    micro = args.global_batch // args.gpus
    acts = {rc: activation_memory(shape, micro, args.seq, dtype, recompute=rc)["total"] for rc in RECOMPUTE}
    gpu_bytes = args.gpu_mem_gb * GB
    zero = {}
    for stage in STAGES:
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
                            "shape": {k: v for k, v in vars(shape).items()}},
            "lora": {"rank": args.lora_rank, "trainable_params": n_lora, "zero3_per_gpu": lora}}


def print_tables(calc: dict) -> None:
    n, psi = calc["num_gpus"], calc["num_params"]
    print(f"{psi / 1e9:.2f} B parameters, {calc['precision']} precision, {n} GPUs of {calc['gpu_mem_gb']} GB")
    print(f"bytes per parameter: {calc['bytes_per_param']}")
    a = calc["activations"]
    print(f"activations per GPU ({a['micro_batch']} x {a['seq']} tokens, {a['dtype']}): "
          + ", ".join(f"{k} {a[k] / GB:.1f} GB" for k in RECOMPUTE))
    print(f"\n{'stage':>5} | {'weights':>8} | {'grads':>8} | {'master':>8} | {'adam_m':>8} | {'adam_v':>8} | "
          f"{'state GB':>9} | {'+ckpt act':>9} | fits? | min GPUs")
    for stage, z in calc["zero"].items():
        total = z["total"] + a["full"]
        print(f"{stage:>5} | " + " | ".join(f"{z[k] / GB:8.1f}" for k in ("weights", "grads", "master", "adam_m", "adam_v"))
              + f" | {z['total'] / GB:9.1f} | {total / GB:9.1f} | {'yes' if z['fits_with_checkpointing'] else 'no':>5}"
              + f" | {z['min_gpus_with_checkpointing'] or 'never'}")
    lo = calc["lora"]
    print(f"\nLoRA r={lo['rank']} on every linear: {lo['trainable_params'] / 1e6:.1f} M trainable; "
          f"ZeRO-3 per GPU {(lo['zero3_per_gpu']['total'] + a['full']) / GB:.1f} GB with checkpointed activations")


def measure(args) -> dict:
    from tqdm.auto import tqdm

    from minirl.memory.measure import compare_measured, launch_measurement, measure_lora, measure_single

    started = time.perf_counter()
    single = measure_single(args.size, args.batch, args.seq_measure, repeats=args.repeats)
    lora = measure_lora(args.size, rank=8, batch=args.batch, seq=args.seq_measure)
    rows = []
    for ws in tqdm(args.world_sizes, desc="torchrun world sizes"):
        rows.extend(launch_measurement(ws, size=args.size, batch=args.batch, seq=args.seq_measure))
    table = compare_measured(rows)
    summary = {"size": args.size, "world_sizes": args.world_sizes, "dtype": "fp32", "rows": rows,
               "comparison": table, "activations": single, "lora": lora, "seconds": time.perf_counter() - started}
    write_summary(args.out, summary)
    print(f"{'strategy':>15} {'N':>2} {'component':>12} {'calculator':>12} {'measured':>12} {'max rank':>12} "
          f"{'ratio':>6}  verdict")
    for r in table:
        print(f"{r['strategy']:>15} {r['world_size']:>2} {r['component']:>12} {r['calculator']:12,.0f} "
              f"{r['measured_mean']:12,.0f} {r['measured_max']:12,.0f} {r['ratio']:6.3f}  {r['verdict']} {r['note']}")
    print(json.dumps({k: v for k, v in single.items()}, indent=1))
    print(json.dumps(lora, indent=1))
    print(f"summary: {args.out / 'summary.json'}")
    return summary


def main(argv=None) -> dict:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=None, help="parameter count (default: from --model / 70B)")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs N")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0)
    parser.add_argument("--precision", default="mixed", choices=PRECISIONS)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: --gpus)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence for the activation estimate")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--measure", action="store_true", help="measure on this machine under torchrun")
    parser.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--size", default="small", choices=["small", "tiny"], help="model size for --measure")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank for --measure")
    parser.add_argument("--seq-measure", type=int, default=32, help="tokens per sequence for --measure")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats for the recomputation slowdown")
    args = parser.parse_args(argv)
    seed_everything(args.seed)
    if args.gpus < 1:
        parser.error(f"--gpus={args.gpus}: must be >= 1")
    if args.gpu_mem_gb <= 0:
        parser.error(f"--gpu-mem-gb={args.gpu_mem_gb}: must be > 0")
    args.global_batch = args.global_batch or args.gpus
    if args.global_batch % args.gpus:
        parser.error(f"--global-batch={args.global_batch} is not divisible by --gpus={args.gpus}")
    if args.measure:
        return measure(args)
    calc = calculate(args)
    if args.json:
        print(json.dumps(calc))
    else:
        print_tables(calc)
    return calc


if __name__ == "__main__":
    main()
