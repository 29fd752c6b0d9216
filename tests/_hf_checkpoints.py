"""Checkpoints written by transformers itself (issue #16 item 1), for the tests and ``docs/robustness.md``.

``python tests/_hf_checkpoints.py OUT_DIR [NAME ...]`` writes one folder per built-in tiny config:
``AutoModelForCausalLM.from_config(cfg, dtype=bfloat16).save_pretrained(dir)`` (random weights, seeded) plus a
tokenizer trained here (``tokenizers`` BPE on a small text, ``tokenizer.json``; ``tokenizer_config.json`` with a chat
template).  Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
_TEXT = """The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital of France.
Write a haiku about the sea. The sea is wide and blue, waves roll in and out. Explain what a hash table is: a table of
buckets indexed by a hash of the key. List three prime numbers: two, three, five. How do I reverse a list in Python?
Use reversed or slicing. Translate good morning into German: guten Morgen. Why is the sky blue? Rayleigh scattering of
sunlight. Give me a name for a grey cat. Smokey. What is 17 times 3? It is 51. Summarize the plot of Hamlet in two
sentences. A prince avenges his father and everyone dies. Suggest a title for a talk about numerical determinism.
What does a compiler do? It translates source code into machine code. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000."""


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT] * 4, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 512}, indent=1))


def write_checkpoint(name: str, out: Path, tokenizer: bool = True, seed: int = 0) -> Path:
    """transformers' own checkpoint of the built-in config ``name`` (bfloat16, seeded random weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_consistent.config import builtin_model_dir

    out = Path(out)
    cfg = AutoConfig.from_pretrained(str(builtin_model_dir(name)))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    if tokenizer and cfg.vocab_size >= 300:  # byte-level BPE needs its 256-symbol alphabet + specials
        write_tokenizer(out, cfg.vocab_size)
    return out


if __name__ == "__main__":
    from megatron_consistent.config import builtin_model_dir

    root = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.name for p in builtin_model_dir().parent.iterdir() if (p / "config.json").is_file())
    for n in names:
        print(n, write_checkpoint(n, root / n))
