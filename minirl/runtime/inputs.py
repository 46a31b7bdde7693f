"""The checks of what a run is given: its dataset rows, its reward functions, and what they return.

Hand-written plumbing (a run must fail in its first second when it is misconfigured, naming
what is wrong; the checks teach no RL). `check_run_inputs` runs before anything is built:
rows with a "prompt" column, prompts the tokenizer can encode and the model can hold
(`minirl.models.policy.check_prompts`), at least one reward function. `checked_rewards` calls
one reward function as TRL's GRPOTrainer does (`minirl.tasks.rewards.call_reward`) and returns
one float per completion (NaN where it returned None: "does not apply"), or raises a RewardError
naming the function and the row: a wrong number of rewards, a non-numeric or non-finite one, an
exception. With reward_errors="zero" a sample whose reward fails scores 0 instead, and the
failure is appended to `errors` (the step counts them in its record).
`minirl.train.step.score` calls it for each function.

`run_inputs` resolves what `minirl.train.run.train` was given into what a run needs: the model and
tokenizer (both, or neither: the embedded warm-started policy), the training rows, the reward
functions and weights and the held-out evaluation (a `minirl.tasks.task.Task`'s, default the
embedded arithmetic task, each overridden by an explicit `dataset`, `reward_funcs` or `eval_fn`),
checked by `check_run_inputs` before anything is built.
"""

import math

import torch
from torch import Tensor

from minirl.runtime.model_loading import check_prompts
from minirl.tasks.rewards import RewardError, call_reward, reward_name


def check_run_inputs(config, model, tokenizer, rows: list[dict], reward_funcs) -> None:
    """ValueError naming the problem unless the rows, their prompts and the reward functions can make a run."""
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    if "prompt" not in rows[0]:
        raise ValueError(f"dataset rows need a 'prompt' column; got columns {sorted(rows[0])}")
    check_prompts(tokenizer, [r["prompt"] for r in rows], getattr(model.config, "max_position_embeddings", None),
                  config.sampling.max_completion_length)     # unknown characters, too long
    if not reward_funcs:
        raise ValueError("reward_funcs is empty: pass at least one f(prompts, completions, **columns)")


def run_inputs(config, model, tokenizer, task, dataset, reward_funcs, reward_weights, eval_fn, progress: bool):
    """(model, tokenizer, rows, reward_funcs, reward_weights, eval_fn) of a run (see the module docstring).

    eval_fn(model) -> 0..1 defaults to the task's held-out evaluation at the task's (else the sampling's)
    completion length; progress: show the policy's loading bar."""
    from minirl.models.policy import load_default_policy  # noqa: PLC0415 (light to import this module)
    from minirl.tasks.task import arithmetic_task  # noqa: PLC0415

    if (model is None) != (tokenizer is None):
        raise ValueError("train: pass both model and tokenizer, or neither (the embedded policy)")
    if model is None:
        model, tokenizer, _ = load_default_policy(device=config.run.device, progress=progress)
    task = task or arithmetic_task()
    rows = task.train if dataset is None else list(dataset)
    if reward_funcs is None:
        reward_funcs, reward_weights = task.reward_funcs, task.reward_weights
    check_run_inputs(config, model, tokenizer, rows, reward_funcs)     # at the door, naming what is wrong
    eval_fn = eval_fn or task.eval_fn(tokenizer, task.max_new_tokens or config.sampling.max_completion_length)
    return model, tokenizer, rows, reward_funcs, reward_weights, eval_fn


def checked_rewards(func, prompts: list[str], completions: list[str], columns: dict, reward_errors: str,
                    errors: list, **extras) -> Tensor:
    """func's rewards for the completions, [N] float32, checked (see the module docstring).

    Called as TRL calls it (`minirl.tasks.rewards.call_reward`: TRL's extras when given and taken, an
    `async def` awaited). None, where the function says it does not apply, is NaN here: left out of
    that reward's mean and of the weighted sum, as TRL does. A bad output or an exception is a
    RewardError naming the function and the row (reward_errors="raise"), or that sample scores 0
    and is counted in `errors` ("zero").
    """
    name = reward_name(func)
    try:
        values = call_reward(func, prompts, completions, columns, **extras)
    except Exception as err:
        if reward_errors == "raise":
            raise _named(err, func, prompts, completions, columns, extras) from err
        values = []
        for i in range(len(completions)):        # find the failing samples one by one
            try:
                values += call_reward(func, prompts[i:i + 1], completions[i:i + 1],
                                      {k: v[i:i + 1] for k, v in columns.items()}, **_row(extras, i))
            except Exception as one:
                errors.append(f"{name}[{i}]: {type(one).__name__}: {one}")
                values.append(0.0)
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def _named(err: Exception, func, prompts, completions, columns, extras) -> RewardError:
    """The error of a reward function that raised, naming its first failing row (found one sample at a time)."""
    if isinstance(err, RewardError):
        return err
    row = next((i for i in range(len(completions)) if _fails(func, prompts, completions, columns, extras, i)), None)
    where = "" if row is None else f" on row {row} (prompt {str(prompts[row])[:40]!r})"
    return RewardError(f"reward function {reward_name(func)} raised {type(err).__name__}: {err}{where}; fix it, "
                       "or pass --reward-errors zero (reward_errors='zero') to score failing samples 0")


def _fails(func, prompts, completions, columns, extras, i: int) -> bool:
    try:
        call_reward(func, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()},
                    **_row(extras, i))
    except Exception:
        return True
    return False


def _row(extras: dict, i: int) -> dict:
    """TRL's extras for sample i alone: its completion_ids (a list of one); the others as they are."""
    return {k: v[i:i + 1] if k == "completion_ids" and v is not None else v for k, v in extras.items()}
