"""Paged KV cache: write new K/V into slots, gather a request's K/V from its pages.

Layout: one tensor per layer of shape ``[num_blocks, num_kv_heads,
block_size, 2 * head_dim]`` — K in the first ``head_dim`` channels, V in the
rest; slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
Both operations are pure index copies: exact, so they add nothing to the
numerics contract.  Gathered K/V are zero beyond each request's length (never
uninitialised memory), which :func:`attention` masks.
"""

from __future__ import annotations

import torch


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key, value [N, Hkv, D]`` at ``slot_mapping [N]`` (negative slots are padding, skipped)."""
    d = key.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    block, offset = slots // cache.shape[2], slots % cache.shape[2]
    cache[block, :, offset, :d] = key[keep].to(cache.dtype)
    cache[block, :, offset, d:] = value[keep].to(cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None):
    """``(k, v)`` of shape ``[R, max_len, Hkv, D]`` for requests with pages ``block_table [R, P]``."""
    block_size = cache.shape[2]
    d = cache.shape[3] // 2
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pos = torch.arange(max_len, device=cache.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.device)
    pages = torch.where(valid, block_table[:, pos // block_size].to(torch.int64), 0)
    kv = cache[pages, :, (pos % block_size)[None, :].expand_as(pages)]  # [R, T, Hkv, 2D]
    kv = torch.where(valid[:, :, None, None], kv, torch.zeros((), dtype=cache.dtype, device=cache.device))
    return kv[..., :d], kv[..., d:]
