"""INTERIM (replaced by the paged Triton kernel): paged attention as a block-table gather + the dense kernel.

No host synchronisation: every index is computed on the device.
"""

from __future__ import annotations

import torch

from ..fp8 import kv_dequantize
from .attention import attention_fwd

PAGE_SIZES = (16, 32, 64, 128)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, kv_scale=None):
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    ok = slots >= 0
    page, off = torch.where(ok, slots // k_cache.shape[1], 0), torch.where(ok, slots % k_cache.shape[1], 0)
    k, v = key[:n], value[:n]
    if kv_scale is not None:
        from ..fp8 import kv_quantize

        k, v = kv_quantize(k), kv_quantize(v)
    keep_k = k_cache[page, off]
    keep_v = v_cache[page, off]
    m = ok[:, None, None]
    k_cache[page, off] = torch.where(m, k.to(k_cache.dtype), keep_k)
    v_cache[page, off] = torch.where(m, v.to(v_cache.dtype), keep_v)


def paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, out, max_query_len: int,
                    max_seq_len: int, kv_scale=None):
    num_seqs = block_table.shape[0]
    t = q.shape[0]
    qsl = query_start_loc.to(torch.int64)
    tok = torch.arange(t, device=q.device)
    seq = (torch.searchsorted(qsl[1:], tok, right=True)).clamp(max=num_seqs - 1)
    covered = tok < qsl[-1]
    off = tok - qsl[seq]
    q_lens = qsl[1:] - qsl[:-1]
    page = k_cache.shape[1]
    k = k_cache[block_table.to(torch.int64)].flatten(1, 2)  # [S, pages*page, H, D]
    v = v_cache[block_table.to(torch.int64)].flatten(1, 2)
    if kv_scale is not None:
        k, v = kv_dequantize(k, q.dtype), kv_dequantize(v, q.dtype)
    qd = torch.zeros(num_seqs, max_query_len, *q.shape[1:], dtype=q.dtype, device=q.device)
    offc = torch.where(covered, off, 0).clamp(max=max_query_len - 1)
    qd[seq, offc] = torch.where(covered[:, None, None], q, qd[seq, offc])
    qpos = seq_lens.to(torch.int64)[:, None] - q_lens[:, None] + torch.arange(max_query_len, device=q.device)[None, :]
    qpos = torch.where(torch.arange(max_query_len, device=q.device)[None, :] < q_lens[:, None], qpos, -1)
    o, _ = attention_fwd(qd, k, v, qpos, seq_lens, scale)
    res = o[seq, offc]
    out.copy_(torch.where(covered[:, None, None], res, torch.zeros_like(res)).reshape(out.shape))
    return out
