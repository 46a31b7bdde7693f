# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""The embedded policy: a character tokenizer, a tiny Qwen2 model, and its warm start.

`load_default_policy()` builds it once into the cache (`minirl.runtime.policy_cache`) and reads it
back, an ordinary Hugging Face checkpoint. Simplified on purpose: the warm start is a plain
supervised loop rather than TRL's SFTTrainer: it fits on one screen and runs deterministically.
"""

__all__ = ["PAD", "BOS", "EOS", "UNK", "CHARACTERS", "build_tokenizer", "PolicyConfig",
           "build_policy", "sft_example", "sft_batch", "WarmStartConfig", "warm_start",
           "greedy_accuracy", "WARM_START_FORMAT", "default_policy_dir", "load_default_policy"]

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
