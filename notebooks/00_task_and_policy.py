# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · The task, the policy, and the loop we will scale
#
# **By the end of this notebook you can** build the whole embedded default of minirl from
# nothing on a laptop: an arithmetic task with a verifier, a character-level tokenizer, a
# tiny Qwen2 policy, and a supervised warm start that leaves the policy half-skilled, so
# reinforcement learning has something visible to improve.
#
# The source section (18.4) asks what changes when an RL loop for language models moves
# from one script to a cluster. Every later notebook answers part of that question with
# this same policy and task, so every number you see is one you can rerun here.
#
# The loop itself has four steps, and the order is the thing to remember:
#
# | step | what happens | where it runs in minirl (notebook) |
# |---|---|---|
# | 1. generate | the rollout engine samples completions from the current policy | HF `generate` (01); vLLM (04); a paged engine (05) |
# | 2. reward | a verifier scores each completion | a plain function (01); a reward worker (06) |
# | 3. update | the trainer computes a loss and steps the optimizer | one process (01); FSDP under torchrun (04) |
# | 4. synchronize | the new weights go back to the rollout engine | a copy (01); gathered from shards (04), broadcast (06) |
#
# In one process these are four function calls. On a cluster each becomes a transfer and a
# wait; that is what the rest of the course is about.

# %%
# %load_ext minirl.runtime.notebook
# (above: figures inline whatever MPLBACKEND says, and an exported cell you edit and run becomes
#  the code the package runs, for the rest of this kernel; `python tools/build.py` saves it to disk)
import os
import time

import matplotlib.pyplot as plt
import torch

from minirl.runtime.notebook import add_to_class  # a long class is built up across cells (the Task interface)

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny policy gains nothing from more threads; on a busy machine they spin

# %% [markdown]
# ## 1. The task: two-digit addition, answer written backwards
#
# A prompt is `a+b=`; the completion is the answer **with its digits reversed** (least
# significant first), then an end-of-sequence token. So `27+35=` expects `26` (62 reversed).
#
# Why backwards? A model that writes the most significant digit first must know every
# carry before it writes anything. Written least significant digit first, each digit needs
# only two input digits and one carry, which a one-million-parameter transformer learns in a
# few minutes on a CPU (Lee et al., *Teaching Arithmetic to Small Transformers*, 2023, report the
# same effect). Set `reverse_answer=False` to feel the difference.
#
# The problems are split once, by seed, into three parts: a **held-out** set that neither the
# warm start nor RL ever trains on, a **validation** set that the warm start uses to decide
# when to stop, and the **training** set for both. What "held out" means here deserves a
# sentence of its own, and gets one below the split.

# %%
# | export minirl/tasks/arithmetic.py
"""The embedded arithmetic task: problems, a train/validation/held-out split, prompts, verifiers.

A prompt is `"a+b="`; the target completion is the answer (reversed digits by default) and
an end-of-sequence token. Reward functions follow TRL's signature,
`f(prompts, completions, **columns) -> list[float]`, so they plug into TRL's GRPOTrainer
as they are. They score anything malformed 0.0 and never raise, whatever string arrives.

Simplified on purpose: one task family, exact-match rewards, no chat template. A real
math-RL setup adds formatting rules, partial credit and a sandbox; none of that changes
how the loop is distributed, which is what this course is about.
"""
import random
from dataclasses import dataclass, field

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_DIGITS = 1000  # longer digit strings are malformed: no task answer is that long, and Python's int()
                   # refuses strings of more than 4,300 digits (a verifier must not raise on them)


# %% [markdown]
# `TaskConfig` says which problems exist and how they are split; a setting that cannot work (an
# empty operand range, answers too long for the tokenizer's context, a split with nothing left
# to train on) is refused here, naming the setting.

# %%
# | export minirl/tasks/arithmetic.py
@dataclass(frozen=True)
class TaskConfig:
    """Which problems exist and how they are split. Defaults: a+b with a, b in 0..99."""

    ops: str = "+"             # any of "+-*"
    min_operand: int = 0
    max_operand: int = 99
    num_test: int = 500        # held-out problems: never trained on, never used to tune anything
    num_validation: int = 500  # carved from training: what the warm start's length is tuned on
    seed: int = 0              # the split's seed
    reverse_answer: bool = True
    max_length: int = 32       # the tokenizer's context: prompt + answer + EOS must fit

    def __post_init__(self):
        if not self.ops or any(op not in OPERATORS for op in self.ops):
            raise ValueError(f"TaskConfig.ops={self.ops!r}: use one or more of {''.join(OPERATORS)!r}")
        if self.min_operand < 0:
            raise ValueError(f"TaskConfig.min_operand={self.min_operand}: operands must be >= 0 "
                             "(a leading minus sign would be ambiguous in the prompt)")
        if self.max_operand < self.min_operand:
            raise ValueError(f"TaskConfig: empty operand range min_operand={self.min_operand} > "
                             f"max_operand={self.max_operand}; set max_operand >= min_operand")
        if self.max_answer_length > MAX_DIGITS:
            raise ValueError(f"TaskConfig.max_operand={self.max_operand}: answers of {self.max_answer_length} "
                             f"digits exceed the verifier's MAX_DIGITS={MAX_DIGITS}; lower max_operand")
        if self.sequence_length > self.max_length:
            raise ValueError(
                f"TaskConfig.max_operand={self.max_operand}: its longest prompt + answer + EOS "
                f"is {self.sequence_length} tokens, beyond the tokenizer's context "
                f"max_length={self.max_length}; lower max_operand or raise max_length")
        if not 0 < self.num_test < self.num_problems:
            raise ValueError(f"TaskConfig.num_test={self.num_test}: must be in 1..{self.num_problems - 1} "
                             f"(there are {self.num_problems} problems)")
        if not 0 <= self.num_validation < self.num_problems - self.num_test:
            raise ValueError(f"TaskConfig.num_validation={self.num_validation}: must be in 0.."
                             f"{self.num_problems - self.num_test - 1} (there are {self.num_problems} problems, "
                             f"{self.num_test} held out, and training needs at least one)")

    @property
    def num_problems(self) -> int:
        return len(self.ops) * (self.max_operand - self.min_operand + 1) ** 2

    @property
    def max_answer_length(self) -> int:
        """Characters of the longest answer, sign included."""
        lo, hi = self.min_operand, self.max_operand
        extremes = [OPERATORS[op](a, b) for op in self.ops for a in (lo, hi) for b in (lo, hi)]
        return max(len(str(v)) for v in extremes)

    @property
    def sequence_length(self) -> int:
        """Tokens of the longest prompt, answer and EOS (one token per character)."""
        return 2 * len(str(self.max_operand)) + 2 + self.max_answer_length + 1


# %% [markdown]
# A problem is two operands and an operator. Its `pair` ignores the order of the operands, so
# that the split can keep a+b and b+a on the same side.

# %%
# | export minirl/tasks/arithmetic.py
@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def value(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def pair(self) -> tuple:
        """The unordered operand pair with its operator: a+b and b+a share it (so do a-b and b-a)."""
        return (self.op, min(self.a, self.b), max(self.a, self.b))


# %% [markdown]
# Prompt and answer formatting are two small functions, and the verifier is their inverse.
# The first three are exercises (their bodies are cut out of `exercises/00_task_and_policy.py`).

# %%
# | export minirl/tasks/arithmetic.py
def format_prompt(problem: Problem) -> str:
    """`Problem(27, "+", 35)` -> `"27+35="`."""
    return f"{problem.a}{problem.op}{problem.b}="


def format_answer(value: int, reverse: bool = True) -> str:
    """The target completion text for an integer answer (without EOS).

    With `reverse=True` the digits are written least significant first and a minus sign,
    if any, stays in front: 62 -> "26", -12 -> "-21", 0 -> "0", 100 -> "001".
    """
    # BEGIN SOLUTION
    digits = str(abs(value))
    if reverse:
        digits = digits[::-1]
    return ("-" if value < 0 else "") + digits
    # END SOLUTION


def parse_answer(completion: str, reverse: bool = True) -> int | None:
    """Invert `format_answer`: the integer a completion states, or None if malformed.

    Leading and trailing whitespace is ignored. A well-formed completion is an optional
    "-" followed by 1 to MAX_DIGITS (1,000) ASCII digits and nothing else ("26", "-21",
    "001"). Anything else ("", "2 6", "26=", "+26", "٣", 1,001 digits, None, a non-string)
    returns None. Never raises, whatever arrives: a policy can emit a completion of 4,301
    digits, which Python's `int()` refuses.
    """
    # BEGIN SOLUTION
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if not digits or len(digits) > MAX_DIGITS or not all(c in "0123456789" for c in digits):
        return None
    return sign * int(digits[::-1] if reverse else digits)
    # END SOLUTION


# %% [markdown]
# The reward functions have TRL's signature: the prompts, the completions, and every other
# dataset column as a keyword argument. Our dataset has an `answer` column holding the
# integer answer, so `accuracy_reward` receives `answer=[...]`. A completion may also arrive
# in TRL's conversational form, a list of `{"role", "content"}` messages; we read the last
# message's content.

# %%
# | export minirl/tasks/arithmetic.py
def completion_text(completion) -> str | None:
    """The text of a completion given as a string or as TRL's list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True, **columns) -> list[float]:
    """1.0 where a completion states exactly `answer`, else 0.0 (malformed included).

    prompts: list[str] (unused, kept for TRL's signature); completions: list[str] or chat
    messages; answer: list[int], one per completion. Returns one float per completion.
    """
    # BEGIN SOLUTION
    if len(completions) != len(answer):
        raise ValueError(f"accuracy_reward: {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        stated = parse_answer(completion_text(completion), reverse=reverse_answer)
        rewards.append(1.0 if stated is not None and stated == target else 0.0)
    return rewards
    # END SOLUTION


def format_reward(prompts, completions, reverse_answer: bool = True, **columns) -> list[float]:
    """1.0 for a well-formed number, right or wrong; a shaping signal, off by default."""
    return [0.0 if parse_answer(completion_text(c), reverse_answer) is None else 1.0 for c in completions]


def arithmetic_reward(prompts, completions, answer, **columns) -> list[float]:
    """The embedded task's reward, `--reward arithmetic`: `accuracy_reward` on reversed digits."""
    return accuracy_reward(prompts, completions, answer, reverse_answer=True)


# %%
# | export minirl/tasks/arithmetic.py
@dataclass
class ArithmeticTask:
    """A config and its split: `train`, `test` (held out) and `validation` are lists of Problems."""

    config: TaskConfig
    train: list[Problem]
    test: list[Problem]
    validation: list[Problem] = field(default_factory=list)

    def prompt(self, problem: Problem) -> str:
        return format_prompt(problem)

    def answer_text(self, problem: Problem) -> str:
        return format_answer(problem.value, self.config.reverse_answer)

    def reward(self, prompts, completions, answer, **columns) -> list[float]:
        """`accuracy_reward` with this task's answer format (TRL signature)."""
        return accuracy_reward(prompts, completions, answer, reverse_answer=self.config.reverse_answer)

    def rows(self, split: str = "train") -> list[dict]:
        """Dataset rows `{"prompt", "answer"}` in TRL's standard (non-chat) format."""
        splits = {"train": self.train, "validation": self.validation, "test": self.test}
        if split not in splits:
            raise ValueError(f"split={split!r}: use one of {', '.join(map(repr, splits))}")
        problems = splits[split]
        return [{"prompt": format_prompt(p), "answer": p.value} for p in problems]

    def dataset(self, split: str = "train"):
        """The split as a `datasets.Dataset` (what TRL's trainers take)."""
        from datasets import Dataset  # imported here: the rest of the task needs no datasets

        return Dataset.from_list(self.rows(split))


# %% [markdown]
# `make_task` builds every problem of a config and splits them by unordered operand pair, so
# no held-out problem has its commuted twin in training.

# %%
# | export minirl/tasks/arithmetic.py
def make_task(config: TaskConfig | None = None) -> ArithmeticTask:
    """Every problem of the config, split by unordered operand pair into test, validation and train.

    a+b and b+a always land in the same split, so no held-out problem has its commuted twin
    in training. The pairs are shuffled by `config.seed`; the held-out set takes whole pairs
    until it holds `num_test` problems, then the validation set until `num_validation` (a
    pair that would overshoot is passed over for a later one, so the sizes are exact when
    enough a+a problems exist, and never larger); training gets the rest. Each split is then
    shuffled on its own, so a problem and its twin are not neighbours.
    """
    config = config or TaskConfig()
    operands = range(config.min_operand, config.max_operand + 1)
    groups = {}
    for problem in (Problem(a, op, b) for op in config.ops for a in operands for b in operands):
        groups.setdefault(problem.pair, []).append(problem)
    pairs = list(groups)
    rng = random.Random(config.seed)
    rng.shuffle(pairs)
    test, validation, train = [], [], []
    for pair in pairs:
        group = groups[pair]
        if len(test) + len(group) <= config.num_test:
            test += group
        elif len(validation) + len(group) <= config.num_validation:
            validation += group
        else:
            train += group
    for split in (test, validation, train):
        rng.shuffle(split)
    return ArithmeticTask(config, train=train, test=test, validation=validation)


# %%
task = make_task()
p = task.test[0]
print(len(task.train), "train problems,", len(task.validation), "validation,", len(task.test), "held out")
print(repr(format_prompt(p)), "->", repr(task.answer_text(p)), "  (value", p.value, ")")
print(task.reward([format_prompt(p)] * 4, [task.answer_text(p), "12", " ", "26=x"], answer=[p.value] * 4))

# %% [markdown]
# **What "held out" means here.** A held-out problem is an operand pair that training never
# shows, in either order: `27+35=` and `35+27=` are one pair and always fall on the same side
# of the split (a split by single problems would put the commuted twin of almost every
# held-out problem into training, where the model could learn the sum by symmetry). It is
# *not* a test on new digits, longer numbers or another operator: every digit, every carry
# and every operand value appear in training. So held-out accuracy measures whether the
# policy learned the rule for combining familiar parts rather than a table of sums; that is
# the generalization RL has to improve. Nothing is tuned on it: the warm start decides when
# to stop on the validation split, and held-out accuracy is only ever reported.

# %%
seen = {q.pair for q in task.train + task.validation}
print("held-out pairs also in training or validation:", sum(q.pair in seen for q in task.test))
print("held-out problems whose commuted twin is held out too:",
      sum(Problem(q.b, q.op, q.a) in set(task.test) for q in task.test), "of", len(task.test))
assert not any(q.pair in seen for q in task.test)

# %% [markdown]
# A bad configuration fails at once and names the parameter. Try it:

# %%
for bad in (dict(min_operand=50, max_operand=10), dict(max_operand=10**20)):
    try:
        TaskConfig(**bad)
    except ValueError as err:
        print("ValueError:", err)

# %% [markdown]
# ## 2. A character-level tokenizer, built with `tokenizers`
#
# One token per character keeps every completion short and every log-probability easy to
# read. We build it with the `tokenizers` library (a `WordLevel` model over single
# characters) and wrap it as a `PreTrainedTokenizerFast`, so it saves as `tokenizer.json`
# with the model, an ordinary Hugging Face checkpoint. One trap when reading it back:
# transformers 5's `AutoTokenizer` rebuilds the tokenizer of any Qwen2 checkpoint as a
# byte-level BPE from the vocabulary, ignoring the pipeline in `tokenizer.json`; for this
# vocabulary that silently drops spaces and unknown characters. `load_tokenizer` (section 4)
# reads the file as it was saved, and every minirl loader uses it.
#
# Padding goes on the **left**: in a batch of prompts of different lengths, every prompt
# then ends at the same column and generation continues from there.
#
# A character the vocabulary lacks becomes the unknown token `<unk>`, never nothing: a
# tokenizer that silently drops characters turns `"ab+c="` into `"+="` and a garbled prompt
# into a plausible one. The vocabulary has 19 entries (4 special tokens and 15 characters),
# and the model's embedding table is sized from the tokenizer, so every id the tokenizer can
# produce has a row.

# %%
# | export minirl/models/policy.py
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


# %%
tokenizer = build_tokenizer()
batch = tokenizer(["27+35=", "4+5="], padding=True)
print(batch["input_ids"])
print(tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True))
print(len(tokenizer), "ids;", repr("ab+c="), "->", tokenizer.convert_ids_to_tokens(tokenizer("ab+c=")["input_ids"]))

# %% [markdown]
# Before a prompt reaches the policy, `check_prompts` refuses what would otherwise fail far
# away or not at all: no prompts, an empty prompt, unknown characters, or a prompt that leaves
# no room for the completion in the model's context (32 positions here). Every rollout
# engine calls it on its prompts.

# %%
# | export minirl/models/policy.py
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


# %%
for bad in ([], ["12+3=", "ab+c="], ["1" * 30 + "+1="]):
    try:
        check_prompts(tokenizer, bad, context=32, max_new_tokens=4)
    except PromptError as err:
        print("PromptError:", err)

# %% [markdown]
# ## 3. A tiny Qwen2 policy
#
# The policy is a real `Qwen2ForCausalLM` from `transformers`, only small: 4 layers, hidden
# size 128, grouped-query attention with 4 query and 2 key/value heads, tied embeddings.
# That is about a million parameters. Because it is a stock architecture, everything that
# works on Qwen2-7B (FSDP wrapping, LoRA target modules, vLLM serving) works on it too.

# %%
# | export minirl/models/policy.py
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


# %%
policy = build_policy(PolicyConfig(), tokenizer)
print(f"{sum(p.numel() for p in policy.parameters()):,} parameters")

# %% [markdown]
# ## 4. The warm start: supervised learning on the answers
#
# RL needs a policy that already succeeds sometimes: with a reward of 0 on every sample,
# every advantage is 0 and nothing is learned. So we first train on correct answers for a
# few hundred steps, on purpose not to convergence.
#
# Small transformers learn addition abruptly: the loss sits on a plateau for a while (the
# plot shows this run's; the model has learned the answer's length and digit frequencies, not the sum), then
# drifts down, and finally falls within a few dozen steps as the carry rule clicks into
# place; accuracy follows, slowly and then steeply. *When* it falls depends
# on the seed, and through the last bits of floating point on the machine, so the warm start
# does not stop at a fixed step. Every `eval_every` steps it measures greedy accuracy on the
# **validation** split and stops at the first check that reaches `target_accuracy` (0.45):
# in the middle of the fall, half-skilled. Trained on, it soon passes 90 %, too little left
# for RL to show. This is the only tuning the warm start gets, and it never looks at the
# held-out split.
#
# A training example is the prompt followed by the answer and EOS. The loss only counts the
# completion: prompt positions get the label -100, which PyTorch's cross-entropy ignores.
# Building those two rows is exercise 0.4.

# %%
# | export minirl/models/policy.py
def sft_example(task: ArithmeticTask, problem: Problem, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and labels for one supervised example.

    input_ids = ids(prompt) + ids(answer) + [eos_token_id]
    labels    = [-100] * len(ids(prompt)) + ids(answer) + [eos_token_id]
    Both lists have the same length; no special token is added before the prompt.
    """
    # BEGIN SOLUTION
    prompt = tokenizer(format_prompt(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer(task.answer_text(problem), add_special_tokens=False)["input_ids"]
    answer = answer + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer
    # END SOLUTION


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


# %% [markdown]
# The warm start itself: a config whose defaults stop it half-skilled, and a plain training
# loop that checks validation accuracy every `eval_every` steps and stops at the target.

# %%
# | export minirl/models/policy.py
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


# %% [markdown]
# How do we score the policy? Greedy decoding on the held-out problems: for each prompt the
# single most likely completion, checked by the verifier. `generate` handles the left padding
# for us: it derives each token's position from the attention mask, so a padded prompt sees
# the same positions as an unpadded one. (Qwen2's rotary embeddings only see the distance
# between two positions, so for this policy a shift by the padding width changes nothing but
# rounding; a model with learned absolute positions, such as GPT-2, would answer differently.
# Notebook 01 measures both.)

# %%
# | export minirl/models/policy.py
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


# %% [markdown]
# Building the policy takes minutes, so it is cached on disk under a key made of every
# setting that shapes it. The cache is written atomically: the checkpoint goes to a temporary
# directory that is renamed into place only when complete, so an interrupted build never
# leaves a half-written policy behind. That temporary directory is made *before* the
# training starts, so a cache that cannot be written (read-only, or a path under a file)
# fails at once instead of after minutes of work. A cached file damaged later (a disk that
# filled up, a copy cut short) is reported with its name and the command that rebuilds it.
# `MINIRL_CACHE` moves the cache (default `~/.cache/minirl`).

# %%
# | export minirl/models/policy.py
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


# %% [markdown]
# Building a policy into the cache: the temporary directory first, then the training and the
# report, then one rename into place.

# %%
# | export minirl/models/policy.py
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


# %% [markdown]
# Loading it back: a damaged cache names the file and the fix, and the tokenizer is read as the one we built (transformers would rebuild it as a generic BPE).

# %%
# | export minirl/models/policy.py
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


# %% [markdown]
# Now build (or load) the default policy. The first run trains for a few minutes with a
# progress bar that shows the last validation check; later runs read the cache. The time
# printed is this run's: a build, or a load from the cache.

# %%
t0 = time.time()
model, tokenizer, path = load_default_policy()
report = warm_start_report(path)
print(f"policy at {path}  ({time.time() - t0:.1f} s)")
print(f"the warm start stopped after {report['steps']} steps (at most {WarmStartConfig().steps}), at the first "
      f"validation check reaching {WarmStartConfig().target_accuracy}")

fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(range(1, len(report["losses"]) + 1), report["losses"], lw=0.8, label="training loss")
ax.set(xlabel="step", ylabel="cross-entropy on answer tokens", title="warm start", yscale="log")
acc = ax.twinx()
acc.plot(*zip(*report["validation"], strict=True), "C1.-", ms=3, label="validation accuracy")
acc.axhline(WarmStartConfig().target_accuracy, c="C1", ls=":", lw=0.8, label="target_accuracy")
acc.set(ylabel="greedy accuracy (validation)", ylim=(0, 1))
handles, labels = [a + b for a, b in zip(ax.get_legend_handles_labels(), acc.get_legend_handles_labels(), strict=True)]
ax.legend(handles, labels, loc="center left", fontsize=8)
plt.show()

# %% [markdown]
# The recorded accuracies, beside the held-out one re-measured here from the saved
# checkpoint (on a CPU it repeats bit for bit, run after run). Training-set accuracy (on
# 500 training problems) and held-out accuracy come out close (the last line applies the
# rule): the policy has learned a rule that carries over to pairs it never saw, not a
# table of the sums it trained on.

# %%
task = make_task()
accuracy = greedy_accuracy(model, tokenizer, task)
rows = [("training (500 problems)", report["train_accuracy"]), ("validation (stopping rule)", report["validation_accuracy"]),
        ("held out", report["heldout_accuracy"]), ("held out, re-measured now", accuracy)]
for name, value in rows:
    print(f"{name:>28}: {value:.3f}")
gap = abs(report["train_accuracy"] - accuracy)
print(f"re-measured equals the recorded held-out accuracy: {'yes' if accuracy == report['heldout_accuracy'] else 'no'}; "
      f"training and held out {'close' if gap < 0.1 else 'apart'} (rule: within 0.10; {gap:.3f} apart)")
assert accuracy == report["heldout_accuracy"]
assert report["validation_accuracy"] >= WarmStartConfig().target_accuracy or report["steps"] == WarmStartConfig().steps
assert 0.3 < accuracy < 0.75, "the warm start should leave a half-skilled policy"
assert abs(report["train_accuracy"] - accuracy) < 0.1, "train and held-out accuracy should be close"

# %% [markdown]
# Well under 100 %: room for RL. What does the policy get wrong? Sampling at temperature 1
# shows that it often *can* produce the right answer, just not reliably (the last line
# counts the prompts with a right sample among four); RL will turn "sometimes" into
# "usually".

# %%
prompts = [format_prompt(p) for p in task.test[:8]]
enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
with torch.no_grad():
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, temperature=1.0, top_k=0,
                         num_return_sequences=4, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
samples = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
print(f"{'prompt':>8} | target | four samples")
for i, p in enumerate(task.test[:8]):
    print(f"{format_prompt(p):>8} | {task.answer_text(p):>6} | {samples[4 * i: 4 * i + 4]}")
hits = [sum(s == task.answer_text(p) for s in samples[4 * i: 4 * i + 4]) for i, p in enumerate(task.test[:8])]
print(f"prompts with at least one right sample: {sum(h > 0 for h in hits)} of 8; "
      f"right samples: {sum(hits)} of {len(samples)}")

# %% [markdown]
# The saved directory is an ordinary Hugging Face checkpoint. Any tool that takes a model id
# takes this path: `AutoModelForCausalLM.from_pretrained(path)`, TRL's trainers, or
# `vllm serve <path>` on a GPU machine.

# %%
print(sorted(f.name for f in path.iterdir()))

# %% [markdown]
# ## 5. One loader for every policy
#
# Every chapter script takes `--model`: the embedded policy by default, or any Hugging Face
# causal LM, by hub id or local directory. `load_policy` is that one door. It prepares the
# tokenizer the way TRL's trainers do: padding on the **left** (so generation continues
# every prompt from the same column) and, for a model without a pad token, its EOS token as
# the pad. It checks names and files before loading a single weight: a name that is neither
# an existing directory nor a well-formed hub id, or a directory without tokenizer files, is
# an error that says so, instead of a message about repository ids or a crash deep inside
# `generate` later. Offline (`HF_HUB_OFFLINE=1`, as on the machines of this course) a hub id
# works only if the model is already in the local Hugging Face cache.

# %%
# | export minirl/models/loading.py
"""One loader for every policy: the embedded one, or any Hugging Face causal LM by hub id or directory.

`load_policy` prepares the tokenizer as TRL's trainers do (padding on the left, EOS as the pad
token where there is none) and checks the name before any weight loads (`check_model_source`):
a path that does not exist, a malformed hub id, or a directory without tokenizer files is
named with its fix. Offline, a hub id loads only from the local Hugging Face cache.
"""

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


# %% [markdown]
# `load_policy` itself: the name is checked before anything loads, the tokenizer is prepared as
# TRL's trainers prepare it (padding on the left, EOS as the pad token), and a tokenizer with
# more ids than the model embeds is refused.

# %%
# | export minirl/models/loading.py
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


# %% [markdown]
# The embedded policy, and the two mistakes the loader names for you (a path that does not
# exist, and a model saved without its tokenizer):

# %%
import tempfile  # noqa: E402

model, tokenizer = load_policy()
print(type(model).__name__, "on", model.device, "| padding side:", tokenizer.padding_side,
      "| pad token:", tokenizer.pad_token)
with tempfile.TemporaryDirectory() as no_tokenizer:
    model.save_pretrained(no_tokenizer)                    # the weights, but no tokenizer files
    for bad in ("/nonexistent", no_tokenizer):
        try:
            load_policy(bad)
        except ModelSourceError as err:
            print("ModelSourceError:", err)

# %% [markdown]
# The tokenizer trap of section 2, shown: the cached policy's directory read back by
# `AutoTokenizer` and by `load_tokenizer`, on a text with spaces and a character the
# vocabulary lacks.

# %%
from transformers import AutoTokenizer  # noqa: E402

text = "12 + 34 =Q"
cached = load_default_policy(progress=False)[2]
for name, loaded in (("AutoTokenizer", AutoTokenizer.from_pretrained(cached)), ("load_tokenizer", load_tokenizer(cached))):
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    print(f"{name:15} {type(loaded).__name__:24} {loaded.convert_ids_to_tokens(ids)}")
print(f"{'as built':15} {type(tokenizer).__name__:24}",
      tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"]))

# %% [markdown]
# ## 6. The loop, once, by hand
#
# Here are steps 1 and 2 of the loop on four prompts, with the policy sampling eight
# completions for each, the *group* that GRPO compares. Notebook 01 adds the update (3) and
# the synchronization (4), then runs the loop until the policy improves.

# %%
G = 8
rows = task.rows("train")[:4]
enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
with torch.no_grad():                                                          # 1. generate
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, temperature=1.0, top_k=0,
                         num_return_sequences=G, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
answers = [r["answer"] for r in rows for _ in range(G)]
rewards = torch.tensor(task.reward(None, completions, answer=answers)).view(-1, G)  # 2. reward
for r, group in zip(rows, rewards, strict=True):
    print(f"{r['prompt']:>7}  rewards {group.tolist()}  group mean {group.mean():.2f}")
# 3. update and 4. synchronize: notebook 01.

# %% [markdown]
# ## 7. Your model, your task
#
# Everything above trains one policy on one task. A practitioner brings their own: an
# Instruct model from the hub and a data set of word problems. Three pieces make that the
# same loop rather than a special case: a verifier for what real models write, rows read
# from a file, and one `Task` interface that the embedded task is an instance of.
#
# Real models write answers forwards, with words around them. The embedded verifier, built
# for reversed digits and nothing else, scores every one of these 0:

# %%
natural = ["62", " 62", "The answer is 62.", "... so 31 + 31 = 62.\n#### 62"]
print(accuracy_reward(None, natural, answer=[62] * len(natural)))

# %% [markdown]
# GSM8K's solutions end with `#### 62`; models trained on MATH put the answer in `\boxed{}`,
# often with LaTeX in it: `\boxed{\frac{3}{4}}`, `\boxed{25\%}`, `\boxed{18 \text{ dollars}}`.
# So an answer has two readers. A plain number, by far the most common, is read here, exactly
# and fast: `1,234` is 1234, `62.0` is 62, `−5` (a Unicode minus) is -5, and the result is a
# `Fraction`, so decimals compare exactly. Anything else goes to math-verify, the symbolic
# checker behind TRL's `accuracy_reward`, which parses LaTeX into sympy: a millisecond or more
# an answer, too slow to be the first reader (`minirl.runtime.latex_math` calls it so that it
# also runs outside the main thread, as chapter 07's producers do). Like `parse_answer`,
# neither reader raises.

# %%
# | export minirl/tasks/math_answer.py
"""A math-answer verifier for real models: the final answer of a worked solution, compared by value.

GSM8K's solutions end with `#### 62`; models trained on MATH write `\\boxed{62}` or `\\boxed{\\frac{3}{4}}`.
`final_answer` finds the final answer (after the last `####` that starts a number, or inside the last
`\\boxed{}`, whichever comes last) and reads it: a plain number exactly, as a `Fraction` ("1,234",
"−5", "$5."), without sympy; anything else with math-verify (units and text, percent, degrees,
`x = 62`, fractions). `math_reward` compares it with the row's `answer` column, read the same way:
two numbers exactly, anything else with math-verify's `verify` (numbers within 6 decimals).

Simplified on purpose, and where it differs from math-verify alone: a `####` line is read as GSM8K's
evaluation reads it (the number that starts it, words after it ignored); the last `\\boxed{}` is the
final answer (math-verify gathers every box into a set); a completion that is a number and nothing
else is its answer (math-verify wants it boxed or after "the answer is"). Off the main thread
math-verify runs without its timeouts (`minirl.runtime.latex_math`).
"""

import re
from fractions import Fraction

from minirl.runtime.latex_math import parse_math, verify_math
from minirl.tasks.arithmetic import completion_text

MAX_NUMBER_CHARS = 64  # longer "numbers" are malformed: no answer is that long, and Fraction() refuses
                       # strings of more than 4,300 digits (a verifier must not raise on them)
NUMBER = re.compile(r"(?P<sign>[+\-−]?)\s*\$?\s*(?P<sign2>[+\-−]?)\s*"            # -$5 and $-5 alike
                    r"(?P<digits>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
                    r"(?![0-9]|[.,][0-9])", re.ASCII)                                # a number ends here


def _number(match) -> Fraction | None:
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = Fraction(match["digits"].replace(",", ""))
    return -value if {match["sign"], match["sign2"]} & {"-", "−"} else value


def parse_number(text) -> Fraction | None:
    """The number that `text` is, exactly, or None.

    Parses "62", " 62 ", "+62", "-5", "−5" (a Unicode minus), "1,234" (commas only between groups of
    three), "$1,234.50", "62." (a sentence's period) and "62.0" (equal to 62); refuses "", "6 2",
    "1,23", "62 apples", "٣" (ASCII digits only) and anything over MAX_NUMBER_CHARS characters. Never raises.
    """
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    text = text.strip().removesuffix(".").replace("\\$", "$").strip()
    return _number(NUMBER.fullmatch(text))


# %% [markdown]
# Where is the final answer? After the last `####` that starts a number (GSM8K's marker:
# `#### Verification` is a markdown heading, not an answer) or inside the last `\boxed{}`,
# whichever comes later. A `####` answer is the number that starts its line, as GSM8K's own
# evaluation reads it (`#### 62 apples` is 62), unless math follows it (`#### 3/4`); a boxed
# answer is its whole content. A completion with neither counts only if it is a number and
# nothing else, or states its answer as math after an anchor ("the final answer is $\frac{1}{2}$"),
# so `"62"` scores but `"I think 61, no, 62"` does not. Each answer goes to the fast reader
# first, and to math-verify only when that fails.

# %%
# | export minirl/tasks/math_answer.py
MARKER = re.compile(r"####[ \t]*(?=[-+−$.\\0-9])")     # "#### 62" marks an answer; "#### Verification" does not
MATH_AFTER = re.compile(r"[ \t]*[/^_\\{%°]")          # "#### 3/4", "#### 25%": math, not a number and words


def _boxed(text: str) -> tuple[str, int] | None:
    """(content, index after its closing brace) of the last `\\boxed{...}`, braces matched; None if it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j], j + 1
    return None


def _latex_number(content: str) -> Fraction | None:
    """A number written in LaTeX: thin spaces (\\, \\!) and dollars dropped, {,} read as a thousands comma."""
    for old, new in (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\ ", ""), ("\\$", ""), ("$", "")):
        content = content.replace(old, new)
    return parse_number(content)


def _read(math: str) -> Fraction | tuple | None:
    """An answer's text as a value: a Fraction if it is a plain number, else math-verify's reading of it boxed."""
    number = _latex_number(math)
    return number if number is not None else parse_math(f"\\boxed{{{math}}}") or None


def _marked(text: str) -> tuple[Fraction | tuple | None, bool]:
    """(value, True) of the final marked answer, the last `#### N` or `\\boxed{}`; (None, False) without one."""
    marks, boxed = [m.end() for m in MARKER.finditer(text)], text.rfind("\\boxed{")
    if marks and marks[-1] > boxed:
        line = text[marks[-1]:].split("\n", 1)[0]
        match = NUMBER.match(line[:MAX_NUMBER_CHARS])
        if match and match.end() < MAX_NUMBER_CHARS:         # GSM8K: the number that starts the line
            return (_read(line.strip()) if MATH_AFTER.match(line, match.end()) else _number(match)), True
        return (_read(line.strip()) if line.startswith(("\\", "$\\")) else None), True
    if boxed >= 0:
        found = _boxed(text)
        return (_read(found[0]) if found else None), True
    return None, False


def final_answer(completion) -> Fraction | tuple | None:
    """The final answer of a completion (a string or TRL's chat messages), or None. Never raises.

    A Fraction when the answer is a plain number (read without sympy), else math-verify's reading
    (a tuple: sympy value, matched text). Without a marker, the completion must be a number and
    nothing else (" 62", "1,234.", "$62$"), or state math after an anchor ("the answer is $62$").
    """
    text = completion_text(completion)
    if not isinstance(text, str):
        return None
    value, marked = _marked(text)
    if marked:
        return value
    number = _latex_number(text)
    if number is not None or ("$" not in text and "\\" not in text):
        return number
    return parse_math(text) or None


PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")      # two words outside LaTeX commands: prose, not math
LATEX_COMMAND = re.compile(r"\\[A-Za-z]+(?:\{[^{}]*\})?")


def reference_answer(answer) -> Fraction | tuple | None:
    """A row's `answer` as a value: an int or float as it is; a string with a marker as `final_answer`
    reads it (GSM8K's "...#### 62"); else the whole string as a number or as boxed math ("\\frac{3}{4}",
    "\\text{(C)}"). None for anything else: a bool, NaN, "", prose ("see solution")."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer)) if answer == answer and abs(answer) != float("inf") else None
    if not isinstance(answer, str):
        return None
    value, marked = _marked(answer)
    if marked or PROSE.search(LATEX_COMMAND.sub("", answer)):
        return value
    return _read(answer.strip()) if answer.strip() else None


# %%
examples = natural + ["#### 1,234.", "#### $5 per hour", r"so \boxed{1{,}234}", r"\boxed{5} ... #### 7",
                      "#### 62\n\n#### Verification: 31 + 31 = 62", r"\boxed{18 \text{ dollars}}",
                      r"\boxed{\frac{3}{4}}", "I think 61, no, 62", "#### ", [{"role": "assistant", "content": "#### 62"}]]
for text in examples:
    found = final_answer(text)
    print(f"{str(text)[:44]!r:50} -> {found if found is None or isinstance(found, Fraction) else found[0]}")

# %% [markdown]
# The rewards, with TRL's signature. `math_reward` is 1 when the final answer equals the
# row's `answer` (GSM8K's answer column is itself a worked solution ending in `#### N`, so it
# goes through the same reader): two numbers compare exactly, anything else through
# math-verify's `verify`, which knows that `\frac{1}{2}` is 0.5, `50\%` is 0.5 and `x = 62` is 62
# (the last completion below states its value in passing, with no marker, and scores 0).
# An answer that cannot be read is a data set error, named by its row: every completion of it
# would score 0, silently. `math_format_reward` pays for ending with a marked answer,
# right or wrong: a shaping signal that teaches the format before the arithmetic.

# %%
# | export minirl/tasks/math_answer.py
def same_answer(expected, found) -> bool:
    """Whether a final answer equals the expected one: two Fractions exactly, else math-verify's verify."""
    if found is None:
        return False
    if isinstance(expected, Fraction) and isinstance(found, Fraction):
        return expected == found
    return verify_math(expected, found)


def math_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where a completion's final answer equals the row's answer, else 0.0 (TRL signature).

    completions: list[str] or chat messages; answer: one per completion, a number, a GSM8K-style
    solution string or LaTeX. An answer that cannot be read is a ValueError naming the row by its
    prompt (a data set error: every completion of that prompt would score 0, silently).
    """
    if len(completions) != len(answer):
        raise ValueError(f"math_reward: {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for i, (completion, target) in enumerate(zip(completions, answer, strict=True)):
        expected = reference_answer(target)
        if expected is None:
            prompt = completion_text(prompts[i]) if prompts is not None and i < len(prompts) else None
            row = f"the row with prompt {prompt[:40]!r}" if prompt else f"answer {i}"
            raise ValueError(f"math_reward: {row} has the answer {str(target)[:40]!r}, which states no number or "
                             "math (give a number, GSM8K's '... #### 62' or LaTeX such as '\\frac{3}{4}')")
        rewards.append(1.0 if same_answer(expected, final_answer(completion)) else 0.0)
    return rewards


def math_format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 where a completion ends with a marked number, `#### N` or `\\boxed{N}`, else 0.0; right or wrong.

    Whitespace, a period or a closing `$` may follow the marker; anything else after it scores 0.
    """
    rewards = []
    for completion in completions:
        text, ok = completion_text(completion), False
        if isinstance(text, str):
            hashes = text.rfind("####")
            if hashes >= 0 and hashes > text.rfind("\\boxed{"):
                ok = parse_number(text[hashes + 4:]) is not None
            else:
                found = _boxed(text)
                ok = found is not None and _latex_number(found[0]) is not None \
                    and not text[found[1]:].strip(" \t\n$.")
        rewards.append(1.0 if ok else 0.0)
    return rewards


# %%
gsm8k_answer = "Ava buys 3 * 4 = <<3*4=12>>12 pencils.\nShe has 50 + 12 = <<50+12=62>>62 pencils now.\n#### 62"
print("math:  ", math_reward(None, natural, answer=[gsm8k_answer] * len(natural)))
latex = [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{50\%}", r"so $x = \frac{1}{2}$"]
print("LaTeX: ", math_reward(None, latex, answer=["0.5"] * len(latex)))
print("format:", math_format_reward(None, natural))

# %% [markdown]
# **Rows from a file, and a data set to try.** A data set is rows with a `prompt` column; the
# other columns reach the rewards by name, as in TRL. `minirl.runtime.data_files.load_rows`
# reads JSONL, JSON, CSV, Parquet or a `datasets.save_to_disk` directory, and names the
# problem in one line when it cannot. A prompt may be a conversation (a list of
# `{"role", "content"}` messages), which goes through the tokenizer's chat template.
#
# No data set is downloaded here, so minirl generates its own in GSM8K's format from ten
# templates and a seed (`python -m minirl.tasks.word_problems`; a copy is in `data/`).
# A test problem is its template and its numbers, and none of those is in training.

# %%
from minirl.tasks.word_problems import generate

problems = generate(n_train=5, n_test=1, seed=0)
print(problems["test"][0]["prompt"])
print(problems["test"][0]["answer"])
print(generate(n_train=1, n_test=1, chat=True)["test"][0]["prompt"])

# %% [markdown]
# **One interface.** A `Task` is the rows a run trains on, the rows it is judged on, and the
# weighted rewards that score both. Evaluation decodes each held-out prompt greedily and
# scores it: the mean weighted reward, each reward's mean, and the accuracy when one reward
# is a 0/1 correctness check. The rollout engines take text, so conversational prompts are
# rendered first, but the rewards still see the messages, as TRL's do.

# %%
# | export minirl/tasks/task.py
"""A task: the rows a run trains on, the rows it is judged on, and the rewards that score them.

Every chapter trains a `Task`: the embedded arithmetic task is one (`arithmetic_task`), a data
set file with named rewards is another (`load_task`, what `--dataset`, `--eval-dataset`,
`--reward` and `--reward-weights` build). `Task.evaluate` decodes the held-out prompts
greedily and scores them with the task's rewards.

Simplified vs TRL: evaluation decodes each held-out prompt once, greedily (TRL samples
`num_generations_eval` completions with the training sampler's settings).
"""

from dataclasses import dataclass, field

import torch

from minirl.tasks.rewards import combine_rewards, reward_name


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 500) -> list[str]:
    """Greedy completions of text prompts, in order, decoded without special tokens.

    Prompts are tokenized as they are (no special tokens added: a chat template has already
    put its own), left-padded in batches of `batch_size`; generation stops at EOS.
    """
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"                # every prompt ends at the same column
    device = next(model.parameters()).device
    texts = []
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    return texts


# %%
# | export minirl/tasks/task.py
@dataclass
class Task:
    """What a run trains on and how it is judged.

    train, test: rows {"prompt": text, **columns}; prompts are text (a conversation has been
    through the chat template), the other columns reach the rewards. test may be empty (no
    evaluation). reward_funcs: TRL-style f(prompts, completions, **columns); reward_weights:
    one float each (TRL's `reward_weights`, default 1.0). accuracy_reward: the name of a 0/1
    correctness reward, whose mean is the task's accuracy (None: there is none, and a run
    reports the mean weighted reward). max_new_tokens: evaluation's length (None: the caller's).
    """

    name: str
    train: list[dict]
    test: list[dict]
    reward_funcs: list
    reward_weights: list[float] = field(default_factory=list)
    accuracy_reward: str | None = None
    max_new_tokens: int | None = None

    def __post_init__(self):
        self.reward_weights = list(self.reward_weights) or [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"Task {self.name}: {len(self.reward_weights)} reward_weights for "
                             f"{len(self.reward_funcs)} reward_funcs; give one weight per function")
        if self.accuracy_reward is not None and self.accuracy_reward not in self.reward_names:
            raise ValueError(f"Task {self.name}: accuracy_reward={self.accuracy_reward!r} is none of the reward "
                             f"functions ({', '.join(self.reward_names)})")

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(f) for f in self.reward_funcs]

    def score(self, rows: list[dict], completions: list) -> tuple[torch.Tensor, dict]:
        """(weighted total [N], {"rewards/<name>": mean}) for one completion per row, in float64."""
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        prompts = [r["prompt"] for r in rows]
        per_func = torch.tensor([[float(v) for v in f(prompts=prompts, completions=completions, **columns)]
                                 for f in self.reward_funcs], dtype=torch.float64).T          # [N, F]
        return combine_rewards(per_func, self.reward_weights, self.reward_names)

    def evaluate(self, model, tokenizer, max_new_tokens: int | None = None, batch_size: int = 500) -> dict:
        """Greedy completions of every test prompt, scored: {"reward": mean weighted reward,
        "rewards/<name>": each reward's mean, "accuracy": the accuracy reward's mean (0..1), if any}."""
        max_new_tokens = max_new_tokens or self.max_new_tokens
        if not self.test or max_new_tokens is None:
            raise ValueError(f"Task {self.name}: evaluate needs test rows and max_new_tokens (it has "
                             f"{len(self.test)} test rows, max_new_tokens={max_new_tokens})")
        completions = greedy_completions(model, tokenizer, [r["prompt"] for r in self.test], max_new_tokens,
                                         batch_size)
        total, metrics = self.score(self.test, completions)
        result = {"reward": total.mean().item(), **metrics}
        if self.accuracy_reward is not None:
            result["accuracy"] = metrics[f"rewards/{self.accuracy_reward}"]
        return result


# %% [markdown]
# What a run's evaluator needs from a task: one number per evaluation, the accuracy when the
# task has an accuracy reward, else the mean weighted reward.

# %%
# | export minirl/tasks/task.py
@add_to_class(Task)
def eval_fn(self, tokenizer, max_new_tokens: int | None = None):
    """model -> one number for a run's evaluator: the accuracy, else the mean weighted reward
    (None when the task has no test rows)."""
    if not self.test:
        return None
    key = "accuracy" if self.accuracy_reward is not None else "reward"
    return lambda model: self.evaluate(model, tokenizer, max_new_tokens)[key]

# %% [markdown]
# The embedded task is one `Task`, and a data set with named rewards is another.
# `load_task` is what the chapters' `--dataset`, `--eval-dataset`, `--reward` and
# `--reward-weights` build; every mistake in them is an error naming the flag, before any
# model loads.

# %%
# | export minirl/tasks/task.py
import warnings
from pathlib import Path

from minirl.runtime.data_files import check_rows, load_rows, render_prompts
from minirl.runtime.validate import ConfigError, check_choice
from minirl.tasks.arithmetic import TaskConfig, arithmetic_reward, make_task
from minirl.tasks.math_answer import math_reward, reference_answer
from minirl.tasks.rewards import CORRECTNESS, as_conversational, check_reward_columns, resolve_rewards


def arithmetic_task(config: TaskConfig | None = None) -> Task:
    """The embedded task as a Task: its training split, its held-out split, its exact-match reward.

    Its held-out accuracy is `greedy_accuracy`'s: the same prompts, decoded greedily for the
    longest answer plus EOS, scored by the same verifier.
    """
    task = make_task(config)
    reward = arithmetic_reward if task.config.reverse_answer else task.reward
    return Task("arithmetic", task.rows("train"), task.rows("test"), [reward], [1.0],
                accuracy_reward=reward_name(reward), max_new_tokens=task.config.max_answer_length + 1)


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


# %% [markdown]
# `load_task` puts the pieces together: the rows of the data sets, the rewards resolved from
# their specs, and every prompt and reward column checked before any model loads.

# %%
# | export minirl/tasks/task.py
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


# %% [markdown]
# The embedded task through the interface gives exactly the held-out accuracy that
# `greedy_accuracy` computes, and the word problems load as a task with two weighted rewards
# (the embedded policy knows no letters, so it is not asked to solve them).

# %%
embedded_task = arithmetic_task()
evaluated = embedded_task.evaluate(model, tokenizer)
print(f"Task.evaluate: {evaluated}   greedy_accuracy: {greedy_accuracy(model, tokenizer, task):.3f}")
assert evaluated["accuracy"] == greedy_accuracy(model, tokenizer, task)

# %%
import json

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "train.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in problems["train"])
    words = load_task(path, rewards=["math", "format"], reward_weights=[1.0, 0.5])
    print(words.name, len(words.train), "rows, rewards", words.reward_names, "weights", words.reward_weights)
    good = words.train[0]["answer"].split("\n")[-1]                     # "#### N": right and well formed
    total, per_reward = words.score(words.train[:3], [good, "#### 0", "no idea"])
    print("weighted totals", total.tolist(), per_reward)
    with open(path, "w") as f:
        f.write(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    for bad in (dict(dataset=path, rewards=["math"]), dict(rewards=["mathh"]),
                dict(rewards=["math", "format"], reward_weights=[1.0])):
        try:
            load_task(**bad)
        except ConfigError as err:
            print("ConfigError:", err)

# %% [markdown]
# ## Exercises
#
# Your stubs are in `exercises/00_task_and_policy.py`: the bodies of the functions below are
# replaced by `raise NotImplementedError`. Fill them in, then grade:
#
# ```
# python -m minirl.grade --only 00
# ```
#
# | exercise | function | what it checks |
# |---|---|---|
# | 0.1 | `format_answer` | reversed digits, the sign in front, zero |
# | 0.2 | `parse_answer` | the inverse of 0.1; malformed text gives None and never raises |
# | 0.3 | `accuracy_reward` | TRL's reward signature, exact match, malformed scores 0 |
# | 0.4 | `sft_example` | prompt tokens masked with -100, EOS appended |
#
# A further question to think about (not graded): set `reverse_answer=False`, rebuild the
# warm start, and compare the held-out accuracy. Why is the forward order so much harder
# for a small model?
