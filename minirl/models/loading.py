# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""One loader for every policy: the embedded one, or any Hugging Face causal LM by hub id or directory.

`load_policy` prepares the tokenizer as TRL's trainers do (padding on the left, EOS as the pad
token where there is none) and checks the name before any weight loads (`check_model_source`):
a path that does not exist, a malformed hub id, or a directory without tokenizer files is
named with its fix. Offline, a hub id loads only from the local Hugging Face cache.
"""

__all__ = ["TOKENIZER_FILES", "ModelSourceError", "check_model_source", "resolve_dtype",
           "load_policy"]

import os
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl.models.policy import load_default_policy, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class ModelSourceError(ValueError):
    """A model name that names no usable model: no such directory, not a hub id, or files missing."""


def check_model_source(name_or_path: str, need_tokenizer: bool = True) -> str:
    """"local" for a model directory, "hub" for a well-formed hub id; ModelSourceError otherwise.

    Looks at names and files only, loads nothing: a directory must hold config.json and (with
    `need_tokenizer`) one of TOKENIZER_FILES; a name that is no directory must be a valid hub
    id, "name" or "owner/name".
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelSourceError(f"{name_or_path}: a file, not a model directory (give the directory "
                                   "that holds config.json)")
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"no config.json in {path}: not a Hugging Face model directory "
                                   "(model.save_pretrained(DIR) writes one)")
        if need_tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelSourceError(f"no tokenizer files in {path} (none of {', '.join(TOKENIZER_FILES)}): "
                                   "save the tokenizer beside the model with tokenizer.save_pretrained(DIR)")
        return "local"
    try:
        validate_repo_id(str(name_or_path))
    except HFValidationError:
        raise ModelSourceError(f"{name_or_path}: no such directory, and not a hub id "
                               "(a hub id looks like 'Qwen/Qwen2.5-0.5B')") from None
    return "hub"


def resolve_dtype(dtype):
    """None, a torch.dtype, or its name ("bfloat16") -> None or a torch.dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype={dtype!r}: use a torch.dtype or its name, e.g. 'float32' or 'bfloat16'")


def load_policy(name_or_path: str | None = None, device="cpu", dtype=None, progress: bool = True):
    """(model, tokenizer) ready for the loop: the embedded policy (None), a local directory or a hub id.

    dtype: None keeps the checkpoint's (float32 for the embedded policy), else a torch.dtype or
    its name. The model is in eval mode on `device`; the tokenizer pads on the left and, when it
    has no pad token, with its EOS token (as TRL does). Raises ModelSourceError for a name that
    is no model (see `check_model_source`), a hub id that is neither cached nor downloadable
    (offline), or a tokenizer with neither a pad nor an EOS token.
    """
    dtype = resolve_dtype(dtype)
    if name_or_path is None:
        model, tokenizer, _ = load_default_policy(device=device, progress=progress)
        name = "the embedded policy"
    else:
        name = str(name_or_path)
        kind = check_model_source(name)
        try:
            tokenizer = load_tokenizer(name) if kind == "local" else AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **({"dtype": dtype} if dtype else {}))
        except OSError as err:
            if kind == "local":
                raise
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
            raise ModelSourceError(f"{name}: no such directory, and hub id {name!r} is not in the local "
                                   "Hugging Face cache" + (" (HF_HUB_OFFLINE is set)" if offline else
                                                           " and could not be downloaded")) from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelSourceError(f"{name}: its tokenizer has neither a pad nor an EOS token; set "
                                   "tokenizer.pad_token and tokenizer.eos_token, then save it again")
        tokenizer.pad_token = tokenizer.eos_token     # what TRL's trainers do
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelSourceError(f"{name}: the tokenizer has {len(tokenizer)} ids but the model embeds only {rows}: "
                               "ids beyond that would fail inside the model; resize the embeddings "
                               "(model.resize_token_embeddings(len(tokenizer))) or use the matching tokenizer")
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval(), tokenizer
