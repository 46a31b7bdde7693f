# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""torch.profiler around chosen steps of a run, as a run callback (notebook 09, section 2).

Under `run_dir/profile/`, each profiled step's Chrome trace (`trace_step-000003.json.gz`),
its operator table (`ops_step-000003.txt`) and its entry of `summary.json`, written by
`minirl.runtime.profile_tables`. `minirl.profiling.decompose` leaves profiled steps out.
"""

__all__ = ["TorchProfiler"]

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minirl.runtime.io import atomic_write_json
from minirl.runtime.profile_tables import write_step_profile
from minirl.train.run import Callback


class TorchProfiler(Callback):
    """Profile the given steps (1-based) of a run into run_dir/profile/."""

    def __init__(self, run_dir, steps, *, with_stack: bool = True, profile_memory: bool = True,
                 record_shapes: bool = True, top: int = 15):
        steps = sorted({int(s) for s in steps})
        if not steps or steps[0] < 1:
            raise ValueError(f"TorchProfiler(steps={steps}): give step numbers >= 1 "
                             "(step 1 is the first step)")
        self.dir, self.steps, self.top = Path(run_dir) / "profile", steps, top
        self.options = dict(with_stack=with_stack, profile_memory=profile_memory,
                            record_shapes=record_shapes, with_flops=True)
        self.profiler, self.results = None, {}

    def on_start(self, state):
        late = [s for s in self.steps if s <= state.step or s > state.config.run.steps]
        if late:
            raise ValueError(f"TorchProfiler(steps={self.steps}): step(s) {late} will not run "
                             f"(this run goes from step {state.step + 1} to "
                             f"{state.config.run.steps}); choose steps in that range")
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.dir.glob("trace_step-*"), *self.dir.glob("ops_step-*"),
                    self.dir / "summary.json"]:
            old.unlink(missing_ok=True)     # an earlier run's profile: this directory is this run's
        self._start_if_profiled(state.step + 1)

    def _start_if_profiled(self, step: int) -> None:
        if step not in self.steps:
            return
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self.profiler = profile(activities=activities, **self.options)
        self.clocks = (time.perf_counter(), time.process_time())
        self.profiler.start()

    def on_step(self, state, record):
        if self.profiler is not None:
            self._finish(state.step, record)
        self._start_if_profiled(state.step + 1)

    def on_end(self, state):
        if self.profiler is not None:    # stopped inside a profiled step: no partial trace
            self.profiler.stop()
            self.profiler = None

    def _finish(self, step: int, record: dict) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.stop()
        prof, self.profiler = self.profiler, None
        self.results[str(step)] = write_step_profile(prof, self.dir, step, record, self.clocks,
                                                     self.top)
        atomic_write_json(self.dir / "summary.json", {"steps": sorted(int(s) for s in self.results),
                                                       "per_step": self.results})
