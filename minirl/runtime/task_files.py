"""A run's task from its data set settings: the rows of `--dataset` and `--eval-dataset`, the rewards
of `--reward` and `--reward-weights`, every mistake a `ConfigError` naming the flag before any model loads.

Hand-written (it teaches nothing about RL): notebook 00 builds the `Task` interface
(`minirl.tasks.task`); this module only reads files into one. Rows come from
`minirl.runtime.data_files.load_rows`; conversational prompts go through the tokenizer's chat
template (`render_prompts`), and the rewards still see the messages, as TRL's do. With the math
reward, an answer it cannot read is a data set error (every completion of that row would score 0,
silently): an error by default, a warning with `reward_errors="zero"`.
"""

import warnings
from pathlib import Path

from minirl.runtime.data_files import check_rows, load_rows, render_prompts
from minirl.runtime.math_answer import math_reward, reference_answer
from minirl.runtime.validate import ConfigError, check_choice
from minirl.tasks.rewards import CORRECTNESS, as_conversational, check_reward_columns, resolve_rewards, reward_name
from minirl.tasks.task import Task, arithmetic_task


def _rows(source, param: str) -> tuple[list[dict], str]:
    """(rows, how errors name them) from a path, or from rows given directly (a list or a datasets.Dataset)."""
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        return load_rows(source, param), str(source)
    rows = source.to_list() if hasattr(source, "to_list") else [dict(r) for r in source]
    check_rows(rows, param)
    return rows, "rows"


def _unreadable_answers(rows: list[dict], param: str, value: str, reward_errors: str) -> set[int]:
    """The rows whose answer the math reward cannot read: a ConfigError naming the first (reward_errors="raise"),
    or a warning naming it ("zero": training scores their completions 0 and counts them as reward errors)."""
    bad = {i for i, row in enumerate(rows) if reference_answer(row.get("answer")) is None}
    if bad:
        first = min(bad)
        why = (f"row {first}'s answer {str(rows[first].get('answer'))[:40]!r} states no number or math, which the "
               "math reward compares with")
        if reward_errors == "raise":
            raise ConfigError(param, value, f"{why}: fix it (62, GSM8K's '... #### 62' or LaTeX '\\frac{{3}}{{4}}'), "
                                            "or pass --reward-errors zero to score its completions 0")
        warnings.warn(f"{param} {value}: {why} ({len(bad)} such row{'s' * (len(bad) > 1)}): training scores "
                      "their completions 0, evaluation leaves them out", stacklevel=3)
    return bad


def load_task(dataset=None, eval_dataset=None, rewards: list[str] | None = None,
              reward_weights: list[float] | None = None, tokenizer=None, reward_errors: str = "raise") -> Task:
    """The task that a run's data set and reward settings name; a ConfigError naming the setting otherwise.

    dataset: a file or directory (see `load_rows`) or rows; None: the embedded task's
    training split. eval_dataset: the held-out rows, the same way; None: the embedded task's
    held-out split when dataset is None, else no evaluation. rewards: specs (see
    `resolve_rewards`); None: `["arithmetic"]` for the embedded rows, an error for a data set.
    reward_weights: one per reward. tokenizer: renders conversational prompts (needed for those only).
    The accuracy is the first correctness reward's (arithmetic or math), if any is given.
    reward_errors: the run's; with "raise" an answer the math reward cannot read is a ConfigError, with
    "zero" a warning, and such a row is left out of evaluation (training scores it 0 as a reward error).
    """
    check_choice("reward_errors", reward_errors, ("raise", "zero"))
    embedded = arithmetic_task() if dataset is None else None
    train, value = (embedded.train, "embedded") if embedded else _rows(dataset, "dataset")
    if eval_dataset is not None:
        test, eval_value = _rows(eval_dataset, "eval_dataset")
    else:
        test, eval_value = (embedded.test if embedded else []), "embedded"
    if not rewards and embedded is None:
        raise ConfigError("reward", rewards, "a data set needs at least one reward: a built-in (arithmetic, math, "
                                             "format) or module:function")
    funcs, weights = resolve_rewards(list(rewards or ["arithmetic"]), reward_weights)
    accuracy = next((reward_name(f) for f in funcs if f in CORRECTNESS), None)
    if math_reward in funcs:
        _unreadable_answers(train, "dataset", value, reward_errors)
        unreadable = _unreadable_answers(test, "eval_dataset", eval_value, reward_errors)
        test = [row for i, row in enumerate(test) if i not in unreadable]
    train, lookup = render_prompts(train, tokenizer, "dataset", value)
    test, eval_lookup = render_prompts(test, tokenizer, "eval_dataset", eval_value)
    check_reward_columns(funcs, train, "dataset", value)
    if test:
        check_reward_columns(funcs, test, "eval_dataset", eval_value)
    if lookup or eval_lookup:                      # TRL's rewards see a conversation's messages, not its text
        funcs = [as_conversational(f, lookup | eval_lookup) for f in funcs]
    name = "arithmetic" if embedded else "/".join(Path(value).parts[-2:])     # data/word_problems/train.jsonl
    return Task(name, train, test, funcs, weights, accuracy_reward=accuracy,
                max_new_tokens=embedded.max_new_tokens if embedded and eval_dataset is None else None)
