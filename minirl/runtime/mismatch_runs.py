"""Notebook 02's training comparison, run as the chapter script: launch it, stream its progress, read it back.

Hand-written (a run harness). `chapter_training(root, smoke)` runs `chapters/02_mismatch.py` into
`runs/02_training` (or `runs/02_training_smoke`), replacing any earlier run (its summary may come
from another policy or another version of the code), shows the two runs' progress bars live, and
returns the summary's "training" block and each run's metrics (one dict per logged step).
"""

import codecs
import json
import subprocess
import sys
from pathlib import Path

SMOKE_ARGS = ["--train-steps", "1", "--num-prompts", "2", "--num-generations", "2", "--prompts-per-step", "4",
              "--eval-every", "0"]
FULL_ARGS = ["--train-steps", "60", "--eval-every", "20", "--num-prompts", "16"]
RUNS = ("no_correction", "tis")


def chapter_training(root: Path, smoke: bool = False) -> tuple[dict, dict[str, list[dict]]]:
    """(the summary's "training" block, {run name: its metrics.jsonl rows}) of a fresh chapter run.

    RuntimeError (with the script's name) when the chapter fails.
    """
    root = Path(root)
    out = root / "runs" / ("02_training_smoke" if smoke else "02_training")
    script = root / "chapters" / "02_mismatch.py"
    proc = subprocess.Popen([sys.executable, str(script), "--out", str(out), "--sweep", "float32",
                             *(SMOKE_ARGS if smoke else FULL_ARGS)],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    for chunk in iter(lambda: proc.stderr.read1(256), b""):   # the two runs' progress bars, live
        sys.stdout.write(decode(chunk))
    if proc.wait():
        raise RuntimeError(f"chapters/02_mismatch.py failed with code {proc.returncode} (output above)")
    training = json.loads((out / "summary.json").read_text())["training"]
    metrics = {name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
               for name in RUNS}
    return training, metrics
