"""Notebook 09's short runs of later stages, as subprocesses: chapter 04 under torchrun, 06 on Ray, 07 asynchronous.

Hand-written (a measurement harness). `run_stage(stage, out_dir)` runs the chapter script of
stage 4 (two ranks under torchrun, ZeRO-3, gradient checkpointing), 6 (a Ray driver, rollout
and trainer on separate workers) or 7 (producers fill a queue the trainer consumes) for a few
steps into `out_dir`, shows a bar of the steps its metrics.jsonl holds so far
(`minirl.runtime.progress.step_bar`), and raises with the end of the output when the run
fails. On a very busy machine Ray's own start-up can time out: stage 6 is tried up to three
times, 30 s apart. The scripts run the package as saved on disk: an exported cell edited in
the notebook's kernel does not reach them (the run directories they write are then read in
the kernel, with the kernel's code).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from minirl.runtime.launch import torchrun
from minirl.runtime.progress import step_bar

_ROOT = Path(__file__).resolve().parents[2]   # the repository
SCRIPTS = {4: "04_fsdp_lora.py", 6: "06_ray.py", 7: "07_async.py"}
LABELS = {4: "stage 4 (torchrun, 2 ranks)", 6: "stage 6 (Ray, disaggregated)", 7: "stage 7 (asynchronous)"}


def stage_args(stage: int, out_dir: Path, steps: int, prompts: int) -> list[str]:
    """The chapter script's flags for a short run of `stage` into out_dir."""
    args = ["--out", str(out_dir), "--steps", str(steps), "--prompts-per-step", str(prompts),
            "--checkpoint-every", "0", "--overwrite"]
    if stage in (4, 6):
        args += ["--eval-every", "0"]
    return args + {4: ["--zero", "3", "--no-progress", "--gradient-checkpointing"],
                   6: ["--placement", "disaggregated"], 7: []}[stage]


def run_stage(stage: int, out_dir, steps: int = 8, prompts: int = 8, timeout: float = 1200) -> Path:
    """Run chapter `stage`'s script (4, 6 or 7) for `steps` steps into out_dir; its directory. Raises on failure."""
    out_dir = Path(out_dir)
    script = _ROOT / "chapters" / SCRIPTS[stage]
    args = stage_args(stage, out_dir, steps, prompts)
    print(f"{LABELS[stage]}: chapters/{SCRIPTS[stage]} runs the package as saved on disk")
    for attempt in range(1, 4):
        with step_bar(out_dir / "metrics.jsonl", steps, LABELS[stage]):
            if stage == 4:
                job = torchrun(script, 2, args, timeout=timeout)
            else:
                env = dict(os.environ, PYTHONPATH=str(_ROOT)) | ({"RAY_ADDRESS": "local"} if stage == 6 else {})
                job = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                                     timeout=timeout, env=env, cwd=_ROOT)
        output = (job.stdout or "") + (job.stderr or "")
        if job.returncode == 0:
            return out_dir
        if stage != 6 or "starting a local Ray cluster" not in output or attempt == 3:
            raise RuntimeError(f"{LABELS[stage]} failed (exit {job.returncode}):\n{output[-3000:]}")
        print(f"stage 6: Ray did not start on this busy machine (try {attempt} of 3); trying again in 30 s")
        time.sleep(30)
    raise AssertionError("unreachable")
