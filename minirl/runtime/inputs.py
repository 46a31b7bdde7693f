"""The checks of what a run is given: its dataset rows, its reward functions, and what they return.

Hand-written plumbing (a run must fail in its first second when it is misconfigured, naming
what is wrong; the checks teach no RL). `check_run_inputs` runs before anything is built:
rows with a "prompt" column, prompts the tokenizer can encode and the model can hold
(`minirl.models.policy.check_prompts`), at least one reward function. `checked_rewards` calls
one reward function with TRL's signature, f(prompts, completions, **columns), and returns one
finite float per completion, or raises an error naming the function: a wrong number of rewards,
a non-numeric or non-finite one. With reward_errors="zero" a sample whose reward fails scores 0
instead, and the failure is appended to `errors` (the step counts them in its record).
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

from minirl.models.policy import check_prompts
from minirl.tasks.rewards import reward_name


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


def _call_reward(func, prompts, completions, columns, reward_errors, errors: list) -> list[float]:
    try:
        return list(func(prompts=prompts, completions=completions, **columns))
    except Exception as err:
        if reward_errors == "raise":
            raise RuntimeError(f"reward function {reward_name(func)} raised {type(err).__name__}: {err}; "
                               "fix it, or pass reward_errors='zero' to score failing samples 0") from err
    values = []
    for i in range(len(completions)):            # find the failing samples one by one
        try:
            values.append(float(func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                                     **{k: v[i:i + 1] for k, v in columns.items()})[0]))
        except Exception as err:
            errors.append(f"{reward_name(func)}[{i}]: {type(err).__name__}: {err}")
            values.append(0.0)
    return values


def _as_float(value) -> float:
    """A reward as a float; NaN for anything that is not a number (None, a string, a list, ...)."""
    if isinstance(value, (str, bytes)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def checked_rewards(func, prompts: list[str], completions: list[str], columns: dict, reward_errors: str,
                    errors: list) -> Tensor:
    """func's rewards for the completions, [N] float32, checked (see the module docstring)."""
    values = _call_reward(func, prompts, completions, columns, reward_errors, errors)
    name = reward_name(func)
    if len(values) != len(completions):
        raise ValueError(f"reward function {name} returned {len(values)} rewards for "
                         f"{len(completions)} completions: reward_funcs must return one float each")
    values = torch.tensor([_as_float(v) for v in values], dtype=torch.float32)
    if not torch.isfinite(values).all():
        if reward_errors == "raise":
            raise ValueError(f"reward function {name} returned non-numeric or non-finite rewards "
                             f"({(~torch.isfinite(values)).sum().item()} of {len(values)}); return finite "
                             "floats, or pass reward_errors='zero' to score them 0")
        bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
        errors += [f"{name}[{i}]: not a finite number" for i in bad]
        values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    return values
