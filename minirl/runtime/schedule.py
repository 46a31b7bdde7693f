"""The learning-rate schedule, as TRL has it (transformers' `get_scheduler`), for chapters 01, 04 and 07.

Hand-written (it teaches nothing about RL at scale). `--lr-scheduler-type` takes transformers'
names (`constant`, minirl's default; `linear`, TRL's; `cosine`; `constant_with_warmup`) and
`--warmup-steps` takes transformers 5's meaning: a number of steps, or a fraction of the run when
below 1 (TRL's older `warmup_ratio` in a --config file becomes that fraction).

Simplified: the schedule moves once per RL step (one generation batch), where TRL moves it once per
optimizer step; with num_iterations 1 and one optimizer step per batch, as minirl runs by default,
the two are the same. The factor is a function of the step alone (transformers' own lambda), so
a resumed run picks it up where it stopped: nothing is saved for it.
"""

from __future__ import annotations

LR_SCHEDULES = ("constant", "linear", "cosine", "constant_with_warmup")


def add_schedule_flags(parser) -> None:
    """--lr-scheduler-type and --warmup-steps, in a group of their own."""
    from minirl.runtime.argtypes import float_in  # noqa: PLC0415

    group = parser.add_argument_group("learning-rate schedule (transformers' get_scheduler, as TRL)")
    group.add_argument("--lr-scheduler-type", choices=LR_SCHEDULES, default="constant",
                       help="how the learning rate moves over --steps (TRL's default: linear) (default: %(default)s)")
    group.add_argument("--warmup-steps", type=float_in(low=0), default=0.0,
                       help="steps of linear warm-up from 0; below 1: that fraction of --steps (default: 0)")


class LRSchedule:
    """A run callback: before each step, every optimizer's learning rate is its configured one times the
    schedule's factor at that step (the actor's `learning_rate`, the critic's `value_learning_rate`)."""

    def __init__(self, name: str, warmup: float, total_steps: int):
        self.name, self.total = name, max(int(total_steps), 1)
        self.warmup = int(warmup * self.total) if 0 < warmup < 1 else int(warmup)
        self._factor = None

    def factor(self, step: int) -> float:
        """The schedule's multiplier of the learning rate at `step` (0-based)."""
        if self._factor is None:
            import torch  # noqa: PLC0415
            from transformers import get_scheduler  # noqa: PLC0415

            probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
            self._factor = get_scheduler(self.name, probe, num_warmup_steps=self.warmup,
                                         num_training_steps=self.total).lr_lambdas[0]
        return float(self._factor(step))

    def _apply(self, state) -> None:
        factor = self.factor(state.step)
        optimizer = state.config.optimizer
        for role, base in ((state.roles.actor, optimizer.learning_rate),
                           (state.roles.critic, optimizer.value_learning_rate)):
            for group in getattr(getattr(role, "optimizer", None), "param_groups", ()):
                group["lr"] = base * factor

    def on_start(self, state) -> None:
        self._apply(state)

    def on_step(self, state, record: dict) -> None:
        self._apply(state)                                  # for the next step

    def on_end(self, state) -> None:
        pass


def schedule_callbacks(args, steps: int) -> list:
    """[LRSchedule] unless the schedule is constant without warm-up (then [] : nothing to do)."""
    if args.lr_scheduler_type == "constant" and not args.warmup_steps:
        return []
    return [LRSchedule(args.lr_scheduler_type, args.warmup_steps, steps)]
