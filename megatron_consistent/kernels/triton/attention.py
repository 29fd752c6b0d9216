"""Causal GQA attention for CUDA (Triton): one kernel for training, prefill, chunked prefill and decode.

GPU numerics contract (one query row = one (token, query head)):

* keys are visited in blocks of ``KV_BLOCK_GPU`` (64) aligned at absolute
  position 0, in increasing order, from block 0 up to the block holding the
  last key the row may see — for every way the query reaches the kernel
  (whole sequence, prefill chunk over a cached prefix, decode step);
* raw scores ``s = q . k`` by the tensor cores (bf16/fp16 inputs, float32
  accumulate, head dim in increasing 16-wide steps); invisible keys get ``-inf``;
* online softmax in float32 on raw scores: ``m' = max(m, max_j s)``,
  ``alpha = exp2((m - m') * c)``, ``p = exp2((s - m') * c)`` with
  ``c = scale * log2(e)`` (subtract first, then scale: no FMA contraction can
  change a row's bits between masked and unmasked blocks);
* ``p`` is rounded to the input dtype; ``acc = mma(p, v, acc * alpha)`` and
  ``l = mma(p, 1, l * alpha)`` — the normaliser is summed by the tensor cores
  over the same rounded ``p`` as the numerator, so no layout-dependent
  reduction enters a row's result (the row max is exact);
* ``out = round(acc / l)``; ``lse = (m * c + log2(l)) * ln2``; a row with no
  visible key (or position -1) gives ``out = 0``, ``lse = -inf``.

Query rows of one (batch, kv head) are packed (token-major, then the ``G``
query heads that share the kv head) into tiles of 16, 64 or 128 rows by the
number of rows; a row's arithmetic does not depend on the tile it lands in
(tests/test_gpu_kernels.py checks this bitwise).  No split over the KV axis
is used, so decode and prefill run the same per-row recurrence.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ._common import next_pow2

KV_BLOCK_GPU = 64
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _attn_block(q, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt, m_i, l_mat, acc, ones,
                MASKED: tl.constexpr, qk_scale):
    kpos = start + offs_n
    if MASKED:
        kin = kpos < Tk
        k = tl.load(kb + kpos[:, None] * skt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
        v = tl.load(vb + kpos[:, None] * svt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
    else:
        k = tl.load(kb + kpos[:, None] * skt + d[None, :], mask=dm[None, :], other=0.0)
        v = tl.load(vb + kpos[:, None] * svt + d[None, :], mask=dm[None, :], other=0.0)
    s = tl.dot(q, k.T)
    if MASKED:
        vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < kl)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2((m_i - m_ref) * qk_scale)
    p = tl.math.exp2((s - m_ref[:, None]) * qk_scale)
    pb = p.to(v.dtype)
    l_mat = tl.dot(pb, ones, l_mat * alpha[:, None])
    acc = tl.dot(pb, v, acc * alpha[:, None])
    return m_new, l_mat, acc


@triton.jit(do_not_specialize=["Tq", "Tk", "HQ", "HKV"])
def _attn_kernel(Q, K, V, QPOS, KLEN, O, LSE, qk_scale,
                 Tq, Tk, HQ, HKV,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, spb, spt,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (latest) tiles first
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // G
    hq = kvh * G + (r % G)
    rv = t < Tq
    pos = tl.load(QPOS + b * spb + t * spt, mask=rv, other=-1)
    kl = tl.minimum(tl.load(KLEN + b), Tk).to(tl.int32)
    pos = pos.to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(Q + b * sqb + t[:, None] * sqt + hq[:, None] * sqh + d[None, :],
                mask=rv[:, None] & dm[None, :], other=0.0)
    active = pos >= 0
    hi = tl.minimum(tl.max(pos, 0) + 1, kl)
    full = tl.minimum(tl.min(tl.where(active, pos + 1, 1 << 30), 0), kl)
    full = tl.maximum((full // BLOCK_N) * BLOCK_N, 0)
    full = tl.minimum(full, tl.maximum(hi, 0))

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_mat = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    ones = tl.full((BLOCK_N, 16), 1.0, dtype=Q.dtype.element_ty)
    offs_n = tl.arange(0, BLOCK_N)
    kb = K + b.to(tl.int64) * skb + kvh * skh
    vb = V + b.to(tl.int64) * svb + kvh * svh
    for start in tl.range(0, full, BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_mat, acc = _attn_block(q, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt,
                                      m_i, l_mat, acc, ones, False, qk_scale)
    for start in tl.range(full, hi, BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_mat, acc = _attn_block(q, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt,
                                      m_i, l_mat, acc, ones, True, qk_scale)

    l_i = tl.max(l_mat, 1)  # all 16 columns are equal
    empty = (l_i == 0.0) | (pos < 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = (m_i * qk_scale + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    lse = tl.where(empty, float("-inf"), lse)
    tl.store(O + b * sob + t[:, None] * sot + hq[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
             mask=rv[:, None] & dm[None, :])
    tl.store(LSE + (b * HQ + hq).to(tl.int64) * Tq + t, lse, mask=rv)


_FORCE_BLOCK_M = int(os.environ.get("MC_ATTN_BLOCK_M", "0"))


def _tile_for(rows: int, forced: int = 0) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) by the number of packed query rows (numerics-neutral)."""
    bm = forced or _FORCE_BLOCK_M or (16 if rows <= 16 else 64 if rows <= 64 else 128)
    return bm, (8 if bm >= 128 else 4), (3 if bm >= 64 else 4)


def attention_fwd(q, k, v, q_positions, k_lengths, scale, block_m: int = 0):
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"attention (cuda): q must be bf16/fp16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("attention (cuda): q, k, v must share a dtype")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    g = hq // hkv
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, tq), dtype=torch.float32, device=q.device)
    if b == 0 or tq == 0:
        return out, lse
    qpos = q_positions.to(device=q.device, dtype=torch.int64)
    klen = k_lengths.to(device=q.device, dtype=torch.int64)
    rows = tq * g
    bm, warps, stages = _tile_for(rows, block_m)
    grid = (triton.cdiv(rows, bm), b * hkv)
    _attn_kernel[grid](
        q, k, v, qpos, klen, out, lse, float(scale) * _LOG2E,
        tq, tk, hq, hkv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        qpos.stride(0), qpos.stride(1),
        G=g, D=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=bm, BLOCK_N=KV_BLOCK_GPU, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


@register("attention", "cuda")
def _attention_cuda(q, k, v, q_positions, k_lengths, scale):
    return attention_fwd(q, k, v, q_positions, k_lengths, scale)
