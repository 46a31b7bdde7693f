"""Around stage 6's Driver: stage 1's run (run directory, resume, callbacks), a dead worker that stops it,
and the Driver's lifecycle (what its workers report, the teardown).

Hand-written (it teaches nothing new: notebook 06 teaches the Driver's set-up and its step, which
is stage 1's `stage1_step` on role proxies). The pieces the Driver uses:

- `train_on_driver(driver, rows, ...)` is stage 1's `train` on the Driver's workers: the rows
  and prompts checked as stage 1's `train` checks them, a `RunState` of the Driver's proxies,
  engine, sync and reward functions, and stage 1's `run_in_dir` with the Driver's step (run.json,
  metrics.jsonl, checkpoints/, final/, resume from the newest intact checkpoint, evaluation,
  the progress bar). The driver's copy of the policy holds the final weights after it.
- `stop_if_a_worker_died(groups, state)` wraps one step: a worker that died during it stops the
  run with a `WorkerDiedError` naming the worker and the step, also when the step wrapped the
  failure in another error (a reward function's) or absorbed it (`reward_errors="zero"` scores
  a failed reward 0 and goes on).
- `DriverLifecycle`, a base of the Driver: `where()` (role -> "node<i>/<device><j>" for each
  rank, from the workers' own report: `devices_of`), `timeline()` (every worker's recorded
  calls), and `shutdown()`: every worker stopped and every reservation released, safe to call
  twice (the constructor calls it when the set-up fails halfway; a `with` block at its end).
"""

from contextlib import contextmanager

import torch

from minirl.runtime.callbacks import run_in_dir
from minirl.runtime.model_loading import check_prompts
from minirl.runtime.ray_calls import WorkerDiedError
from minirl.runtime.reservations import release
from minirl.train.run import RunState


def raise_if_dead(groups, state, cause: BaseException | None = None) -> None:
    """WorkerDiedError naming the first dead worker of `groups` (WorkerGroups) and step state.step + 1."""
    for group in groups:
        if group.dead is not None:
            what = group.death.what if group.death is not None else f"{group.describe(group.dead)} died"
            raise WorkerDiedError(f"{what}, in step {state.step + 1}") from cause


@contextmanager
def stop_if_a_worker_died(groups, state):
    """Around one step: if a worker of `groups` died during it, WorkerDiedError (from the step's error, if any)."""
    groups = list(groups)
    try:
        yield
    except Exception as err:
        raise_if_dead(groups, state, err)
        raise
    raise_if_dead(groups, state)


def train_on_driver(driver, rows: list[dict], *, eval_fn=None, out_dir=None, resume: bool = False,
                    overwrite: bool = False, progress: bool = True, stop_after: int | None = None,
                    extra_callbacks: tuple = (), run_info: dict | None = None) -> list[dict]:
    """Stage 1's `train` on `driver`'s workers: config.run.steps steps of `driver.step`; one record per step.

    eval_fn(model) -> accuracy 0..1 runs on the driver's copy of the policy; out_dir: run.json,
    metrics.jsonl, checkpoints/ and final/ there, as in stage 1 (resume=True continues the
    run from its newest intact checkpoint). The driver's model holds the final weights after.
    """
    config = driver.config
    if not rows or "prompt" not in rows[0]:
        raise ValueError("rows: pass dataset rows like {'prompt': '27+35=', 'answer': 62}")
    check_prompts(driver.tokenizer, [r["prompt"] for r in rows], getattr(driver.model.config,
                  "max_position_embeddings", None), config.sampling.max_completion_length)   # as stage 1's train
    state = RunState(config, driver.roles, driver.engine, driver.sync, torch.Generator().manual_seed(config.run.seed),
                     list(rows), driver.reward_funcs, driver.reward_weights)
    info = {"placement": driver.placement.name, **(run_info or {})}
    records = run_in_dir(state, driver.step, driver.tokenizer, out_dir=out_dir, resume=resume, overwrite=overwrite,
                         eval_fn=eval_fn, progress=progress, label=driver.placement.name,
                         extra_callbacks=extra_callbacks, stop_after=stop_after, run_info=info,
                         autocast=False)                      # the workers autocast each call, as stage 1's step
    driver.roles.actor.model                                           # noqa: B018 -- refresh the driver's copy
    return records


def devices_of(groups) -> dict[str, list[str]]:
    """role -> "node<i>/<device><j>" for each rank of `groups` (WorkerGroups), from each worker's `where()`.

    CPU slots are numbered per node in the order the groups list them; roles on one worker share its
    device (what `minirl.runtime.cluster_plots.plot_placement` draws).
    """
    groups, slots, devices = list(groups), {}, {}
    for group in groups:
        for rank, info in enumerate(group.run("where", [()] * len(group))):
            node = group.node_of[rank]
            if info["device"] == "cpu":
                slots[node] = slots.get(node, -1) + 1
                devices[group.name, rank] = f"node{node}/cpu{slots[node]}"
            else:
                devices[group.name, rank] = f"node{node}/{info['device']}"
    return {role: [devices[group.name, rank] for rank in range(len(group))]
            for group in groups for role in group.roles}


class DriverLifecycle:
    """A Driver's report and teardown, over its `groups` ({pool: WorkerGroup}) and `_reserved` placement groups."""

    def where(self) -> dict[str, list[str]]:
        """role -> "node<i>/<device><j>" for each of its ranks (roles on one worker share a device)."""
        return devices_of(self.groups.values())

    def timeline(self) -> dict[str, list[tuple[str, float, float]]]:
        """"<pool>[rank]" -> the (what, start, end) calls that worker ran, wall-clock seconds."""
        return {f"{group.name}[{rank}]": events for group in self.groups.values()
                for rank, events in enumerate(group.run("timeline", [()] * len(group)))}

    def shutdown(self) -> None:
        """Stop every worker and release every reservation (safe to call twice)."""
        for group in getattr(self, "groups", {}).values():
            group.shutdown()
        release(getattr(self, "_reserved", []))
        self.groups, self._reserved = {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
