"""A tiny random Qwen2 with a byte-level BPE tokenizer, built locally (no hub): what a real model looks like.

The embedded policy's character tokenizer knows 15 characters; a real checkpoint's byte-level
BPE maps every string to tokens, has an EOS distinct from its pad token, and an Instruct
model's tokenizer carries a chat template. This one is trained on the word problems in a
second, with Qwen's special tokens and (optionally) a ChatML template like Qwen2.5-Instruct's.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from minirl.tasks.word_problems import generate

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_bpe_tokenizer(chat_template: bool = True, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    rows = generate(n_train=200, n_test=10, seed=1)
    corpus = [r["prompt"] + " " + r["answer"] for r in rows["train"]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>" if chat_template else
                                        "<|endoftext|>", pad_token="<|endoftext|>", model_max_length=512)
    if chat_template:
        tokenizer.chat_template = CHATML
    return tokenizer


def save_tiny_bpe_model(path, chat_template: bool = True, seed: int = 0) -> Path:
    """Save a 2-layer Qwen2 (hidden 32, random weights) and its BPE tokenizer to `path`."""
    path = Path(path)
    tokenizer = build_bpe_tokenizer(chat_template)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
