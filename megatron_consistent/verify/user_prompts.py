"""Prompts for ``check --checkpoint``: a JSONL file, or the built-in chat prompts through the checkpoint's tokenizer.

``--prompts FILE``: one JSON object per line, ``{"text": "..."}`` (needs a tokenizer in the checkpoint; a chat template,
when the tokenizer has one, is not applied: the text is the prompt) or ``{"token_ids": [...]}``.  Without ``--prompts``:
:data:`CHAT_PROMPTS`, each as one user turn through the tokenizer's chat template (``add_generation_prompt``) when the
checkpoint has a tokenizer with a template, as plain text when it has a tokenizer without one, and the seeded token-id
prompts of ``check`` when it has none.  Everything is validated (ids inside the vocabulary, lengths within
``max_model_len``) before any engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into German.",
    "Why is the sky blue?",
    "Give me a name for a grey cat.",
    "What is 17 times 3?",
    "Summarize the plot of Hamlet in two sentences.",
    "Suggest a title for a talk about numerical determinism.",
    "What does a compiler do?",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(checkpoint: str | Path) -> bool:
    return any((Path(checkpoint) / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(checkpoint: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint))
    except Exception as e:  # noqa: BLE001 - any tokenizer load failure is bad input, named
        raise ValueError(f"--checkpoint {str(checkpoint)!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


def read_prompt_file(path: str | Path) -> list[dict]:
    """The JSONL records (validated shape: exactly one of ``text`` / ``token_ids``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--prompts {str(p)!r}: no such file")
    records = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {p.name} line {n}: not JSON ({e.msg})") from None
        if not isinstance(r, dict) or len({"text", "token_ids"} & r.keys()) != 1:
            raise ValueError(f'--prompts {p.name} line {n}: expected {{"text": "..."}} or {{"token_ids": [...]}}')
        if "text" in r and (not isinstance(r["text"], str) or not r["text"]):
            raise ValueError(f"--prompts {p.name} line {n}: text must be a non-empty string")
        if "token_ids" in r and (not isinstance(r["token_ids"], list) or not r["token_ids"] or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r["token_ids"])):
            raise ValueError(f"--prompts {p.name} line {n}: token_ids must be a non-empty list of integers >= 0")
        records.append(r)
    if not records:
        raise ValueError(f"--prompts {p.name}: no prompts")
    return records


def checkpoint_prompts(checkpoint: str | Path, prompts_file: str, vocab_size: int, num_prompts: int, max_tokens: int,
                       max_model_len: int, fallback) -> tuple[list[list[int]], str]:
    """(token-id prompts, a description of their source); ``fallback()``: the seeded token-id prompts."""
    tok = load_tokenizer(checkpoint) if has_tokenizer(checkpoint) else None
    if prompts_file:
        records = read_prompt_file(prompts_file)
        if tok is None and any("text" in r for r in records):
            raise ValueError(f"--prompts has text prompts but {str(checkpoint)!r} has no tokenizer (give token_ids)")
        prompts = [r["token_ids"] if "token_ids" in r else tok(r["text"], add_special_tokens=True)["input_ids"] for r in records]
        source = f"file {prompts_file}"
    elif tok is not None:
        chat = getattr(tok, "chat_template", None)
        texts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(num_prompts)]
        if chat:
            prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for t in texts]
            source = "built-in chat prompts through the checkpoint's chat template"
        else:
            prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
            source = "built-in chat prompts as plain text (the tokenizer has no chat template)"
    else:
        return fallback(), "seeded token-id prompts (the checkpoint has no tokenizer)"
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty after tokenization")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:6]} are outside the model's vocabulary (vocab_size {vocab_size})")
        if len(p) + max_tokens > max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens {max_tokens} exceed max_model_len {max_model_len}")
    return prompts, source
