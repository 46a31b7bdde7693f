"""The GPU check behind tests/gpu/run.sh: each GPU path of minirl once, on one GPU, with a summary table.

    tests/gpu/run.sh                 # on a CUDA machine: about 5 minutes on one H200
    tests/gpu/run.sh --cpu           # the same checks on the CPU, small (CI runs this rehearsal)
    tests/gpu/run.sh --only stage1,mfu --out /tmp/gpu-check

Checks, in order (each a subprocess, as a user would run it; figures from its summary.json):
  env      torch, the device, bfloat16 and FP8 support; trl, ray and vllm present or not
  imports  every minirl module but the Ray controller imports (without trl, ray, vllm)
  warm     the embedded policy built (or loaded from the cache) locally: no hub
  timer    StageTimer waits for the GPU: its seconds cover the CUDA events' (synchronized timers)
  stage1   chapter 01 on the device as TRL trains there: float32 weights, bf16 autocast, a bfloat16
           rollout copy (--dtype auto, --mixed-precision auto): reward,
           held-out accuracy before and after (fails if it halves, or a reward is not finite), median
           step time, the dtypes it recorded and saved
  engine   the paged engine's greedy tokens equal HF generate's on the device (float32; bfloat16
           up to bfloat16 ties)
  fsdp2    chapter 04 under torchrun --nproc_per_node 1 with --backend nccl, FSDP2 (--zero 3), 2 steps, as
           TRL trains there (--mixed-precision auto): FSDP2's MixedPrecisionPolicy, bf16 products on
           float32 shards, float32 gradient reduction; the recorded precision and saved dtype
           (chapter 06 is not run here, it needs Ray: its workers run each call under the same
           bf16 autocast on float32 weights, tests/test_dtypes.py)
  mismatch chapter 02's precision sweep on the device's kernels: float32, bfloat16, float16, and
           float8_e4m3fn (minirl's simulated FP8: weights rounded to FP8, computed in bfloat16) when
           the GPU has FP8 tensor cores (compute capability 8.9 or more)
  mfu      chapter 09 on the stage-1 run: trainer and rollout MFU against the GPU's datasheet peak
  vllm     (only with --vllm, and vLLM installed) the tests marked vllm or gpu in tests/test_vllm.py

A check fails on a nonzero exit, a missing figure, or a relation that must hold (named in its
row); the command exits 1 when any check failed, 0 otherwise. --cpu runs every check on the
CPU with small sizes, gloo instead of NCCL, and trl, ray and vllm hidden (tests/gpu/absent),
so that CI proves the script works; it says nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT_DIR = Path(__file__).resolve().parent / "absent"
CHECKS = ("env", "imports", "warm", "timer", "stage1", "engine", "fsdp2", "mismatch", "mfu", "vllm")

# sizes: (GPU, CPU rehearsal)
SIZES = {"stage1_steps": (40, 3), "stage1_prompts": (16, 4), "engine_prompts": (24, 4), "mismatch_prompts": (64, 8),
         "fsdp2_steps": (2, 1)}
TIMEOUTS = {"imports": 300, "warm": 900, "timer": 120, "stage1": 600, "engine": 300, "fsdp2": 600,
            "mismatch": 400, "mfu": 300, "vllm": 1500}


class Checker:
    """Runs the checks, keeps a row per check, prints the table."""

    def __init__(self, args):
        self.args, self.rows = args, []
        self.cpu = args.cpu
        self.device = "cpu" if self.cpu else "cuda"
        self.out = Path(args.out).resolve()
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            ([str(ABSENT_DIR)] if self.cpu else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            HF_HUB_OFFLINE="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false")
        self.info = {}

    def size(self, name):
        return SIZES[name][1 if self.cpu else 0]

    def run(self, name, argv, timeout=None):
        """(returncode, stdout, stderr) of a Python subprocess in the repository root."""
        try:
            proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=self.env, capture_output=True,
                                  text=True, timeout=timeout or TIMEOUTS.get(name, 600))
        except subprocess.TimeoutExpired as err:
            return 124, err.stdout or "", f"timed out after {err.timeout:.0f} s"
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "logs" / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        return proc.returncode, proc.stdout, proc.stderr

    def record(self, name, status, figures, started):
        self.rows.append({"check": name, "result": status, "figures": figures,
                          "seconds": round(time.perf_counter() - started, 1)})
        print(f"[{status:>4}] {name}: {figures}", flush=True)

    def failed(self, rc, err):
        last = [line for line in err.strip().splitlines() if line.strip()]
        return f"exit {rc}: {last[-1][:300] if last else 'no output'} (log: {self.out / 'logs'})"

    def summary(self, path):
        return json.loads(Path(path).read_text())

    # ------------------------------------------------------------------ the checks

    def check_env(self):
        import torch

        code = ("import importlib.util, json; print(json.dumps([m for m in ('trl', 'ray', 'vllm') "
                "if importlib.util.find_spec(m) is not None]))")
        rc, out, err = self.run("env", ["-c", code])
        if rc:
            return "FAIL", self.failed(rc, err)
        seen = json.loads(out.strip().splitlines()[-1])        # as the checks' processes see them
        extras = ", ".join(f"{m} {'present' if m in seen else 'absent'}" for m in ("trl", "ray", "vllm"))
        if self.cpu:
            ok = not seen
            return ("ok" if ok else "FAIL"), (f"torch {torch.__version__}, CPU rehearsal; {extras}"
                                              + ("" if ok else ": tests/gpu/absent did not hide them"))
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        self.info.update(gpu=name, capability=(major, minor), fp8=(major, minor) >= (8, 9))
        return "ok", (f"{name}, sm {major}.{minor}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} "
                      f"GiB, torch {torch.__version__} (CUDA {torch.version.cuda}), bf16 "
                      f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}, FP8 tensor cores "
                      f"{'yes' if self.info['fp8'] else 'no'}; {extras}")

    def probe(self, name, *extra):
        rc, out, err = self.run(name, ["tests/gpu/probes.py", name, "--device", self.device, *extra])
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            return None, self.failed(rc, err)
        return json.loads(lines[-1]) | {"rc": rc}, None

    def check_imports(self):
        result, error = self.probe("imports")
        if error:
            return "FAIL", error
        if not result["ok"]:
            return "FAIL", "; ".join(result["failed"][:3])
        return "ok", f"{result['modules']} modules (all but minirl.controller, the Ray producers)"

    def check_warm(self):
        rc, out, err = self.run("warm", ["chapters/00_warm_start.py", "--device", self.device, "--out",
                                         self.out / "00", "--no-progress"])
        if rc:
            return "FAIL", self.failed(rc, err)
        s = self.summary(self.out / "00" / "summary.json")
        how = f"built in {s['build_seconds']:.0f} s" if s["built"] else "from the cache"
        return "ok", f"embedded policy {how}; held-out greedy accuracy {s['heldout_accuracy']:.3f} on {self.device}"

    def check_timer(self):
        result, error = self.probe("timer")
        if error:
            return "FAIL", error
        if self.cpu:
            return ("ok" if result["ok"] else "FAIL"), f"{result['timer_s']:.3f} s; {result['note']}"
        text = (f"timer {result['timer_s'] * 1e3:.1f} ms vs CUDA events {result['cuda_events_s'] * 1e3:.1f} ms "
                f"(unsynchronized: {result['unsynchronized_s'] * 1e3:.2f} ms)")
        return ("ok" if result["ok"] else "FAIL"), text

    def check_stage1(self):
        steps, prompts = self.size("stage1_steps"), self.size("stage1_prompts")
        out = self.out / "01"
        rc, _, err = self.run("stage1", ["chapters/01_single_process.py", "--device", self.device, "--out", out,
                                         "--overwrite", "--steps", steps, "--prompts-per-step", prompts,
                                         "--eval-every", steps, "--checkpoint-every", 0, "--no-progress"])
        if rc:
            return "FAIL", self.failed(rc, err)
        s = self.summary(out / "summary.json")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        times = [m["time/step"] for m in metrics if "time/step" in m][1:] or [float("nan")]   # step 1 warms up
        want = ("float32", "float32" if self.cpu else "bfloat16", "float32", "no" if self.cpu else "bf16")
        saved = json.loads((out / "final" / "config.json").read_text())
        saved_dtype = str(saved.get("dtype") or saved.get("torch_dtype"))
        text = (f"{steps} steps, dtype {s['dtype']}/rollout {s['rollout_dtype']}/mixed {s['mixed_precision']}, "
                f"held-out accuracy "
                f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}, reward (last 20 steps) "
                f"{s['final_reward']:.3f}, median step {statistics.median(times) * 1e3:.0f} ms")
        problems = []
        if (s["dtype"], s["rollout_dtype"], saved_dtype, s["mixed_precision"]) != want:
            problems.append(f"dtypes {s['dtype']}, {s['rollout_dtype']}, saved {saved_dtype}, mixed "
                            f"{s['mixed_precision']}: want {', '.join(want)}")
        if not all(math.isfinite(m["reward"]) for m in metrics if "reward" in m):
            problems.append("a reward is not finite")
        if not self.cpu and s["accuracy_after"] < 0.5 * s["accuracy_before"]:
            problems.append("held-out accuracy halved: the mixed-precision update diverged")
        return ("FAIL" if problems else "ok"), text + ("; " + "; ".join(problems) if problems else "")

    def check_engine(self):
        result, error = self.probe("engine", "--prompts", self.size("engine_prompts"))
        if error:
            return "FAIL", error
        parts = [f"{d}: {result[d]['equal_rows']}/{result['prompts']} rows equal, {result[d]['tie_rows']} part at a "
                 f"tie (< {result[d]['tie_threshold']:g}), {len(result[d]['wrong_rows'])} otherwise"
                 for d in ("float32", "bfloat16")]
        return ("ok" if result["ok"] else "FAIL"), "; ".join(parts)

    def check_fsdp2(self):
        backend = "gloo" if self.cpu else "nccl"
        out = self.out / "04"
        steps = self.size("fsdp2_steps")
        argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 1, "chapters/04_fsdp_lora.py",
                "--device", self.device, "--backend", backend, "--zero", 3, "--out", out, "--overwrite",
                "--steps", steps, "--prompts-per-step", 4, "--eval-every", 0, "--checkpoint-every", 0,
                "--no-progress"]
        rc, _, err = self.run("fsdp2", argv)
        if rc:
            return "FAIL", self.failed(rc, err)
        s = self.summary(out / "summary.json")
        peak = s.get("peak_bytes") or [0]
        saved = json.loads((out / "final" / "config.json").read_text())
        precision = (s.get("mixed_precision"), str(saved.get("dtype") or saved.get("torch_dtype")))
        want = ("no" if self.cpu else "bf16", "float32")
        text = (f"{backend}, FSDP2 ZeRO-3, mixed {precision[0]}, saved {precision[1]}: {s['steps']} steps, sync "
                f"{s.get('sync_bytes', 0) / 2**20:.1f} MiB, peak {max(peak) / 2**20:.0f} MiB per rank")
        ok = s["steps"] == steps and s.get("sync_bytes", 0) > 0 and precision == want
        return ("ok" if ok else "FAIL"), text + ("" if ok else f"; want the steps run, bytes synchronized, "
                                                             f"mixed {want[0]} and saved {want[1]}")

    def check_mismatch(self):
        sweep = ["float32", "bfloat16", "float16"]
        if self.cpu or self.info.get("fp8"):
            sweep.append("float8_e4m3fn")
        out = self.out / "02"
        rc, _, err = self.run("mismatch", ["chapters/02_mismatch.py", "--device", self.device, "--out", out,
                                           "--sweep", ",".join(sweep), "--num-prompts", self.size("mismatch_prompts")])
        if rc:
            return "FAIL", self.failed(rc, err)
        per = self.summary(out / "summary.json")["per_rollout_dtype"]
        mean = {d: per[d]["mean_abs_delta"] for d in sweep}
        text = "mean |dlogp| " + ", ".join(f"{d} {v:.1e}" for d, v in mean.items())
        if "float8_e4m3fn" not in sweep:
            text += " (no FP8 tensor cores: float8_e4m3fn skipped)"
        ok = all(math.isfinite(v) for v in mean.values()) and mean["float32"] < min(mean["bfloat16"], mean["float16"])
        return ("ok" if ok else "FAIL"), text + ("" if ok else "; want float32 below bfloat16 and float16")

    def check_mfu(self):
        run = self.out / "01"
        if not (run / "metrics.jsonl").is_file():
            return "skip", "no stage-1 run to analyse (the stage1 check did not run)"
        rc, _, err = self.run("mfu", ["chapters/09_profile.py", "--run", run, "--out", self.out / "09"])
        if rc:
            return "FAIL", self.failed(rc, err)
        s = self.summary(self.out / "09" / "summary.json")
        mfu, source = s["mfu"], s["mfu"].get("peak_source", {})
        values = [mfu.get("trainer"), mfu.get("rollout")]
        text = (f"trainer {values[0] if values[0] is None else f'{values[0]:.2%}'}, rollout "
                f"{values[1] if values[1] is None else f'{values[1]:.2%}'}; peak: {source.get('trainer')}")
        ok = all(v is not None and 0 < v <= 1 for v in values) and (self.cpu or "datasheet" in str(source))
        return ("ok" if ok else "FAIL"), text + ("" if ok else "; want both in (0, 1] against a datasheet peak")

    def check_vllm(self):
        import importlib.util

        if not self.args.vllm:
            return "skip", "not asked (--vllm runs tests/test_vllm.py -m 'vllm or gpu', several minutes)"
        if self.cpu or importlib.util.find_spec("vllm") is None:
            return "skip", "vLLM is not installed here (pip install -r requirements-gpu.txt)"
        rc, out, err = self.run("vllm", ["-m", "pytest", "tests/test_vllm.py", "-m", "vllm or gpu", "-q"])
        last = (out.strip().splitlines() or [""])[-1]
        return ("ok" if rc == 0 else "FAIL"), last

    def run_all(self, only) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in CHECKS:
            if only and name not in only:
                continue
            started = time.perf_counter()
            try:
                status, figures = getattr(self, f"check_{name}")()
            except Exception as err:                     # a check's own bug or a missing figure: a failed row
                status, figures = "FAIL", f"{type(err).__name__}: {err}"
            self.record(name, status, figures, started)
        self.table()
        (self.out / "summary.json").write_text(json.dumps({"device": self.device, "rows": self.rows}, indent=2))
        return 1 if any(r["result"] == "FAIL" for r in self.rows) else 0

    def table(self):
        width = max(len(name) for name in CHECKS)
        print(f"\ntests/gpu/run.sh{' --cpu' if self.cpu else ''}: {self.info.get('gpu', self.device)}")
        print(f"{'check':<{width}} | result | seconds | figures")
        for r in self.rows:
            print(f"{r['check']:<{width}} | {r['result']:<6} | {r['seconds']:>7.1f} | {r['figures']}")
        failed = [r["check"] for r in self.rows if r["result"] == "FAIL"]
        total = sum(r["seconds"] for r in self.rows)
        print(f"{len(self.rows) - len(failed)} of {len(self.rows)} checks passed or skipped in {total:.0f} s"
              + (f"; FAILED: {', '.join(failed)}" if failed else "") + f"; logs and summary.json in {self.out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tests/gpu/run.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cpu", action="store_true", help="the CPU rehearsal: every check, small, on the CPU")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="logs, runs, summary.json")
    parser.add_argument("--only", default="", help=f"comma-separated checks among {', '.join(CHECKS)}")
    parser.add_argument("--vllm", action="store_true", help="also run the tests marked vllm or gpu (vLLM installed)")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        parser.error(f"argument --only: {', '.join(unknown)}: not a check; the checks are {', '.join(CHECKS)}")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("this machine has no CUDA device (torch.cuda.is_available() is False): run "
                         "tests/gpu/run.sh --cpu for the CPU rehearsal")
    return Checker(args).run_all(only)


if __name__ == "__main__":
    sys.exit(main())
