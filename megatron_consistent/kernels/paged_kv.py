"""Paged KV cache: write new K/V into slots, gather a request's K/V from its pages.

Layout (ours, declared by the plugin's attention backend): one tensor per
layer of shape ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; slot
``s`` is ``(s // block_size, s % block_size)``.  Both operations are pure
index copies: exact, so they add nothing to the numerics contract.  Gathered
K/V are zero beyond each request's length, which :func:`attention` masks.
"""

from __future__ import annotations

import torch


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key, value [N, Hkv, D]`` at ``slot_mapping [N]`` (negative slots are skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[0].index_copy_(0, slots, key[keep].to(cache.dtype))
    flat[1].index_copy_(0, slots, value[keep].to(cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None):
    """``(k, v)`` of shape ``[R, max_len, Hkv, D]`` for requests with pages ``block_table [R, P]``."""
    block_size = cache.shape[2]
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pos = torch.arange(max_len, device=cache.device)
    pages = block_table[:, pos // block_size].to(torch.int64)
    slots = pages * block_size + (pos % block_size)[None, :]
    valid = pos[None, :] < seq_lens[:, None]
    slots = torch.where(valid, slots, 0)
    flat = cache.view(2, -1, *cache.shape[3:])
    k = flat[0][slots]
    v = flat[1][slots]
    zero = torch.zeros((), dtype=cache.dtype, device=cache.device)
    mask = valid[:, :, None, None]
    return torch.where(mask, k, zero), torch.where(mask, v, zero)
