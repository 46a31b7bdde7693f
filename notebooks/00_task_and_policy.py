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
# | step | what happens | where it runs (notebook) |
# |---|---|---|
# | 1. generate | the rollout engine samples completions | `generate` (01); vLLM (04); paged (05) |
# | 2. reward | a verifier scores each completion | a function (01); a reward worker (06) |
# | 3. update | the trainer steps the optimizer on a loss | one process (01); FSDP (04) |
# | 4. synchronize | new weights go to the rollout engine | copied (01); gathered (04); sent (06) |
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

SMOKE = os.environ.get("MINIRL_SMOKE") == "1"  # CI runs every notebook in this fast mode
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny policy gains nothing from more threads


# %% [markdown]
# ## 0. The result: a half-skilled policy
#
# This is what the notebook builds: a million-parameter Qwen2 trained on correct answers and
# stopped on purpose at the first validation check that reaches 45 % accuracy. The loss sits
# on a plateau (the model has learned the answer's length and digit frequencies, not the
# sum), then falls within a few dozen steps as the carry rule clicks into place. The first
# run builds it (a few minutes on one CPU thread); later runs read it from a cache, whose
# plumbing (a directory named by a hash of every setting, written atomically, a damaged file
# named with its fix) lives in `minirl/runtime/policy_cache.py`.

# %%
from minirl.models.policy import WarmStartConfig, load_default_policy
from minirl.runtime.policy_cache import warm_start_report

t0 = time.time()
model, tokenizer, path = load_default_policy()
report = warm_start_report(path)
print(f"policy at $MINIRL_CACHE/{path.name}  ({time.time() - t0:.1f} s: a build, or a load)")
print(f"the warm start stopped after {report['steps']} steps (at most {WarmStartConfig().steps})")
for name in ("train", "validation", "heldout"):
    print(f"greedy accuracy, {name:>10}: {report[name + '_accuracy']:.3f}")

fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(range(1, len(report["losses"]) + 1), report["losses"], lw=0.8, label="training loss")
ax.set(xlabel="step", ylabel="cross-entropy on answer tokens", title="warm start", yscale="log")
acc = ax.twinx()
acc.plot(*zip(*report["validation"], strict=True), "C1.-", ms=3, label="validation accuracy")
acc.axhline(WarmStartConfig().target_accuracy, c="C1", ls=":", lw=0.8, label="target_accuracy")
acc.set(ylabel="greedy accuracy (validation)", ylim=(0, 1))
ax.legend(*[a + b for a, b in zip(ax.get_legend_handles_labels(), acc.get_legend_handles_labels(),
                                 strict=True)], loc="center left", fontsize=8)
plt.show()

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
EOS. Rewards have TRL's signature, `f(prompts, completions, **columns) -> list[float]`, score
anything malformed 0.0 and never raise. Simplified on purpose: one task family, exact match,
no chat template; none of what a real math-RL setup adds changes how the loop is distributed.
"""
import random
from dataclasses import dataclass, field

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_DIGITS = 1000  # longer digit strings are malformed (and int() refuses more than 4,300 digits)


# %% [markdown]
# `TaskConfig` says which problems exist and how they are split. A setting that cannot work (an
# empty operand range, answers too long for the context) is refused at once by
# `minirl/runtime/config_checks.py`, naming the setting.

# %%
# | export minirl/tasks/arithmetic.py
from minirl.runtime.config_checks import check_task_config


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
        check_task_config(self, OPERATORS, MAX_DIGITS)

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
        """The unordered operand pair with its operator: a+b and b+a share it (a-b and b-a too)."""
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
# in TRL's conversational form, a list of `{"role", "content"}` messages, whose text
# `completion_text` (`minirl/runtime/completions.py`) reads.

# %%
# | export minirl/tasks/arithmetic.py
from minirl.runtime.completions import completion_text
from minirl.runtime.validate import check_choice


def accuracy_reward(prompts, completions, answer, reverse_answer: bool = True,
                    **columns) -> list[float]:
    """1.0 where a completion states exactly `answer`, else 0.0 (malformed included).

    prompts: list[str] (unused, kept for TRL's signature); completions: list[str] or chat
    messages; answer: list[int], one per completion. Returns one float per completion.
    """
    # BEGIN SOLUTION
    if len(completions) != len(answer):
        raise ValueError(f"accuracy_reward: {len(completions)} completions but "
                         f"{len(answer)} answers")
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        stated = parse_answer(completion_text(completion), reverse=reverse_answer)
        rewards.append(1.0 if stated is not None and stated == target else 0.0)
    return rewards
    # END SOLUTION


def format_reward(prompts, completions, reverse_answer: bool = True, **columns) -> list[float]:
    """1.0 for a well-formed number, right or wrong; a shaping signal, off by default."""
    return [0.0 if parse_answer(completion_text(c), reverse_answer) is None else 1.0
            for c in completions]


def arithmetic_reward(prompts, completions, answer, **columns) -> list[float]:
    """The embedded task's reward, `--reward arithmetic`: `accuracy_reward` on reversed digits."""
    return accuracy_reward(prompts, completions, answer, reverse_answer=True)


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
        return accuracy_reward(prompts, completions, answer,
                               reverse_answer=self.config.reverse_answer)

    def rows(self, split: str = "train") -> list[dict]:
        """Dataset rows `{"prompt", "answer"}` in TRL's standard (non-chat) format."""
        splits = {"train": self.train, "validation": self.validation, "test": self.test}
        check_choice("split", split, splits)
        return [{"prompt": format_prompt(p), "answer": p.value} for p in splits[split]]

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

    a+b and b+a always land in the same split. The pairs are shuffled by `config.seed`; the
    held-out set takes whole pairs until it holds `num_test` problems (a pair that would
    overshoot is passed over), then validation until `num_validation`; training gets the rest.
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
print(len(task.train), "train problems,", len(task.validation), "validation,",
      len(task.test), "held out")
print(repr(format_prompt(p)), "->", repr(task.answer_text(p)), "  (value", p.value, ")")
print(task.reward([format_prompt(p)] * 4, [task.answer_text(p), "12", " ", "26=x"],
                  answer=[p.value] * 4))
print(task.dataset("test"))                              # what TRL's GRPOTrainer takes
small = make_task(TaskConfig(ops="+-*", max_operand=9, num_test=50, num_validation=50))
print(small.config.num_problems, "problems with +-* on 0..9, e.g.",
      [small.prompt(q) + small.answer_text(q) for q in small.test[:5]])

# %% [markdown]
# The verifier reads only a well-formed answer, and never raises, whatever a policy emits:

# %%
for text in ["26", " -21 ", "001", "2 6", "26=", "+26", "٣", "9" * 5000, None]:
    print(f"{str(text)[:12]!r:16} -> {parse_answer(text)}")

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
# ## 2. A character-level tokenizer, built with `tokenizers`
#
# One token per character keeps every completion short and every log-probability easy to
# read. We build it with the `tokenizers` library (a `WordLevel` model over single
# characters) and wrap it as a `PreTrainedTokenizerFast`, so it saves as `tokenizer.json`
# with the model, an ordinary Hugging Face checkpoint. (Reading it back needs care:
# transformers 5's `AutoTokenizer` rebuilds any Qwen2 checkpoint's tokenizer as a byte-level
# BPE that drops spaces and unknown characters; `load_tokenizer` in
# `minirl/runtime/policy_cache.py` reads the file as saved.)
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

`load_default_policy()` builds it once into the cache (`minirl.runtime.policy_cache`) and reads it
back, an ordinary Hugging Face checkpoint. Simplified on purpose: the warm start is a plain
supervised loop rather than TRL's SFTTrainer: it fits on one screen and runs deterministically.
"""
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.runtime.config_checks import check_warm_start_config
from minirl.runtime.policy_cache import build_default_policy, policy_dir, read_policy
from minirl.tasks.arithmetic import ArithmeticTask, Problem, TaskConfig, format_prompt

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARACTERS = "0123456789+-*= "


from minirl.tasks.arithmetic import ArithmeticTask, Problem, TaskConfig, format_prompt

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

batch = tokenizer(["27+35=", "4+5="], padding=True)
print(batch["input_ids"])
print(tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True))
print(len(tokenizer), "ids;", repr("ab+c="), "->",
      tokenizer.convert_ids_to_tokens(tokenizer("ab+c=")["input_ids"]))

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
logits = policy(**tokenizer(["27+35="], return_tensors="pt", add_special_tokens=False)).logits
print("logits", tuple(logits.shape), "= [batch, positions, vocabulary]: a next-token")
print("distribution per position; the last position's is the answer's first digit")

# %% [markdown]
# ## 4. The warm start: supervised learning on the answers
#
# RL needs a policy that already succeeds sometimes: with a reward of 0 on every sample,
# every advantage is 0 and nothing is learned. So we first train on correct answers for a
# few hundred steps, on purpose not to convergence.
#
# Small transformers learn addition abruptly (the plot of §0): *when* the loss falls depends
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

# %%
ids, labels = sft_example(task, task.train[0], tokenizer)
print(format_prompt(task.train[0]), task.answer_text(task.train[0]))
print("input_ids:", ids)
print("labels:   ", labels)
batch = sft_batch(task, task.train[:3], tokenizer)     # right-padded: the loss ignores padding too
print({name: tuple(t.shape) for name, t in batch.items()})
print("labels, row 0:", batch["labels"][0].tolist())

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
    target_accuracy: float | None = 0.45  # stop at the first check reaching it; None: all `steps`
    eval_every: int = 10                  # steps between validation checks
    batch_size: int = 128
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_warm_start_config(self)


def warm_start(model, tokenizer, task: ArithmeticTask, config: WarmStartConfig,
               progress: bool = True) -> dict:
    """Train `model` in place on correct answers until validation accuracy reaches the target.

    Returns {"losses": the loss of every step, "validation": [[step, accuracy], ...] of every
    check}. Deterministic on CPU: batches come from a seeded generator, AdamW has no randomness,
    greedy decoding none. Without a validation split (or target None) it trains all `steps`.
    """
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98),
                                  weight_decay=0.0)
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
            checks.append([step, greedy_accuracy(model, tokenizer, task, task.validation)])
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
        out = model.generate(**enc, max_new_tokens=task.config.max_answer_length + 1,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(task.reward(None, texts, answer=[p.value for p in chunk]))
    model.train(was_training)
    return correct / len(problems)


# %% [markdown]
# Before the warm start the policy knows nothing: its loss is that of a uniform guess over the
# 19 ids, and it solves no held-out problem, so every RL reward would be 0. A few dozen steps
# of the warm start already move the loss onto the plateau of §0's plot.

# %%
import math

with torch.no_grad():
    untrained = policy(**sft_batch(task, task.train[:128], tokenizer)).loss.item()
print(f"untrained: loss {untrained:.2f} (a uniform guess: ln 19 = {math.log(19):.2f}), "
      f"held-out accuracy {greedy_accuracy(policy, tokenizer, task):.3f}")
few = WarmStartConfig(steps=20 if SMOKE else 60, target_accuracy=None)
short = warm_start(policy, tokenizer, task, few, progress=False)
print(f"after {len(short['losses'])} steps: loss {short['losses'][-1]:.2f}, "
      f"held-out accuracy {greedy_accuracy(policy, tokenizer, task):.3f}")

# %% [markdown]
# Building the policy takes minutes, so `load_default_policy` builds it once into a cache
# directory named by every setting that shapes it, and reads it back after. The build is the
# recipe of this notebook (tokenizer, policy, warm start, then greedy accuracy on each split
# for the report); writing it atomically into `$MINIRL_CACHE` and reading it back are
# `minirl/runtime/policy_cache.py`'s.

# %%
# | export minirl/models/policy.py
WARM_START_FORMAT = 2  # bump when the warm start's code changes what it produces


def default_policy_dir(task_config: TaskConfig = TaskConfig(),
                       policy_config: PolicyConfig = PolicyConfig(),
                       warm_config: WarmStartConfig = WarmStartConfig()) -> Path:
    """Where the warm-started policy for these configs lives (whether or not it exists yet)."""
    key = [WARM_START_FORMAT, asdict(task_config), asdict(policy_config), asdict(warm_config)]
    return policy_dir(key)


def load_default_policy(task_config: TaskConfig = TaskConfig(),
                        policy_config: PolicyConfig = PolicyConfig(),
                        warm_config: WarmStartConfig = WarmStartConfig(), device: str = "cpu",
                        progress: bool = True):
    """(model, tokenizer, path) of the warm-started policy, built first if not cached."""
    path = default_policy_dir(task_config, policy_config, warm_config)
    if not (path / "warm_start.json").exists():
        build_default_policy(path, task_config, policy_config, warm_config, progress=progress)
    model, tokenizer = read_policy(path, device)
    return model, tokenizer, path


# %% [markdown]
# The policy of §0, re-measured here from its checkpoint (on a CPU it repeats bit for bit).
# Training-set accuracy (on 500 training problems) and held-out accuracy come out close: the
# policy has learned a rule that carries over to pairs it never saw, not a table of sums.

# %%
model, tokenizer, path = load_default_policy(progress=False)
task = make_task()
accuracy = greedy_accuracy(model, tokenizer, task)
gap = abs(report["train_accuracy"] - accuracy)
print(f"held out: recorded {report['heldout_accuracy']:.3f}, re-measured now {accuracy:.3f}")
print(f"training and held out: {gap:.3f} apart ({'close' if gap < 0.1 else 'apart'}; rule: < 0.10)")
assert accuracy == report["heldout_accuracy"]
assert report["validation_accuracy"] >= WarmStartConfig().target_accuracy \
    or report["steps"] == WarmStartConfig().steps
assert 0.3 < accuracy < 0.75, "the warm start should leave a half-skilled policy"
assert gap < 0.1, "train and held-out accuracy should be close"

# %% [markdown]
# Is it the carries that the half-skilled policy gets wrong? Split the held-out problems by
# whether the ones digits carry:

# %%
carry = [q for q in task.test if q.a % 10 + q.b % 10 >= 10]
plain = [q for q in task.test if q.a % 10 + q.b % 10 < 10]
for name, part in (("a carry from the ones digit", carry), ("no carry from the ones digit", plain)):
    print(f"{name:>28}: {greedy_accuracy(model, tokenizer, task, part):.3f} ({len(part)} problems)")

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

hits = [sum(s == task.answer_text(p) for s in samples[4 * i: 4 * i + 4])
        for i, p in enumerate(task.test[:8])]
print(f"prompts with at least one right sample: {sum(h > 0 for h in hits)} of 8; "
      f"right samples: {sum(hits)} of {len(samples)}")

# %% [markdown]
# The saved directory is an ordinary Hugging Face checkpoint. Any tool that takes a model id
# takes this path: `AutoModelForCausalLM.from_pretrained(path)`, TRL's trainers, or
# `vllm serve <path>` on a GPU machine. Every chapter takes it, or any hub id, as `--model`
# through one loader, `load_policy` in `minirl/runtime/model_loading.py`, which pads on the
# left and uses EOS as the pad token where there is none, as TRL's trainers do.

# %%
print(sorted(f.name for f in path.iterdir()))

# %% [markdown]
# Read back naively, that directory loses the tokenizer we built: `AutoTokenizer` rebuilds it as
# a byte-level BPE that drops the spaces and the unknown character; `load_tokenizer` does not.

# %%
from transformers import AutoTokenizer

from minirl.runtime.policy_cache import load_tokenizer

text = "12 + 34 =Q"
for name, read in (("AutoTokenizer", AutoTokenizer.from_pretrained),
                   ("load_tokenizer", load_tokenizer)):
    loaded = read(path)
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    print(f"{name:15}", loaded.convert_ids_to_tokens(ids))

# %% [markdown]
# ## 5. The loop, once, by hand
#
# Here are steps 1 and 2 of the loop on four prompts, with the policy sampling eight
# completions for each, the *group* that GRPO compares: a sample's advantage is its reward
# minus the group's mean, over the group's spread. A group whose samples all agree, all right
# or all wrong, has advantage 0 everywhere and teaches nothing; that is why the warm start
# stops half-skilled. Notebook 01 adds the update (3) and the synchronization (4).

# %%
G = 8
rows = task.rows("train")[:4]
enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True,
                add_special_tokens=False)
with torch.no_grad():                                                          # 1. generate
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, temperature=1.0, top_k=0,
                         num_return_sequences=G, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
answers = [r["answer"] for r in rows for _ in range(G)]
rewards = torch.tensor(task.reward(None, completions, answer=answers)).view(-1, G)  # 2. reward
advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
for r, group, adv in zip(rows, rewards, advantages, strict=True):
    print(f"{r['prompt']:>7}  rewards {''.join(str(int(x)) for x in group)}  "
          f"advantages {' '.join(f'{a:+.1f}' for a in adv)}")
# 3. update and 4. synchronize: notebook 01.

# %% [markdown]
# ## 6. Your model, your task
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
# So the math verifier first finds the *final* answer: after the last `####` that starts a
# number, or inside the last `\boxed{}`, whichever comes later; a completion with neither
# counts only if it is a number and nothing else. Then it has two readers. A plain number,
# by far the most common, is read exactly and fast as a `Fraction` (`1,234` is 1234, `62.0`
# is 62, `−5` with a Unicode minus is -5). Anything else goes to math-verify, the symbolic
# checker behind TRL's `accuracy_reward`, which parses LaTeX into sympy: a millisecond or
# more an answer, too slow to be the first reader. Like `parse_answer`, neither reader
# raises. The text parsing is in `minirl/runtime/math_answer.py` (math-verify's wrapper in
# `minirl/runtime/latex_math.py`); here is what it reads:

# %%
from fractions import Fraction

from minirl.runtime.math_answer import final_answer, math_format_reward, math_reward

examples = natural + ["#### 1,234.", "#### $5 per hour", r"so \boxed{1{,}234}",
                      r"\boxed{5} ... #### 7",
                      "#### 62\n\n#### Verification: 31 + 31 = 62", r"\boxed{18 \text{ dollars}}",
                      r"\boxed{\frac{3}{4}}", "I think 61, no, 62", "#### ",
                      [{"role": "assistant", "content": "#### 62"}]]
for text in examples:
    found = final_answer(text)
    shown = found if found is None or isinstance(found, Fraction) else found[0]
    print(f"{str(text)[:44]!r:50} -> {shown}")

# %% [markdown]
# The rewards, with TRL's signature. `math_reward` is 1 when the final answer equals the
# row's `answer` (GSM8K's answer column is itself a worked solution ending in `#### N`, so it
# goes through the same reader): two numbers compare exactly, anything else through
# math-verify's `verify`, which knows that `\frac{1}{2}` is 0.5, `50\%` is 0.5 and `x = 62` is
# 62 (the last completion below states its value in passing, with no marker, and scores 0).
# `math_format_reward` pays for ending with a marked answer, right or wrong: a shaping
# signal that teaches the format before the arithmetic.

# %%
gsm8k_answer = ("Ava buys 3 * 4 = <<3*4=12>>12 pencils.\n"
                "She has 50 + 12 = <<50+12=62>>62 pencils now.\n#### 62")
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
# **One interface.** A `Task` (`minirl/tasks/task.py`) is the rows a run trains on, the rows
# it is judged on, and the weighted rewards that score both; `Task.evaluate` decodes each
# held-out prompt greedily and scores it: the mean weighted reward, each reward's mean, and
# the accuracy when one reward is a 0/1 correctness check. The embedded task is one `Task`
# (`arithmetic_task()`), and a data set with named rewards is another: `load_task` in
# `minirl/runtime/task_files.py` reads the chapters' `--dataset`, `--eval-dataset`,
# `--reward` and `--reward-weights` into one, and names every mistake before a model loads.
# Here is a task built by hand, from four rows and our verifier:

# %%
from minirl.tasks.task import Task, arithmetic_task

rows = task.rows("test")[:4]
by_hand = Task("four sums", train=rows, test=rows, reward_funcs=[arithmetic_reward],
               accuracy_reward="arithmetic_reward", max_new_tokens=4)
total, per_reward = by_hand.score(rows, [task.answer_text(task.test[0]), "12", "", "1"])
print("rewards of four made-up completions:", total.tolist(), per_reward)
print("its held-out evaluation, greedy:", by_hand.evaluate(model, tokenizer))

# %% [markdown]
# The embedded task through the interface gives exactly the held-out accuracy that
# `greedy_accuracy` computes, and the word problems load as a task with two weighted rewards
# (the embedded policy knows no letters, so it is not asked to solve them).

# %%
embedded_task = arithmetic_task()
evaluated = embedded_task.evaluate(model, tokenizer)
print(f"Task.evaluate: {evaluated}")
print(f"greedy_accuracy: {greedy_accuracy(model, tokenizer, task):.3f}")
assert evaluated["accuracy"] == greedy_accuracy(model, tokenizer, task)

# %%
import json
import tempfile

from minirl.runtime.task_files import load_task

with tempfile.TemporaryDirectory() as tmp:
    rows_file = os.path.join(tmp, "train.jsonl")
    with open(rows_file, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in problems["train"])
    words = load_task(rows_file, rewards=["math", "format"], reward_weights=[1.0, 0.5])
    print(words.name, len(words.train), "rows, rewards", words.reward_names,
          "weights", words.reward_weights)
    good = words.train[0]["answer"].split("\n")[-1]             # "#### N": right, well formed
    total, per_reward = words.score(words.train[:3], [good, "#### 0", "no idea"])
    print("weighted totals", total.tolist(), per_reward)

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

