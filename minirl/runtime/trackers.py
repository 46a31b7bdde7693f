"""Experiment trackers for the training chapters: `--report-to none|tensorboard|trackio|wandb`, TRL's names.

Hand-written (it teaches nothing). Every run writes `metrics.jsonl` already; a tracker gets the same
records as they are logged, under the names TRL's GRPOTrainer logs (`train/reward`,
`train/rewards/<name>/mean`, `train/completions/mean_length`, `train/kl`, ...; the held-out accuracy
as `eval/accuracy`), at the run's step, so a curve from minirl and one from TRL sit in one dashboard.

- tensorboard: event files in `OUT/tensorboard/` (torch.utils.tensorboard, the `tensorboard`
  package of requirements.txt); `tensorboard --logdir OUT/tensorboard` shows them.
- trackio, wandb: their local modes (trackio's local dashboard; wandb with WANDB_MODE=offline unless
  set), when the package is installed; otherwise the flag is refused in one line naming the install.
Only rank 0 (chapter 04) or the driver (chapter 06) reports.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from pathlib import Path

REPORT_TO = ("none", "tensorboard", "trackio", "wandb")
TRL_METRIC_NAMES = {"completion_length": "completions/mean_length", "completion_length_max": "completions/max_length",
           "ratio_mean": "importance_sampling_ratio/mean", "time/step": "step_time"}
EVAL = ("accuracy", "eval_reward")
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def add_report_flag(parser) -> None:
    parser.add_argument("--report-to", choices=REPORT_TO, default="none",
                        help="also log the metrics to a tracker, under TRL's names (default: %(default)s; "
                             "metrics.jsonl is always written)")


def check_report_to(parser, args) -> None:
    """A parser error (one line) when the tracker's package is not installed."""
    name = getattr(args, "report_to", "none")
    if name != "none" and importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
        parser.error(f"argument --report-to: {name!r}: the {TRACKER_PACKAGES[name]} package is not installed; "
                     f"pip install {TRACKER_PACKAGES[name]}, or use --report-to tensorboard")


def trl_name(key: str) -> str:
    """TRL's name of one of minirl's record keys: rewards/f -> rewards/f/mean, completion_length -> ..."""
    if key.startswith("rewards/") and key.count("/") == 1:
        return f"{key}/mean"
    return TRL_METRIC_NAMES.get(key, key)


def scalars(record: dict) -> dict[str, float]:
    """{tracker name: value} of a record's numbers: train/<TRL name>, and eval/<name> for the evaluation's."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        prefix = "eval" if key in EVAL or key.startswith("eval/") else "train"
        out[f"{prefix}/{trl_name(key.removeprefix('eval/'))}"] = float(value)
    return out


class Tracker:
    """A run callback: each logged record goes to the tracker at its step; closed at the end (also on a stop)."""

    def __init__(self, name: str, out: Path, run_name: str, config: dict | None = None):
        self.name, self.out, self.run_name, self.config = name, Path(out), run_name, config or {}
        self.writer = self.run = None

    def on_start(self, state) -> None:
        if self.name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

            self.writer = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        elif self.name == "trackio":
            import trackio  # noqa: PLC0415

            self.run = trackio.init(project="minirl", name=self.run_name, config=self.config)
        elif self.name == "wandb":
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb  # noqa: PLC0415

            self.run = wandb.init(project="minirl", name=self.run_name, dir=str(self.out), config=self.config)

    def on_step(self, state, record: dict) -> None:
        values = scalars(record)
        step = int(record.get("step", getattr(state, "step", 0)))
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        elif self.run is not None:
            self.run.log(values, step=step)

    def on_end(self, state) -> None:
        if self.writer is not None:
            self.writer.close()
        elif self.run is not None:
            self.run.finish()


def tracker_callbacks(args, out, main: bool = True) -> list:
    """[Tracker] for --report-to (none: [], and [] on ranks other than the main one)."""
    name = getattr(args, "report_to", "none")
    if name == "none" or not main or out is None:
        return []
    return [Tracker(name, Path(out), Path(out).name)]
