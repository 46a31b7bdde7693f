"""What a run's model wrote on held-out prompts, before and after training: the completions behind its accuracy.

Hand-written (display plumbing; notebook 01 §8.1 shows SmolLM2-135M-Instruct's answers with it).
`before_after(run_dir, n)` reads a chapter-01 run's `run.json` (its starting model, held-out
data set, rewards and completion length), decodes the first `n` held-out prompts greedily with
the starting model and with the run's final policy (`run_dir/final`), the way the run evaluated
them, and scores both with the run's rewards. `print_before_after` prints them as a table.
"""

from __future__ import annotations

import json
from pathlib import Path


def _question(prompt) -> str:
    """The last user turn of a conversation, or the text prompt itself."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def before_after(run_dir, n: int = 6) -> list[dict]:
    """[{"question", "answer", "before", "before_reward", "after", "after_reward"}] for the run's first `n`
    held-out rows: greedy completions of the starting model and of the final policy, and their weighted reward."""
    from transformers.utils import logging  # noqa: PLC0415 (torch)

    from minirl.runtime.data_files import load_rows  # noqa: PLC0415 (datasets)
    from minirl.runtime.model_loading import load_policy  # noqa: PLC0415

    run_dir = Path(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    settings = run["settings"]
    if not settings.get("eval_dataset"):
        raise ValueError(f"{run_dir}: the run has no --eval-dataset, so no held-out prompts to show")
    if not (run_dir / "final").is_dir():
        raise ValueError(f"{run_dir}: no final policy ({run_dir / 'final'}); let the run finish first")
    raw = load_rows(settings["eval_dataset"], "eval_dataset")[:n]
    table = [{"question": _question(r["prompt"]), "answer": r.get("answer")} for r in raw]
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()                  # two "Loading weights" bars would say nothing here
    try:
        for label, source in (("before", run["model"]), ("after", str(run_dir / "final"))):
            _answer(table, raw, settings, label, load_policy(source, progress=False))
    finally:
        if shown:
            logging.enable_progress_bar()
    return table


def _answer(table: list[dict], raw: list[dict], settings: dict, label: str, loaded) -> None:
    """Fill table[i][label] and table[i][label + "_reward"] with `loaded` = (model, tokenizer)'s greedy answers."""
    from minirl.runtime.task_files import load_task  # noqa: PLC0415
    from minirl.tasks.task import greedy_completions  # noqa: PLC0415

    model, tokenizer = loaded
    task = load_task(raw, raw, settings["reward"], settings.get("reward_weights"), tokenizer=tokenizer,
                     reward_errors=settings.get("reward_errors", "raise"))
    completions = greedy_completions(model, tokenizer, [r["prompt"] for r in task.test],
                                     settings["max_completion_length"])
    rewards, _ = task.score(task.test, completions)
    for row, text, reward in zip(table, completions, rewards.tolist(), strict=True):
        row[label], row[f"{label}_reward"] = text, reward


def print_before_after(table: list[dict], width: int = 36) -> None:
    """A table, one row per prompt: the question, its answer, each model's completion on one line with its reward."""
    def cell(row: dict, label: str) -> str:
        text, reward = " ".join(row[label].split()), f" [{row[f'{label}_reward']:g}]"   # one line, whatever it was
        room = width - len(reward)
        return (text if len(text) <= room else text[:room - 3] + "...") + reward

    ask = max(len("question"), *(len(row["question"]) for row in table))
    print(f"{'question':{ask}} | answer | {'before training [reward]':{width}} | after training [reward]")
    print(f"{'-' * ask}-+--------+-{'-' * width}-+-{'-' * 23}")
    for row in table:
        print(f"{row['question']:{ask}} | {row['answer']!s:>6} | {cell(row, 'before'):{width}} | {cell(row, 'after')}")
