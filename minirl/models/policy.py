# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""The embedded policy: a character tokenizer, a tiny Qwen2 model, and its warm start.

Everything is built locally (no model hub): `load_default_policy()` returns a warm-started
model and tokenizer from the on-disk cache, building them when absent (a few minutes on one
CPU thread). `load_policy()` loads it, or any other causal LM, for the loop. The saved
directory is an ordinary Hugging Face checkpoint: `AutoModelForCausalLM.from_pretrained(path)`
loads the model offline, and `load_tokenizer(path)` the tokenizer as saved (transformers 5's
`AutoTokenizer` rebuilds a Qwen2 checkpoint's tokenizer as a byte-level BPE, which drops this
one's spaces and unknown characters).

Simplified on purpose: the warm start is a plain supervised loop rather than TRL's
SFTTrainer, because the whole of it fits on one screen and runs deterministically.
"""

__all__ = ["PAD", "BOS", "EOS", "UNK", "CHARACTERS", "build_tokenizer", "PromptError",
           "check_prompts", "PolicyConfig", "build_policy", "sft_example", "sft_batch",
           "WarmStartConfig", "warm_start", "greedy_accuracy", "WARM_START_FORMAT", "TRAIN_SAMPLE",
           "PolicyCacheError", "cache_dir", "make_build_dir", "default_policy_dir",
           "build_default_policy", "damaged_cache", "GENERIC_TOKENIZER_CLASSES", "load_tokenizer",
           "load_default_policy", "warm_start_report"]

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.tasks.arithmetic import ArithmeticTask, Problem, TaskConfig, format_prompt, make_task

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARACTERS = "0123456789+-*= "


def build_tokenizer(max_length: int = 32) -> PreTrainedTokenizerFast:
    """A one-token-per-character tokenizer: ids 0-3 are <pad>, <bos>, <eos>, <unk>, then CHARACTERS.

    Any other character encodes as <unk> (id 3), so nothing is dropped; `len(tokenizer)` is 19
    before and after a save and reload.
    """
    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3} | {c: 4 + i for i, c in enumerate(CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()                                       # join them back
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS,
                                        eos_token=EOS, unk_token=UNK, model_max_length=max_length)
    tokenizer.padding_side = "left"
    return tokenizer


class PromptError(ValueError):
    """A prompt the policy cannot take: empty, with unknown characters, or too long for the context."""


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


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of the tiny Qwen2 policy (about 1 M parameters by default)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_length: int = 32
    seed: int = 0


def build_policy(config: PolicyConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A freshly initialized Qwen2 causal LM sized by `config`, seeded for repeatability."""
    torch.manual_seed(config.seed)
    qwen = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_length, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(qwen)


def sft_example(task: ArithmeticTask, problem: Problem, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and labels for one supervised example.

    input_ids = ids(prompt) + ids(answer) + [eos_token_id]
    labels    = [-100] * len(ids(prompt)) + ids(answer) + [eos_token_id]
    Both lists have the same length; no special token is added before the prompt.
    """
    prompt = tokenizer(format_prompt(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer(task.answer_text(problem), add_special_tokens=False)["input_ids"]
    answer = answer + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def sft_batch(task, problems, tokenizer) -> dict[str, torch.Tensor]:
    """Right-padded tensors input_ids, attention_mask, labels: each [B, T]."""
    rows = [sft_example(task, p, tokenizer) for p in problems]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
        attention_mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass(frozen=True)
class WarmStartConfig:
    """The supervised warm start: it stops once greedy accuracy on the validation split reaches
    `target_accuracy`, so the policy is half-skilled whatever the machine or seed."""

    steps: int = 1500                     # at most this many optimizer steps
    target_accuracy: float | None = 0.45  # stop at the first check reaching it; None: train all `steps`
    eval_every: int = 10                  # steps between validation checks
    batch_size: int = 128
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.eval_every < 1 or self.batch_size < 1:
            raise ValueError(f"WarmStartConfig: steps={self.steps} must be >= 0, eval_every={self.eval_every} "
                             f"and batch_size={self.batch_size} >= 1")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"WarmStartConfig.target_accuracy={self.target_accuracy}: must be in (0, 1], or None")


def warm_start(model, tokenizer, task: ArithmeticTask, config: WarmStartConfig,
               progress: bool = True) -> dict:
    """Train `model` in place on correct answers until validation accuracy reaches the target.

    Returns {"losses": the loss of every step, "validation": [[step, accuracy], ...] of every
    check}. Deterministic on CPU: batches come from a seeded generator, AdamW has no randomness,
    greedy decoding none. Without a validation split (or target None) it trains all `steps`.
    """
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses, checks = [], []
    bar = tqdm(range(1, config.steps + 1), desc="warm start", disable=not progress)
    for step in bar:
        picks = torch.randint(len(task.train), (config.batch_size,), generator=generator)
        batch = sft_batch(task, [task.train[i] for i in picks.tolist()], tokenizer)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
        if config.target_accuracy is not None and task.validation and step % config.eval_every == 0:
            checks.append([step, greedy_accuracy(model, tokenizer, task, task.validation)])   # back in eval mode
            model.train()
            bar.set_postfix(validation=f"{checks[-1][1]:.2f}")
            if checks[-1][1] >= config.target_accuracy:
                break
    bar.close()
    model.eval()
    return {"losses": losses, "validation": checks}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: ArithmeticTask, problems: list[Problem] | None = None,
                    batch_size: int = 500) -> float:
    """Share (0..1) of `problems` (default: the held-out set) solved by greedy decoding."""
    problems = task.test if problems is None else problems
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        enc = tokenizer([format_prompt(p) for p in chunk], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=task.config.max_answer_length + 1, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(task.reward(None, texts, answer=[p.value for p in chunk]))
    model.train(was_training)
    return correct / len(problems)


WARM_START_FORMAT = 2  # bump when the warm start's code changes what it produces
TRAIN_SAMPLE = 500     # training problems whose accuracy the report records (the split is shuffled)


class PolicyCacheError(RuntimeError):
    """The policy cache cannot be written, or a cached policy cannot be read back."""


def cache_dir() -> Path:
    return Path(os.environ.get("MINIRL_CACHE", Path.home() / ".cache" / "minirl"))


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


def default_policy_dir(task_config: TaskConfig = TaskConfig(), policy_config: PolicyConfig = PolicyConfig(),
                       warm_config: WarmStartConfig = WarmStartConfig()) -> Path:
    """Where the warm-started policy for these configs lives (whether or not it exists yet)."""
    key = json.dumps([WARM_START_FORMAT, asdict(task_config), asdict(policy_config), asdict(warm_config)],
                     sort_keys=True)
    return cache_dir() / f"policy-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_default_policy(path: Path, task_config: TaskConfig, policy_config: PolicyConfig,
                         warm_config: WarmStartConfig, progress: bool = True) -> None:
    """Build, warm-start, evaluate and save the policy at `path`, atomically.

    The temporary directory comes first: an unwritable cache is a PolicyCacheError before
    any training. Whatever stops the build (an error, Ctrl-C) removes the temporary directory.
    """
    tmp = make_build_dir(path)
    try:
        task = make_task(task_config)
        tokenizer = build_tokenizer(task_config.max_length)
        model = build_policy(policy_config, tokenizer)
        trained = warm_start(model, tokenizer, task, warm_config, progress=progress)
        report = {**trained, "steps": len(trained["losses"]),
                  "heldout_accuracy": greedy_accuracy(model, tokenizer, task),
                  "validation_accuracy": greedy_accuracy(model, tokenizer, task, task.validation),
                  "train_accuracy": greedy_accuracy(model, tokenizer, task, task.train[:TRAIN_SAMPLE]),
                  "train_sample": min(TRAIN_SAMPLE, len(task.train)),
                  "task": asdict(task_config), "policy": asdict(policy_config), "warm_start": asdict(warm_config)}
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(report))
        try:
            os.replace(tmp, path)       # atomic: readers see all of it or none of it
        except OSError:                 # another process finished first; keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def damaged_cache(path: Path, filename: str, err: Exception) -> PolicyCacheError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PolicyCacheError(f"the cached policy is damaged: {Path(path) / filename} cannot be read "
                            f"({type(err).__name__}: {reason}). Delete it and rebuild: rm -r {path} "
                            f"(or python chapters/00_warm_start.py --rebuild)")


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """The tokenizer saved in the directory `path`, exactly as saved; AutoTokenizer's for anything else.

    transformers 5 loads the tokenizer of every qwen2 checkpoint through `AutoTokenizer` as a
    byte-level BPE (`Qwen2Tokenizer`) rebuilt from the vocabulary, whatever `tokenizer.json`
    says. Our character tokenizer would then lose its spaces and drop unknown characters
    without a trace. A directory whose tokenizer_config.json names the generic class (ours do)
    therefore gets its `tokenizer.json` pipeline as it was saved.
    """
    path = Path(path)
    config = path / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_default_policy(task_config: TaskConfig = TaskConfig(), policy_config: PolicyConfig = PolicyConfig(),
                        warm_config: WarmStartConfig = WarmStartConfig(), device: str = "cpu",
                        progress: bool = True):
    """(model, tokenizer, path) of the warm-started policy, built first if not cached."""
    path = default_policy_dir(task_config, policy_config, warm_config)
    if not (path / "warm_start.json").exists():
        build_default_policy(path, task_config, policy_config, warm_config, progress=progress)
    # Any failure to read back a cached file means the cache is damaged (safetensors, JSON and
    # OS errors all occur), so every exception is reported with the file and the fix.
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    except Exception as err:
        raise damaged_cache(path, "model.safetensors", err) from err
    try:
        tokenizer = load_tokenizer(path)
    except Exception as err:
        raise damaged_cache(path, "tokenizer.json", err) from err
    tokenizer.padding_side = "left"
    model.to(device).eval()
    return model, tokenizer, path


def warm_start_report(path: Path) -> dict:
    """What was recorded when the policy at `path` was built: "losses", "validation" checks,
    "steps", and greedy accuracy on the held-out, validation and (a sample of) training problems."""
    try:
        return json.loads((Path(path) / "warm_start.json").read_text())
    except (OSError, ValueError) as err:
        raise damaged_cache(path, "warm_start.json", err) from err
