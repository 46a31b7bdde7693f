"""One loader for every policy, and the checks a model name and a prompt pass before they are used.

Hand-written (it teaches nothing about RL). Every chapter takes `--model`: the embedded policy by
default, or any Hugging Face causal LM by hub id or local directory. `load_policy` is that one door.
It prepares the tokenizer as TRL's trainers do (padding on the left, so generation continues every
prompt from the same column; EOS as the pad token where there is none) and checks the name before
any weight loads (`check_model_source`): a path that does not exist, a malformed hub id, or a
directory without tokenizer files is a `ModelSourceError` naming the fix. Offline
(`HF_HUB_OFFLINE=1`) a hub id loads only from the local Hugging Face cache.

`check_prompts` refuses, before a prompt reaches a policy, what would otherwise fail far away or
not at all: no prompts, an empty prompt, characters the tokenizer does not know (they would become
its unknown token), or a prompt that leaves no room for the completion in the model's context.
Every rollout engine calls it on its prompts.
"""

import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class ModelSourceError(ValueError):
    """A model name that names no usable model: no such directory, not a hub id, or files missing."""


class PromptError(ValueError):
    """A prompt the policy cannot take: empty, with unknown characters, or too long for the context."""


def check_model_source(name_or_path: str, need_tokenizer: bool = True) -> str:
    """"local" for a model directory, "hub" for a well-formed hub id; ModelSourceError otherwise.

    Looks at names and files only, loads nothing: a directory must hold config.json and (with
    `need_tokenizer`) one of TOKENIZER_FILES; a name that is no directory must be a valid hub
    id, "name" or "owner/name".
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # noqa: PLC0415

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
    import torch  # noqa: PLC0415

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype={dtype!r}: use a torch.dtype or its name, e.g. 'float32' or 'bfloat16'")


DROPOUT_ATTRIBUTES = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                      "activation_dropout", "classifier_dropout")


def disable_dropout(model) -> int:
    """TRL's `disable_dropout` (on by default here): every nn.Dropout's p, and every dropout rate a module or the
    config keeps as a float (Qwen2's attention reads `attention_dropout` itself), set to 0. Returns how many were
    not 0. The packed update computes each group's prompt once for all its completions (PromptCache), which is
    the same pass only when the forward has no dropout; and RL's old and new log-probs must come from one model."""
    import torch  # noqa: PLC0415

    changed = 0
    for holder in (*model.modules(), getattr(model, "config", None)):
        if isinstance(holder, torch.nn.Dropout) and holder.p:
            holder.p, changed = 0.0, changed + 1
        for name in DROPOUT_ATTRIBUTES:
            value = getattr(holder, name, None)
            if isinstance(value, float) and value:
                setattr(holder, name, 0.0)
                changed += 1
    return changed


def load_policy(name_or_path: str | None = None, device="cpu", dtype=None, progress: bool = True,
                dropout: bool = False):
    """(model, tokenizer) ready for the loop: the embedded policy (None), a local directory or a hub id.

    dtype: None keeps the checkpoint's (float32 for the embedded policy), else a torch.dtype or
    its name. dropout: keep the model's dropout (default off: `disable_dropout`, TRL's setting).
    The model is in eval mode on `device`; the tokenizer pads on the left and, when it
    has no pad token, with its EOS token (as TRL does). Raises ModelSourceError for a name that
    is no model (see `check_model_source`), a hub id that is neither cached nor downloadable
    (offline), or a tokenizer with neither a pad nor an EOS token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from minirl.models.policy import load_default_policy  # noqa: PLC0415 (torch)
    from minirl.runtime.policy_cache import load_tokenizer  # noqa: PLC0415

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
    if not dropout:
        disable_dropout(model)
    return model.to(device).eval(), tokenizer


def check_prompts(tokenizer, prompts: list[str], context: int | None = None, max_new_tokens: int = 0) -> None:
    """Raise PromptError naming the first bad prompt (its index and text) and what is wrong.

    context: the model's positions (`config.max_position_embeddings`); each prompt's tokens plus
    `max_new_tokens` must fit in it. Unknown characters are those the tokenizer maps to its
    unknown token (a byte-level BPE has none, and maps every character somewhere).
    """
    if isinstance(prompts, str) or not prompts:
        raise PromptError(f"prompts={prompts!r}: give a non-empty list of prompt strings")
    unk = tokenizer.unk_token_id
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise PromptError(f"prompt {i} ({prompt!r}) is empty or not a string")
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = enc["input_ids"]
        if unk is not None and unk in ids:
            chars = sorted({prompt[a:b] for t, (a, b) in zip(ids, enc["offset_mapping"], strict=True) if t == unk})
            raise PromptError(f"prompt {i} ({prompt[:40]!r}) has characters the tokenizer does not know: {chars} "
                              f"(they would become {tokenizer.unk_token})")
        if context is not None and len(ids) + max_new_tokens > context:
            raise PromptError(f"prompt {i} ({prompt[:40]!r}) is {len(ids)} tokens; with max_new_tokens="
                              f"{max_new_tokens} it needs {len(ids) + max_new_tokens} positions, but the model's "
                              f"context is {context}")
