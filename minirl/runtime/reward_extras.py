"""TRL's extra arguments to a reward function, in every training stage: completion_ids, trainer_state, log_metric,
log_extra.

Hand-written plumbing (what TRL's `GRPOTrainer._calculate_rewards` passes besides the columns; the steps
hand it on, it teaches no RL). TRL calls each reward function with
- `completion_ids`: each completion's token ids, up to and including its first EOS, without padding
  (`completion_ids(rollout)`: the rollout's completion mask);
- `trainer_state`: a `transformers.TrainerState` whose `global_step` is the optimizer steps done when the
  batch is scored (0 in the first step), `max_steps` the run's steps, `epoch` the passes over the dataset
  so far (`TrainerClock.state`; `trainer_state(run_state)` for a `minirl.train.run.RunState`);
- `log_metric(name, value)`: a scalar for the step's record under `name`, averaged over the values logged
  during the step (TRL: `_pending_metrics`, summed and counted over the processes);
- `log_extra(column, values)`: a column of the completions table, one value per completion.
`RewardLog` keeps what the functions log; `RewardExtras(rollout, trainer_state)` is the dict of the four
for `minirl.runtime.inputs.checked_rewards(..., **extras)` (notebook 01's `score`), and its `metrics()`
what goes into the record: each name's mean and `log_metric_counts` ({name: values averaged}, which
stage 4's `rank_records` needs to average over the ranks as TRL does). The `log_extra` columns are kept
in `RewardLog.columns` (minirl has no completions table in the record: they are accepted, not logged).

Stage 4: each rank logs its own; `rank_records` (runtime/spmd_support.py) averages over all ranks' values.
Stage 6 (`remote_rows`, `worker_rewards`, `joined_rewards`): the driver's `RemoteReward` sends each reward
worker its rows' columns and completion_ids and the trainer state; the worker calls the function as TRL
does (an `async def` awaited there) with a log of its own, and the driver hands what each part logged
to its own `log_metric` / `log_extra`, in row order. Stage 7 (`session_extras`): each environment
session scores one completion with its own ids and log; `join_dumps` joins a group's logs in session
order into its Trajectory, and the trainer averages its batch's (`runtime/async_bookkeeping.batch_health`).
"""

import inspect
import math
import threading
from dataclasses import dataclass

from transformers import TrainerState  # imported here, not in a step: a step's timer never holds it

from minirl.tasks.rewards import TRL_EXTRAS, invoke_reward

LOCAL = ("log_metric", "log_extra")               # extras that call back into the caller's process


def completion_ids(rollout) -> list[list[int]] | None:
    """Each row's completion token ids, up to and including its first EOS, without padding (TRL's); None for a
    batch of text only (no `completion_ids` tensor: then the functions get none)."""
    if getattr(rollout, "completion_ids", None) is None:
        return None
    mask = rollout.completion_mask.bool().cpu()                                    # [N, C]
    return [ids[m].tolist() for ids, m in zip(rollout.completion_ids.cpu(), mask, strict=True)]


@dataclass(frozen=True)
class TrainerClock:
    """What a TrainerState needs besides the step: the run's length and batch (picklable: Ray producers)."""

    max_steps: int
    prompts_per_step: int
    num_generations: int
    num_rows: int
    eval_steps: int = 0
    save_steps: int = 0

    @classmethod
    def of(cls, config, num_rows: int) -> "TrainerClock":
        """The clock of a run with this RLConfig on a dataset of num_rows rows."""
        run = config.run
        return cls(run.steps, run.prompts_per_step, config.sampling.num_generations, num_rows, run.eval_every,
                   run.checkpoint_every)

    def state(self, global_step: int, rank: int = 0, world_size: int = 1):
        """A transformers.TrainerState as TRL's trainer holds it while it scores the batch of step global_step + 1.

        epoch: dataset passes so far (prompts drawn / rows); num_train_epochs: the passes max_steps make;
        train_batch_size: this process's completions per step; logging_steps 1 (every step is recorded).
        """
        per_epoch = max(1, self.num_rows) / max(1, self.prompts_per_step)          # steps in one pass
        return TrainerState(epoch=global_step / per_epoch, global_step=global_step, max_steps=self.max_steps,
                            num_train_epochs=math.ceil(self.max_steps / per_epoch), logging_steps=1,
                            eval_steps=self.eval_steps, save_steps=self.save_steps,
                            train_batch_size=self.prompts_per_step * self.num_generations // max(1, world_size),
                            is_local_process_zero=rank == 0, is_world_process_zero=rank == 0)


def trainer_state(state):
    """The TrainerState of a RunState (stage 1, 4, 6) before its next step: global_step = its steps done."""
    group = getattr(state, "group", None)                                  # stage 4's ranks
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    return TrainerClock.of(state.config, len(state.rows)).state(state.step, rank, world)


class RewardLog:
    """What reward functions log during one step: log_metric's values by name, log_extra's columns (thread-safe)."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}
        self._lock = threading.Lock()

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: one scalar for the step's record under `name` (averaged with the step's others)."""
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a number") from None
        with self._lock:
            self.values.setdefault(str(name), []).append(value)

    def log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra`: a column of the completions table, one value per completion of the call."""
        with self._lock:
            self.columns.setdefault(str(column), []).extend(list(values))

    def dump(self) -> dict:
        """What was logged, as plain lists (to ship between processes)."""
        with self._lock:
            return {"values": {k: list(v) for k, v in self.values.items()},
                    "columns": {k: list(v) for k, v in self.columns.items()}}

    def metrics(self) -> dict:
        """The record's entries: each logged name's mean, and `log_metric_counts` ({name: values}); {} if none."""
        return logged_metrics(self.dump())


def logged_metrics(dump: dict) -> dict:
    """A dump's record entries: each name's mean over its values, and `log_metric_counts`; {} if nothing was logged."""
    values = {name: v for name, v in dump["values"].items() if v}
    if not values:
        return {}
    return {name: sum(v) / len(v) for name, v in values.items()} | {"log_metric_counts": {n: len(v) for n, v in
                                                                                          values.items()}}


def join_dumps(dumps: list[dict], rows: list[int]) -> dict:
    """Dumps of consecutive parts (rows[i] completions each) as one: values concatenated by name, columns by
    part in order, a part that lacks a column filled with its rows' Nones (as TRL fills a process's)."""
    names = dict.fromkeys(n for d in dumps for n in d["values"])
    columns = dict.fromkeys(c for d in dumps for c in d["columns"])
    return {"values": {n: [x for d in dumps for x in d["values"].get(n, [])] for n in names},
            "columns": {c: [x for d, r in zip(dumps, rows, strict=True) for x in d["columns"].get(c, [None] * r)]
                        for c in columns}}


def hand_on(dump: dict, log_metric=None, log_extra=None) -> None:
    """Every value of a dump handed to log_metric and every column to log_extra (a None callable: dropped)."""
    for name, values in dump["values"].items():
        for value in values if log_metric is not None else ():
            log_metric(name, value)
    for column, values in dump["columns"].items() if log_extra is not None else ():
        log_extra(column, values)


class RewardExtras(dict):
    """TRL's four extras for one batch, a dict for `checked_rewards(..., **extras)`; `log` keeps what was logged.

    rollout: the batch (its completion_ids); trainer_state: a TrainerState, or None (not passed)."""

    def __init__(self, rollout, trainer_state=None):
        self.log = RewardLog()
        super().__init__(completion_ids=completion_ids(rollout), trainer_state=trainer_state,
                         log_metric=self.log.log_metric, log_extra=self.log.log_extra)

    def metrics(self) -> dict:
        """What the functions logged with log_metric, for the step's record (`RewardLog.metrics`)."""
        return self.log.metrics()


# ---- stage 6: a reward function on reward workers -------------------------------------------------------------


def remote_rows(columns: dict, a: int, b: int) -> dict:
    """What reward worker gets for rows a..b-1: its rows of the columns and of completion_ids, the trainer state;
    not log_metric / log_extra (they call back into the driver: `joined_rewards` replays the worker's logs)."""
    return {k: v if k == "trainer_state" else v[a:b] for k, v in columns.items() if k not in LOCAL}


def worker_rewards(func, prompts: list, completions: list, columns: dict) -> tuple[list, dict]:
    """On a reward worker: (func's output as a list, what it logged), func called as TRL calls it
    (`minirl.tasks.rewards.invoke_reward`: an `async def` awaited here; checked by the driver)."""
    columns = dict(columns)
    extras = {k: columns.pop(k) for k in TRL_EXTRAS if k in columns}
    log = RewardLog()
    out = invoke_reward(func, prompts, completions, columns, **extras | {"log_metric": log.log_metric,
                                                                          "log_extra": log.log_extra})
    if out is not None and not isinstance(out, (str, bytes, dict)) and hasattr(out, "__len__"):
        out = list(out.tolist() if hasattr(out, "tolist") else out)
    return out, log.dump()


def joined_rewards(parts: list, columns: dict):
    """The driver's side: the workers' outputs in row order, and what each logged handed to the driver's
    log_metric and log_extra (the extras the step passed, in `columns`) in the same order."""
    outputs = [values for values, _ in parts]
    bad = next((v for v in outputs if not isinstance(v, list)), None)
    if bad is not None:
        return bad                                 # a wrong output: the driver's checks name it
    hand_on(join_dumps([dump for _, dump in parts], [len(v) for v in outputs]), columns.get("log_metric"),
            columns.get("log_extra"))
    return [x for values in outputs for x in values]


# ---- stage 7: one environment session per completion ----------------------------------------------------------


def takes_extras(make_env) -> bool:
    """Whether an environment factory takes `reward_extras` (stage 7's RewardEnv does)."""
    try:
        return "reward_extras" in inspect.signature(make_env).parameters
    except (TypeError, ValueError):
        return False


def session_extras(rollout, trainer_state) -> tuple[list[dict], list[RewardLog]]:
    """TRL's extras for each completion of a group, scored in a session of its own: its ids (a list of one),
    the trainer state, a log of its own; and the logs (`join_dumps` joins them in session order)."""
    logs = [RewardLog() for _ in range(len(rollout))]
    extras = [{"completion_ids": [ids], "trainer_state": trainer_state, "log_metric": log.log_metric,
               "log_extra": log.log_extra} for ids, log in zip(completion_ids(rollout), logs, strict=True)]
    return extras, logs
