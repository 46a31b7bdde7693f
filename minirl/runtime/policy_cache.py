"""The on-disk cache of the warm-started policy: where it lives, how it is written, how it is read back.

Hand-written (it teaches nothing about RL). Notebook 00's `load_default_policy` builds the policy once
and keeps it here; every later run reads it in a second. Three things make that safe:

- `policy_dir(key)`: the directory is named by a hash of every setting that shapes the policy, so a
  changed setting builds a new policy instead of reading a stale one. `MINIRL_CACHE` moves the cache
  (default `~/.cache/minirl`).
- `build_atomically(path)`: the files are written into a temporary directory beside `path` that is
  renamed into place only when complete, so an interrupted build (an error, Ctrl-C) never leaves a
  half-written policy. The temporary directory is made before any training, so a cache that cannot be
  written fails at once (`PolicyCacheError`, naming `MINIRL_CACHE`) instead of after minutes of work.
- `build_default_policy(path, ...)`: notebook 00's recipe (tokenizer, policy, warm start, then greedy
  accuracy on each split for `warm_start.json`), written through `build_atomically`.
- `read_policy(path)` and `warm_start_report(path)`: a file damaged later (a full disk, a copy cut
  short) is a `PolicyCacheError` naming the file and the command that rebuilds it.

`load_tokenizer` reads a saved tokenizer exactly as saved: transformers 5's `AutoTokenizer` rebuilds
the tokenizer of every Qwen2 checkpoint as a byte-level BPE from its vocabulary, ignoring the pipeline
in `tokenizer.json`; for the character tokenizer that silently drops spaces and unknown characters.
"""

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
TRAIN_SAMPLE = 500     # training problems whose accuracy the report records (the split is shuffled)


class PolicyCacheError(RuntimeError):
    """The policy cache cannot be written, or a cached policy cannot be read back."""


def cache_dir() -> Path:
    """`$MINIRL_CACHE`, default `~/.cache/minirl`."""
    return Path(os.environ.get("MINIRL_CACHE", Path.home() / ".cache" / "minirl"))


def policy_dir(key) -> Path:
    """The cache directory for a JSON-serializable key of every setting that shapes the policy."""
    text = json.dumps(key, sort_keys=True)
    return cache_dir() / f"policy-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def make_build_dir(path: Path) -> Path:
    """A fresh temporary directory beside `path`, or PolicyCacheError naming the cache and the fix."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    except OSError as err:
        where = os.environ.get("MINIRL_CACHE", "unset, so ~/.cache/minirl")
        raise PolicyCacheError(f"cannot write the warm-started policy under {path.parent} "
                               f"({err.strerror or err}): set MINIRL_CACHE to a writable directory "
                               f"(MINIRL_CACHE is {where})") from None


@contextmanager
def build_atomically(path: Path):
    """Yield a temporary directory to write the policy into; on success it becomes `path` in one rename.

    Made before the caller does any work, so an unwritable cache fails first. Whatever stops the
    build (an error, Ctrl-C) removes the temporary directory. If another process finished the same
    policy first, theirs is kept.
    """
    tmp = make_build_dir(Path(path))
    try:
        yield tmp
        try:
            os.replace(tmp, path)       # atomic: readers see all of it or none of it
        except OSError:                 # another process finished first; keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_default_policy(path: Path, task_config, policy_config, warm_config, progress: bool = True) -> None:
    """Build, warm-start, evaluate and save the policy at `path` (its report in warm_start.json), atomically.

    The configs are notebook 00's TaskConfig, PolicyConfig and WarmStartConfig. The temporary
    directory comes first: an unwritable cache is a PolicyCacheError before any training.
    """
    from dataclasses import asdict  # noqa: PLC0415

    from minirl.models import policy  # noqa: PLC0415 (it imports this module)
    from minirl.tasks.arithmetic import make_task  # noqa: PLC0415

    with build_atomically(path) as tmp:
        task = make_task(task_config)
        tokenizer = policy.build_tokenizer(task_config.max_length)
        model = policy.build_policy(policy_config, tokenizer)
        trained = policy.warm_start(model, tokenizer, task, warm_config, progress=progress)
        accuracy = policy.greedy_accuracy
        report = {**trained, "steps": len(trained["losses"]),
                  "heldout_accuracy": accuracy(model, tokenizer, task),
                  "validation_accuracy": accuracy(model, tokenizer, task, task.validation),
                  "train_accuracy": accuracy(model, tokenizer, task, task.train[:TRAIN_SAMPLE]),
                  "train_sample": min(TRAIN_SAMPLE, len(task.train)),
                  "task": asdict(task_config), "policy": asdict(policy_config), "warm_start": asdict(warm_config)}
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(report))


def damaged_cache(path: Path, filename: str, err: Exception) -> PolicyCacheError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PolicyCacheError(f"the cached policy is damaged: {Path(path) / filename} cannot be read "
                            f"({type(err).__name__}: {reason}). Delete it and rebuild: rm -r {path} "
                            f"(or python chapters/00_warm_start.py --rebuild)")


def load_tokenizer(path: str | Path):
    """The tokenizer saved in the directory `path`, exactly as saved; AutoTokenizer's for anything else.

    A directory whose tokenizer_config.json names the generic class (the embedded policy's do)
    gets its `tokenizer.json` pipeline as it was saved (see the module docstring for why).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415 (heavy)

    path = Path(path)
    config = path / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def read_policy(path: Path, device: str = "cpu"):
    """(model in eval mode on `device`, tokenizer padding on the left) from a cached policy directory.

    Any failure to read back a cached file means the cache is damaged (safetensors, JSON and OS
    errors all occur), so every exception is reported with the file and the fix.
    """
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy)

    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    except Exception as err:
        raise damaged_cache(path, "model.safetensors", err) from err
    try:
        tokenizer = load_tokenizer(path)
    except Exception as err:
        raise damaged_cache(path, "tokenizer.json", err) from err
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def warm_start_report(path: Path) -> dict:
    """What was recorded when the policy at `path` was built: "losses", "validation" checks,
    "steps", and greedy accuracy on the held-out, validation and (a sample of) training problems."""
    try:
        return json.loads((Path(path) / "warm_start.json").read_text())
    except (OSError, ValueError) as err:
        raise damaged_cache(path, "warm_start.json", err) from err
