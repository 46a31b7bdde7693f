"""Reward functions by name: built-ins, `module:function`, weights, and the step's reward bookkeeping.

Hand-written (plumbing). A reward spec, what `--reward` takes, is a built-in name,
`module:function` (an importable module, or a file path `path/to/rewards.py:function`), or
`module.function`, as TRL's `grpo` script resolves `--reward_funcs`. Every function has TRL's signature,
`f(prompts, completions, **columns) -> list[float]`; the training steps also pass TRL's extras (`TRL_EXTRAS`:
completion_ids, trainer_state, log_metric, log_extra; `minirl.runtime.reward_extras`) to a function that takes them.

| built-in     | function                         | scores                                                  |
|--------------|----------------------------------|---------------------------------------------------------|
| `arithmetic` | `arithmetic.arithmetic_reward`   | the embedded task: exact reversed digits (notebook 00)  |
| `math`       | `math_answer.math_reward`        | the final answer (`#### N`, `\\boxed{}`) vs `answer`,   |
|              |                                  | numbers exactly, LaTeX with math-verify                 |
| `format`     | `math_answer.math_format_reward` | ends with `#### N` or `\\boxed{N}`, right or wrong       |

`combine_rewards` and `frac_reward_zero_std` are TRL's weighted sum and its logged share of
groups whose rewards are all equal (their advantages are 0: those prompts teach nothing).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from minirl.runtime.math_answer import math_format_reward, math_reward
from minirl.runtime.validate import ConfigError
from minirl.tasks.arithmetic import arithmetic_reward

if TYPE_CHECKING:      # torch is imported where a tensor is made: chapter 01 names SPEC_HELP in --reward's help,
    from torch import Tensor  # and its --help and a mistyped flag must not wait for torch to load

REWARDS = {"arithmetic": arithmetic_reward, "math": math_reward, "format": math_format_reward}
CORRECTNESS = (arithmetic_reward, math_reward)   # 0/1 correctness rewards: their mean is an accuracy
SPEC_HELP = (f"a built-in ({', '.join(REWARDS)}) or module:function (my_rewards:length_penalty, "
             "my_rewards.length_penalty as TRL writes it, or path/to/rewards.py:length_penalty)")


def reward_name(func) -> str:
    """The name a reward's metrics go under, `rewards/<name>` (TRL's: the function's __name__)."""
    return getattr(func, "__name__", type(func).__name__)


def _import(module: str, spec: str, param: str):
    """The module of a spec: a .py path (loaded as a file, not registered in sys.modules) or an import name."""
    try:
        if module.endswith(".py") or os.sep in module or "/" in module:
            path = Path(module).expanduser()
            if not path.is_file():
                raise ConfigError(param, spec, f"no such file {module!r}; give {SPEC_HELP}")
            found = importlib.util.spec_from_file_location(f"minirl_rewards_{path.stem}", path)
            loaded = importlib.util.module_from_spec(found)
            found.loader.exec_module(loaded)
            return loaded
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())          # as TRL's script: modules beside the user's working directory
        return importlib.import_module(module)
    except ConfigError:
        raise
    except (Exception, SystemExit) as err:
        text = str(err).strip().splitlines()
        raise ConfigError(param, spec, f"module {module!r} does not import ({type(err).__name__}: "
                                       f"{text[0] if text else ''}); fix it, or check the name") from None


def resolve_reward(spec: str, param: str = "reward"):
    """The reward function a spec names; a ConfigError naming the spec and the fix otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(param, spec, f"give {SPEC_HELP}")
    spec = spec.strip()
    if spec in REWARDS:
        return REWARDS[spec]
    module, sep, name = spec.rpartition(":")
    if not sep and "." in spec and not spec.endswith(".py"):      # TRL's own spelling: my_lib.rewards.reward_fn
        module, sep, name = spec.rpartition(".")
    if not sep or not module or not name:
        close = difflib.get_close_matches(spec, REWARDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(param, spec, f"not a built-in reward{hint}; give {SPEC_HELP}")
    loaded = _import(module, spec, param)
    func = getattr(loaded, name, None)
    if func is None:
        has = sorted(k for k, v in vars(loaded).items() if callable(v) and not k.startswith("_")
                     and not inspect.isclass(v) and getattr(v, "__module__", None) == loaded.__name__)
        raise ConfigError(param, spec, f"module {module!r} has no {name!r}; its functions: "
                                       f"{', '.join(has) or 'none'}")
    if not callable(func):
        raise ConfigError(param, spec, f"{name!r} in {module!r} is a {type(func).__name__}, not a function")
    return func


def resolve_rewards(specs: list[str], weights: list[float] | None = None,
                    params: tuple[str, str] = ("reward", "reward_weights")) -> tuple[list, list[float]]:
    """(functions, weights) for `specs`; weights default to 1.0 each (TRL's `reward_weights`).

    Errors (ConfigError, naming params[0] or params[1]): an unknown name, a module that does not
    import (with its import error), a missing function (listing the module's functions), two
    functions with one name (their `rewards/<name>` metrics would collide), weights of another
    length than the specs, a weight that is not a finite number.
    """
    if isinstance(specs, str) or not specs:
        raise ConfigError(params[0], specs, f"give a list of one or more rewards: {SPEC_HELP}")
    funcs = [resolve_reward(s, params[0]) for s in specs]
    names = [reward_name(f) for f in funcs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        same = [s for s, n in zip(specs, names, strict=True) if n == twice]
        raise ConfigError(params[0], same, f"two reward functions named {twice!r}: their rewards/{twice} metrics "
                                           "would collide; give each reward once (rename one of them)")
    if weights is None:
        return funcs, [1.0] * len(funcs)
    weights = list(weights)
    if len(weights) != len(funcs):
        raise ConfigError(params[1], weights, f"{len(weights)} weight{'s' * (len(weights) != 1)} for {len(funcs)} "
                                              f"reward{'s' * (len(funcs) != 1)} ({', '.join(specs)}); give one "
                                              "weight per reward, in their order")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(params[1], weights, f"weight {w!r} is not a finite number")
    return funcs, [float(w) for w in weights]


def check_reward_columns(funcs: list, rows: list[dict], param: str = "dataset", value=None) -> None:
    """Each function's required keyword parameters must be columns of `rows`, before anything runs.

    TRL calls f(prompts=..., completions=..., **columns), so a function without `**kwargs`
    must also accept every column; TRL's extras (`TRL_EXTRAS`: completion_ids, trainer_state, ...)
    are not columns: the training steps pass them. Callables whose signature cannot be read are not checked.
    """
    columns = [c for c in rows[0] if c != "prompt"] if rows else []
    for func in funcs:
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            continue
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        missing = [n for n, p in params.items() if n not in ("prompts", "completions", *TRL_EXTRAS)
                   and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in columns]
        if missing:
            raise ConfigError(param, "rows" if value is None else value,
                              f"reward {reward_name(func)} needs the column {missing[0]!r}, but the rows have "
                              f"{', '.join(columns) or 'only a prompt'}; add it, or use another reward")
        extra = [c for c in columns if c not in named]
        if extra and not takes_any:
            raise ConfigError(param, "rows" if value is None else value,
                              f"reward {reward_name(func)} does not take the column {extra[0]!r}: add **kwargs to "
                              "its parameters (every column is passed, as TRL does)")


class RewardError(ValueError):
    """A reward function's output that cannot be used: the message names the function, the row and the fix."""


TRL_EXTRAS = ("completion_ids", "trainer_state", "log_extra", "log_metric")   # what TRL passes besides the columns


def call_reward(func, prompts: list, completions: list, columns: dict, **extras) -> list[float | None]:
    """func's rewards for N completions, called as TRL's GRPOTrainer calls it; checked, one per completion.

    The call: f(prompts=, completions=, **columns, **extras), where extras are TRL's `completion_ids`,
    `trainer_state`, `log_extra`, `log_metric` (each passed only if given here and the function takes it or
    `**kwargs`). An `async def` function is awaited (in a thread of its own: a notebook's kernel already runs
    an event loop). Returns floats, and None where the function returned None (TRL: "does not apply"; the
    caller leaves it out of that reward's mean). Raises RewardError naming the function and the first bad row
    for: a result that is not a list of N, a value that is no finite number (a string, inf, NaN, a list).
    """
    name = reward_name(func)
    out = invoke_reward(func, prompts, completions, columns, **extras)
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardError(f"reward function {name} returned {type(out).__name__}, not a list of "
                          f"{len(completions)} rewards; return one float (or None) per completion")
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != len(completions):
        raise RewardError(f"reward function {name} returned {len(out)} rewards for {len(completions)} "
                          "completions; return one float (or None) per completion, in their order")
    values = []
    for i, value in enumerate(out):
        number = None if value is None else _finite(value)
        if value is not None and number is None:
            prompt = prompts[i] if isinstance(prompts[i], str) else str(prompts[i])
            raise RewardError(f"reward function {name} returned {value!r} for row {i} (prompt {prompt[:40]!r}); "
                              "return a finite float, or None where the reward does not apply")
        values.append(number)
    return values


def invoke_reward(func, prompts: list, completions: list, columns: dict, **extras):
    """func's output, unchecked: f(prompts=, completions=, **columns, **extras) as `call_reward` describes it.

    An extra that is None, or that the function neither names nor takes through `**kwargs`, is left
    out. A coroutine (an `async def` function, or a wrapper of one) is run to its end in a thread of
    its own (a notebook's kernel already runs an event loop in this one).
    """
    extras = {k: v for k, v in extras.items() if v is not None and _takes(func, k)}
    out = func(prompts=prompts, completions=completions, **columns, **extras)
    if inspect.isawaitable(out):
        import asyncio  # noqa: PLC0415
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        async def wait():
            return await out
        with ThreadPoolExecutor(1) as pool:
            out = pool.submit(asyncio.run, wait()).result()
    return out


def _finite(value) -> float | None:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _takes(func, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def as_conversational(func, lookup: dict):
    """`func` called as TRL calls it on a conversational dataset, under its own name.

    The engines see rendered text; TRL's reward functions see the prompt's messages and each
    completion as `[{"role": "assistant", "content": text}]`. lookup: {rendered prompt: its
    messages} (from `render_prompts`); a prompt not in it passes as text.
    """
    @functools.wraps(func)
    def conversational(prompts, completions, **columns):
        prompts = [lookup.get(p, p) if isinstance(p, str) else p for p in prompts]
        completions = [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions]
        return func(prompts=prompts, completions=completions, **columns)
    return conversational


def combine_rewards(rewards_per_func: Tensor, weights, names: list[str]) -> tuple[Tensor, dict]:
    """(total [N], metrics): the weighted sum over functions, and each function's unweighted mean.

    rewards_per_func: [N, F], one column per function, finite; weights: F floats (a list or
    a tensor); names: F names. metrics: {"rewards/<name>": mean of column f} (TRL logs the
    same under rewards/<name>/mean). As TRL's, the sum and each mean skip NaN: a function that returned
    None for a sample (it does not apply there) counts neither in that sample's total nor in its mean.
    """
    import torch

    weights = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[1] != len(weights) or len(names) != len(weights):
        raise ValueError(f"combine_rewards: rewards_per_func {tuple(rewards_per_func.shape)} must be [N, F] with "
                         f"F = {len(weights)} weights and {len(names)} names")
    total = (rewards_per_func * weights).nansum(dim=1)                               # [N]; NaN: "does not apply"
    return total, {f"rewards/{n}": rewards_per_func[:, i].nanmean().item() for i, n in enumerate(names)}


def frac_reward_zero_std(rewards: Tensor, num_generations: int) -> float:
    """Share (0..1) of prompt groups whose G rewards are all equal (TRL's `frac_reward_zero_std`).

    rewards: [N] in generation order, N = B * G. A group with zero std has zero advantages
    under GRPO, so it teaches nothing; a share near 1 means the task is too easy or too hard
    for the policy. One completion per group (G = 1) always has zero std, as in TRL.
    """
    import torch

    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"frac_reward_zero_std: {rewards.numel()} rewards do not split into groups of "
                         f"num_generations={num_generations}")
    groups = rewards.detach().float().view(-1, num_generations)                      # [B, G]
    if num_generations == 1:
        return 1.0
    std = groups.std(dim=1)                                                           # [B], Bessel-corrected as TRL's
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()
