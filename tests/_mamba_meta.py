"""vLLM Mamba-2 metadata for driving the plugin's Mamba mixers outside an engine (tests/test_vllm_hybrid.py,
tests/_tp_hybrid.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def mamba_meta(batch, device="cpu"):
    """vLLM Mamba-2 metadata for ``batch`` = [(slot, computed, new)], decodes (new == 1, computed > 0) first:
    (the batch in that order, the metadata)."""
    dec = [b for b in batch if b[2] == 1 and b[1] > 0]
    pre = [b for b in batch if not (b[2] == 1 and b[1] > 0)]
    qsl = [0]
    for b in pre:
        qsl.append(qsl[-1] + b[2])
    return dec + pre, SimpleNamespace(
        num_decodes=len(dec), num_prefills=len(pre), num_decode_tokens=len(dec), num_prefill_tokens=qsl[-1],
        seq_lens=torch.tensor([c + n for _, c, n in dec + pre], dtype=torch.int32, device=device),
        state_indices_tensor_d=torch.tensor([[s] for s, _, _ in dec], dtype=torch.int32, device=device).reshape(-1, 1),
        state_indices_tensor_p=torch.tensor([s for s, _, _ in pre], dtype=torch.int32, device=device),
        query_start_loc_p=torch.tensor(qsl, dtype=torch.int32, device=device))
