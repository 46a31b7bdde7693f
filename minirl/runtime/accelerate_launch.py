"""`accelerate launch`, as TRL's users start a job: what chapters 01 and 04 take from it, and the one line that
refuses what cannot work.

Hand-written plumbing; no torch (the chapters call it while parsing their flags). accelerate has
two launchers that matter here:
- torchrun's (its run module), for `distributed_type: MULTI_GPU` (`--multi_gpu`, or
  `configs/accelerate_cpu_2.yaml` with `use_cpu: true` on CPUs): N processes with RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... set as torchrun sets them. Chapter 04 runs under it
  as under torchrun.
- its "simple launcher", on a machine without GPUs (or with `--cpu`) and no config: ONE process,
  with MASTER_ADDR and MASTER_PORT set when --num_processes > 1 but no RANK and no WORLD_SIZE
  (accelerate's multi-CPU mode leaves the other processes to mpirun and a hostfile). That
  process cannot join a group of N (neither its rank nor N is anywhere), so it is refused in one
  line that names the commands that work.

Both launchers set ACCELERATE_MIXED_PRECISION (`--mixed_precision`, "no" when not given): chapter
01's `--mixed-precision auto` takes bf16 or fp16 from it, as TRL's TrainingArguments read it when
neither bf16 nor fp16 is set; a typed `--mixed-precision` (or the --config file's) wins.
"""

from __future__ import annotations

import os
import time

CPU_CONFIG = "configs/accelerate_cpu_2.yaml"     # accelerate launch --config_file ... : 2 CPU ranks through torchrun
ONE_PROCESS = "chapter 01 runs one process; use chapter 04 for N ranks"


def under_accelerate() -> bool:
    """Whether `accelerate launch` started this process (either launcher sets ACCELERATE_MIXED_PRECISION)."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ


def orphan_problem() -> str | None:
    """Why this process cannot be a rank of its job (MASTER_ADDR set, RANK not: nobody told it its rank or the
    job's size), in one line with the commands that work; None when it is a rank, or a process on its own."""
    if "MASTER_ADDR" not in os.environ or "RANK" in os.environ:
        return None
    if under_accelerate():
        return ("accelerate launch started one process with no RANK or WORLD_SIZE (on CPUs without a config its "
                "launcher starts one and leaves the others to mpirun): start the ranks with accelerate launch "
                f"--config_file {CPU_CONFIG} (torchrun's launcher, 2 CPU ranks) or torchrun --nproc_per_node N, "
                "or run one process with accelerate launch --num_processes 1")
    return ("MASTER_ADDR is set but RANK is not: this process is no rank of a job; start the job with torchrun "
            "--nproc_per_node N, or unset MASTER_ADDR to run one process")


def several_processes() -> bool:
    """Whether this process is one of several (torchrun or accelerate launched N > 1, or an orphan of such a job)."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 or orphan_problem() is not None


def refuse_several_processes(parser) -> None:
    """Chapter 01 under a launcher of N > 1 processes: rank 0 says so in one line (exit status 2); the other ranks
    wait quiet until the launcher stops them (never the reverse, which would cut rank 0's line)."""
    if not several_processes():
        return
    if int(os.environ.get("RANK", 0)) != 0:
        time.sleep(30)
        raise SystemExit(2)
    parser.error(f"{ONE_PROCESS} (accelerate launch --config_file {CPU_CONFIG} chapters/04_fsdp_lora.py, or "
                 "torchrun --nproc_per_node N chapters/04_fsdp_lora.py); alone: accelerate launch --num_processes 1")


def accelerate_mixed_precision(parser, args) -> None:
    """`accelerate launch --mixed_precision bf16|fp16` into `args.mixed_precision` when it is left at auto (a typed
    flag or the --config file's value wins, as TRL's bf16/fp16 do); fp8 is refused in one line."""
    mode = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mode == "no" or getattr(args, "mixed_precision", None) != "auto":
        return
    if mode not in ("bf16", "fp16"):
        parser.error(f"accelerate launch --mixed_precision {mode}: chapter 01 autocasts to bf16 or fp16 (or not at "
                     "all); launch with --mixed_precision bf16, fp16 or no")
    args.mixed_precision = mode
