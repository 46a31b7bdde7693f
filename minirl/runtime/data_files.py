"""Dataset files to rows: JSONL, JSON, CSV, Parquet or a `save_to_disk` directory, read with `datasets`.

Hand-written (it teaches nothing). A row is a dict with a `prompt` and any other columns,
TRL's standard format; the other columns reach the reward functions as keyword arguments.
A prompt is a string, or a conversation (a list of {"role", "content"} messages, TRL's
conversational format) that `render_prompts` turns into the text the rollout engines take
through the tokenizer's chat template. Every problem with a file is a `ConfigError` naming
the parameter (the chapters report it as the flag, `--dataset`), the path and the fix, before
a model loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from minirl.runtime.validate import ConfigError

SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}   # suffix -> datasets builder
NAMES = {".jsonl": "JSON lines", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet"}
PROMPT_LIKE = ("question", "problem", "query", "input", "instruction", "text", "messages")
DISK_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")                 # what save_to_disk writes
SPLITS = {"dataset": ("train",), "eval_dataset": ("test", "validation")}                # DatasetDict split to take


DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?(?::[\w.-]+)?$")            # name, org/name, org/name:config


def _kinds() -> str:
    return "a JSONL, JSON, CSV or Parquet file, a directory written by datasets' save_to_disk, or a dataset id"


def is_dataset_id(spec) -> bool:
    """True for `name`, `org/name` or `org/name:config` that is no file or directory here (and has no data
    file's suffix): what `datasets.load_dataset` takes by id."""
    spec = os.fspath(spec)
    return (bool(DATASET_ID.match(spec)) and not Path(spec).expanduser().exists()
            and Path(spec.partition(":")[0]).suffix.lower() not in SUFFIXES)


def _read_id(spec: str, param: str):
    """A datasets.Dataset from `datasets.load_dataset(name, config)`, the split `param` takes."""
    import datasets  # noqa: PLC0415 (seconds to import)

    name, _, config = spec.partition(":")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        found = datasets.load_dataset(name, config or None)
    except Exception as err:
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        raise ConfigError(param, spec, f"the dataset id {name!r} could not be reached{offline}: "
                                       f"{_first_line(err)[:160]}; give a local file or a save_to_disk "
                                       "directory, or run once with the Hub reachable (datasets caches it)") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    return _split(found, param, spec)


def _split(found, param: str, value: str):
    """The split of a DatasetDict that `param` takes (train; test, else validation), or `found` itself."""
    import datasets  # noqa: PLC0415

    if not isinstance(found, datasets.DatasetDict):
        return found
    split = next((s for s in SPLITS.get(param, ("train",)) if s in found), None)
    if split is None:
        raise ConfigError(param, value, f"a DatasetDict with splits {', '.join(found)} but none of "
                                        f"{', '.join(SPLITS.get(param, ('train',)))}; save the split you mean on "
                                        "its own (dataset_dict['name'].save_to_disk(DIR))")
    return found[split]


def rename_columns(rows: list[dict], columns: dict[str, str], param: str, value: str) -> list[dict]:
    """Rows with each column OLD of `columns` ({OLD: NEW}, --dataset-columns question=prompt) named NEW."""
    missing = [old for old in columns if rows and old not in rows[0]]
    if missing:
        raise ConfigError("dataset_columns", " ".join(f"{o}={n}" for o, n in columns.items()),
                          f"{value} has no column {', '.join(map(repr, missing))} (its columns: "
                          f"{', '.join(rows[0])}); name columns it has")
    return [{columns.get(k, k): v for k, v in row.items()} for row in rows]


def _first_line(err: BaseException) -> str:
    """A `datasets` error in one line: the cause under its wrapper (whose message says only that it failed)."""
    while type(err).__name__ == "DatasetGenerationError" and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _read(path: Path, param: str):
    """A datasets.Dataset from a file or save_to_disk directory (progress bars off)."""
    import datasets  # imported here: the embedded task never needs it, and it takes seconds to import

    bars_were_on, verbosity = not datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # a parse error is logged too: ours says it once
    try:
        if path.is_dir():
            if not any((path / m).is_file() for m in DISK_MARKERS):
                raise ConfigError(param, str(path), f"a directory without {' or '.join(DISK_MARKERS[:2])}: "
                                                    f"not written by save_to_disk; give {_kinds()}")
            return _split(datasets.load_from_disk(str(path)), param, str(path))
        return datasets.load_dataset(SUFFIXES[path.suffix.lower()], data_files=str(path), split="train")
    except ConfigError:
        raise
    except Exception as err:
        kind = "a save_to_disk directory" if path.is_dir() else NAMES[path.suffix.lower()]
        raise ConfigError(param, str(path), f"could not be read as {kind} ({_first_line(err)}); fix it, "
                                            f"or give {_kinds()}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _is_message_list(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def check_rows(rows: list[dict], param: str = "dataset", value=None) -> None:
    """Rows must be a non-empty list of dicts whose `prompt` is a non-empty string or a list of messages."""
    value = "rows" if value is None else value
    if not rows:
        raise ConfigError(param, value, "is empty (0 rows); give at least one row with a 'prompt'")
    if not all(isinstance(r, dict) for r in rows):
        raise ConfigError(param, value, "rows must be dicts like {'prompt': ..., 'answer': ...}")
    columns = list(rows[0])
    if "prompt" not in columns:
        like = [c for c in columns if c.lower() in PROMPT_LIKE]
        hint = f" (is it {like[0]!r}? rename it to 'prompt')" if like else ""
        raise ConfigError(param, value, f"has no 'prompt' column (its columns: {', '.join(columns) or 'none'}); "
                                        f"the prompts must be in a column named 'prompt'{hint}")
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not ((isinstance(prompt, str) and prompt) or _is_message_list(prompt)):
            raise ConfigError(param, value, f"row {i}'s prompt {repr(prompt)[:60]} is neither a non-empty string "
                                            "nor a list of {'role', 'content'} messages")


def load_rows(path, param: str = "dataset", columns: dict[str, str] | None = None) -> list[dict]:
    """The rows of a dataset file or save_to_disk directory, as dicts; a ConfigError before anything heavy.

    param names the parameter in errors ("dataset", "eval_dataset"). The file type comes from
    the suffix (.jsonl/.json, .csv, .parquet); a DatasetDict directory gives its "train" split
    for "dataset" and its "test" (else "validation") split for "eval_dataset". Errors: a
    missing path, an unsupported suffix, an empty file, a file `datasets` cannot read, no
    `prompt` column (naming the columns found), a prompt that is neither text nor messages.
    A dataset id (`is_dataset_id`: `org/name[:config]`) goes through `datasets.load_dataset`; offline, or
    unknown, it is one ConfigError saying the id could not be reached. `columns` ({OLD: NEW}) renames
    columns before the rows are checked.
    """
    if is_dataset_id(path):
        rows = _read_id(os.fspath(path), param).to_list()
        rows = rename_columns(rows, columns, param, os.fspath(path)) if columns else rows
        check_rows(rows, param, os.fspath(path))
        return rows
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(param, str(path), f"no such file or directory; give {_kinds()}")
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise ConfigError(param, str(path), f"unsupported file type {path.suffix or '(no suffix)'!r}; "
                                                f"give {_kinds()}")
        if not path.read_bytes().strip():
            raise ConfigError(param, str(path), "is empty (0 rows); give at least one row with a 'prompt'")
    dataset = _read(path, param)
    if len(dataset) == 0:
        raise ConfigError(param, str(path), "is empty (0 rows); give at least one row with a 'prompt'")
    rows = dataset.to_list()
    rows = rename_columns(rows, columns, param, str(path)) if columns else rows
    check_rows(rows, param, str(path))
    return rows


def is_conversational(rows: list[dict]) -> bool:
    """True when any row's prompt is a list of messages (TRL's conversational format)."""
    return any(isinstance(r.get("prompt"), list) for r in rows)


def render_prompts(rows: list[dict], tokenizer, param: str = "dataset", value=None) -> tuple[list[dict], dict]:
    """(rows with every prompt as text, {rendered text: its messages}) for the engines and the rewards.

    A conversational prompt goes through `tokenizer.apply_chat_template(messages,
    add_generation_prompt=True, tokenize=False)`, as TRL does: the text ends where the
    assistant's answer begins. Text prompts pass unchanged; the other columns are kept. A
    conversation with no tokenizer, or a tokenizer without a chat template, is a ConfigError.
    Simplified vs TRL: no `continue_final_message` (a conversation ending in a partial
    assistant turn), no tools.
    """
    if not is_conversational(rows):
        return rows, {}
    value = "rows" if value is None else value
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(param, value, "its prompts are chat messages, but the model's tokenizer has no chat "
                                        "template; use a chat (Instruct) model, or plain-text prompts "
                                        "(python -m minirl.tasks.word_problems writes them without --chat)")
    rendered, lookup = [], {}
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]   # datasets fills gaps with None
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            lookup[text] = prompt
            row = {**row, "prompt": text}
        rendered.append(row)
    return rendered, lookup
