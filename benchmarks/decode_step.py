"""The decode step alone: HF's against the paged engine's at equal rows, and the engine's against the roofline.

    python benchmarks/decode_step.py                  # the long-tail policy and a 32 M Qwen2, 30 pairs (under a minute)
    python benchmarks/decode_step.py --shapes long    # the long-tail policy only
    python benchmarks/decode_step.py --quick          # 2 pairs, short limit trials: a smoke test, not a measurement

What `engine_vs_hf.py` prints as `step_ratio_equal_rows` and `decode_roofline_share`, measured the same
way (`engine_vs_hf.decode_steps`: 32 sequences of one new token after 160 cached ones, one thread, CPU
time, pairs in alternating order, 8 steps back to back a side), without the rest of that run, on two
shapes: `long`, the long-tail policy (a random Qwen2 of 7.6 M parameters: hidden 256, 8 layers, 4 query
heads sharing 1 key/value head), and `32m`, a random Qwen2 of 30.5 M parameters (hidden 512, 8 layers, 8
query heads sharing 2 key/value heads, intermediate 2048, the same 70-token vocabulary). The limits are
the one-thread ones of `minirl.runtime.engine_measure.machine_limits` (CPU time, best of 3 trials of a
second each). One line per shape:
`shape: hf H ms, paged P ms, step_ratio_equal_rows X (min A, max B, n N), decode_roofline_share S`.
"""

import argparse
import sys
from pathlib import Path

from minirl.runtime.engine_measure import decode_step_work, machine_limits
from minirl.runtime.workloads import LongTailConfig, build_long_tail_policy, load_long_tail_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))               # engine_vs_hf.py, beside this script
from engine_vs_hf import CONTEXT, ROWS, decode_steps  # noqa: E402

SHAPES = {"long": None, "32m": LongTailConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                                               intermediate_size=2048)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="2 pairs and 0.1 s limit trials (a smoke test)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs={args.pairs}: must be >= 1")
    pairs = 2 if args.quick else args.pairs
    limits = machine_limits(trial=0.1 if args.quick else 1.0, current_threads=False)
    print(f"machine_limits: matmul_gflops_1t {limits['matmul_flops_1t'] / 1e9:.1f} "
          f"copy_gbps {limits['copy_bytes_1t'] / 1e9:.1f}", flush=True)
    for shape in args.shapes:
        config = SHAPES[shape]
        model = load_long_tail_policy()[0] if config is None else build_long_tail_policy(config)[0]
        steps = decode_steps(model, pairs, ROWS, CONTEXT)
        work = decode_step_work(model, ROWS, CONTEXT)
        ideal = max(work["bytes"] / limits["copy_bytes_1t"], work["flops"] / limits["matmul_flops_1t"])
        r, median = steps["ratio"], steps["median_s"]
        print(f"{shape}: hf {1e3 * median['hf']:.2f} ms, paged {1e3 * median['paged']:.2f} ms, "
              f"step_ratio_equal_rows {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}, n {r['n']}), "
              f"decode_roofline_share {ideal / median['paged']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
