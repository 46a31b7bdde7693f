"""Workloads for measuring generation: a larger policy with a long tail of completion lengths, and prompts.

`load_long_tail_policy()` builds (once, cached under $MINIRL_CACHE like the embedded policy)
a Qwen2 causal LM of about 8 M parameters with a 70-token character vocabulary and random
weights. Random weights are the point: its logits are nearly uniform, so every step emits
EOS with probability about 1/70 and completion lengths are close to geometric (mean ~70,
median ~50, a few percent run into a 256-token cap). That is the long tail of an RL batch -
most completions stop early, a few run long - produced by the model itself, so HF
`generate`, TRL and the paged engine all see EOS the same way, with no engine-specific
stopping rule. Training it to write real text would cost more CPU time than all the
benchmarks together and would not change the cost of a token.

`few_shot_prompts(n, length)` makes prompts of about `length` characters from the
arithmetic task (solved examples, then one question), the ~64-token prompts of the
long-tail workload; `load_draft_policy()` is a small warm-started draft for speculation.

Hand-written (benchmark plumbing: the models and prompts the measurements run on); notebook
05, its chapter and the benchmarks load them from here.
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
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.models.policy import BOS, EOS, PAD, PolicyConfig, load_default_policy
from minirl.runtime.policy_cache import cache_dir, load_tokenizer
from minirl.tasks.arithmetic import make_task

LONG_TAIL_CHARACTERS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz.,:;?!()[]{}<>/|&%$#@^~_'\""


@dataclass(frozen=True)
class LongTailConfig:
    """The larger policy: 8 layers of width 256, 4 query heads sharing 1 key/value head (GQA 4:1)."""

    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 1
    intermediate_size: int = 1024
    max_length: int = 512
    seed: int = 0


def long_tail_tokenizer(max_length: int = 512) -> PreTrainedTokenizerFast:
    """One token per character of LONG_TAIL_CHARACTERS, after <pad>, <bos>, <eos> (ids 0, 1, 2)."""
    vocab = {PAD: 0, BOS: 1, EOS: 2} | {c: 3 + i for i, c in enumerate(LONG_TAIL_CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    # unk_token named: without one, a reload next to a Qwen2 config.json (AutoTokenizer picks
    # Qwen2Tokenizer) adds '<|endoftext|>' as a 71st id the model does not embed.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=PAD, model_max_length=max_length)
    tokenizer.padding_side = "left"
    return tokenizer


def build_long_tail_policy(config: LongTailConfig = LongTailConfig()):
    """(model, tokenizer): a randomly initialized Qwen2 sized by `config` (seeded), in eval mode."""
    tokenizer = long_tail_tokenizer(config.max_length)
    torch.manual_seed(config.seed)
    qwen = Qwen2Config(vocab_size=len(tokenizer), hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                       num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                       max_position_embeddings=config.max_length, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(qwen).eval(), tokenizer


def load_long_tail_policy(config: LongTailConfig = LongTailConfig(), device: str = "cpu"):
    """(model, tokenizer, path) of the larger policy, saved once as an ordinary HF checkpoint."""
    key = json.dumps(asdict(config) | {"unk_token": PAD}, sort_keys=True)   # a cache from before unk_token: rebuilt
    path = cache_dir() / f"long-tail-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").exists():
        model, tokenizer = build_long_tail_policy(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, path)               # atomic: readers see all of it or none of it
        except OSError:                         # another process finished first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    tokenizer = load_tokenizer(path)   # as saved (AutoTokenizer would rebuild it as a byte-level BPE)
    tokenizer.padding_side = "left"
    return model, tokenizer, path


DRAFT_POLICY = PolicyConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


def load_draft_policy(device: str = "cpu", progress: bool = False):
    """(model, tokenizer, path): a ~125 k-parameter policy warm-started like the embedded one (notebook 00).

    Same tokenizer and task as the embedded policy, about 8x fewer parameters: a draft for
    speculative decoding. Built once (about half a minute) and cached like the embedded policy.
    """
    return load_default_policy(policy_config=DRAFT_POLICY, device=device, progress=progress)


def few_shot_rows(n: int, length: int = 64, seed: int = 0) -> list[dict]:
    """n dataset rows {"prompt", "answer"}: solved sums of the arithmetic task, then one to solve.

    Each prompt is about `length` characters ("39+87=126,95+15=110,...,53+45="); the answer is
    the last sum's value, so the task's reward function scores completions as usual.
    """
    rows = make_task().rows("train")
    generator = torch.Generator().manual_seed(seed)
    pick = lambda: rows[int(torch.randint(len(rows), (1,), generator=generator))]   # noqa: E731
    out = []
    for _ in range(n):
        last = pick()
        text = ""
        while len(text) + len(last["prompt"]) < length:
            row = pick()
            text += f"{row['prompt']}{row['answer']},"
        out.append({"prompt": text + last["prompt"], "answer": last["answer"]})
    return out


def few_shot_prompts(n: int, length: int = 64, seed: int = 0) -> list[str]:
    """The prompts of `few_shot_rows(n, length, seed)`."""
    return [row["prompt"] for row in few_shot_rows(n, length, seed)]
