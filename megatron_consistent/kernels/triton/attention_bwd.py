"""Deterministic causal GQA attention backward for CUDA (Triton, FlashAttention-2 style).

Registered as ``("attention_backward", "cuda")``; :class:`kernels.attention.AttentionFunction`
calls it instead of the materialised-softmax torch backward when the tensors live on CUDA.

    fn(grad_out, q, k, v, out, lse, q_positions, k_lengths, scale) -> (dq, dk, dv)

Shapes/dtypes as the forward: ``q, out, grad_out, dq [B, Tq, Hq, D]``,
``k, v, dk, dv [B, Tk, Hkv, D]``, ``lse [B, Hq, Tq]`` float32 natural-log
(``(m*c + log2 l) * ln2`` from :mod:`.attention`, ``-inf`` for empty rows).

Algorithm (never materialises ``[Tq, Tk]``):

* ``delta = rowsum(float32(dO) * float32(O))`` (one small kernel, fixed in-row reduction);
* probabilities are recomputed exactly as the forward scales them:
  ``p = exp2(s * c - lse * log2(e))`` with raw tensor-core scores ``s = q . k`` and
  ``c = scale * log2(e)``; masked (key ``j`` visible iff ``j <= q_position`` and
  ``j < k_length``; position ``-1`` rows see nothing) and ``dS = p * (dP - delta)`` in float32;
* dK/dV: one program per (batch, kv head, 64-key block).  It loops over the query heads of
  its group (in order) and, for each, over the query blocks that can see the key block
  (in increasing order), accumulating ``dV += p^T dO`` and ``dK += dS^T Q`` in float32
  registers; GQA heads are therefore summed inside the program, with no atomics;
* dQ: one program per (batch, query head, query block) looping over the visible key
  blocks in increasing order, ``dQ += dS K`` in float32 registers.

``p``/``dS`` enter the tensor cores rounded to the input dtype (bf16/fp16), as in
FlashAttention-2; accumulation is float32.  Every reduction order is fixed by the
shapes alone, so two backward passes over the same inputs give the same bits (not
batch-invariant: the blocking of query rows depends on Tq).

Which query blocks a key block needs (and which of them are fully visible, so that the
mask can be skipped) comes from a tiny host-side table built from ``q_positions`` with
torch ops (no synchronisation): prefix/suffix maxima and minima of per-block
positions, so arbitrary (unsorted, padded) positions stay correct and causal training
sequences get the exact triangular work.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ..numerics import LOG2E
from ._common import next_pow2


# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages); numerics-neutral except for the
# blocking of the fixed summation order.  Overridable for tuning: MC_ATTN_BWD_DKDV / _DQ = "M,N,W,S".
_DKDV_CFG = (64, 64, 4, 2)
_DQ_CFG = (64, 64, 4, 2)


def _cfg(env: str, default: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    val = os.environ.get(env)
    return tuple(int(x) for x in val.split(",")) if val else default  # type: ignore[return-value]


@triton.jit
def _delta_kernel(O, DO, DELTA, Tq, HQ, sob, sot, soh, sdb, sdt, sdh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    msk = (t < Tq)[:, None] & (d < D)[None, :]
    o = tl.load(O + b.to(tl.int64) * sob + t[:, None] * sot + h * soh + d[None, :], mask=msk, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + t[:, None] * sdt + h * sdh + d[None, :], mask=msk, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * HQ + h).to(tl.int64) * Tq + t, delta, mask=t < Tq)


@triton.jit
def _dkdv_step(dk, dv, k, v, qb, dob, lseb, deltab, posb, m0, offs_m, d, dm, kpos, kl, Tq,
               sqt, sdot, spt, qk_scale, MASKED: tl.constexpr):
    t = m0 + offs_m
    tv = t < Tq
    q = tl.load(qb + t[:, None] * sqt + d[None, :], mask=tv[:, None] & dm[None, :], other=0.0)
    do = tl.load(dob + t[:, None] * sdot + d[None, :], mask=tv[:, None] & dm[None, :], other=0.0).to(q.dtype)
    lse2 = tl.load(lseb + t, mask=tv, other=0.0) * 1.4426950408889634
    delta = tl.load(deltab + t, mask=tv, other=0.0)
    st = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M] raw scores, transposed
    pt = tl.math.exp2(st * qk_scale - lse2[None, :])
    if MASKED:
        pos = tl.load(posb + t * spt, mask=tv, other=-1).to(tl.int32)
        vis = (kpos[:, None] <= pos[None, :]) & (kpos[:, None] < kl)
        pt = tl.where(vis, pt, 0.0)
    dv = tl.dot(pt.to(q.dtype), do, dv)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["Tq", "Tk", "HQ", "HKV", "NKB"])
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, QPOS, KLEN, TAB, DK, DV, qk_scale, scale,
                 Tq, Tk, HQ, HKV, NKB,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, spb, spt,
                 sdkb, sdkt, sdkh, sdvb, sdvt, sdvh,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.num_programs(0) - 1 - tl.program_id(0)  # key blocks near the start see the most queries
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    b64 = b.to(tl.int64)
    kpos = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kin = kpos < Tk
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    k = tl.load(K + b64 * skb + kvh * skh + kpos[:, None] * skt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
    v = tl.load(V + b64 * svb + kvh * svh + kpos[:, None] * svt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
    kl = tl.minimum(tl.load(KLEN + b), Tk).to(tl.int32)
    tab = TAB + (b64 * NKB + pid_n) * 3
    lo = tl.load(tab).to(tl.int32) * BLOCK_M
    mid = tl.load(tab + 1).to(tl.int32) * BLOCK_M
    hi = tl.load(tab + 2).to(tl.int32) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    posb = QPOS + b64 * spb
    for g in range(0, G):  # fixed order over the query heads sharing this kv head
        hq = kvh * G + g
        qb = Q + b64 * sqb + hq * sqh
        dob = DO + b64 * sdob + hq * sdoh
        lseb = LSE + (b * HQ + hq).to(tl.int64) * Tq
        deltab = DELTA + (b * HQ + hq).to(tl.int64) * Tq
        for m0 in tl.range(lo, mid, BLOCK_M, num_stages=NUM_STAGES):
            dk, dv = _dkdv_step(dk, dv, k, v, qb, dob, lseb, deltab, posb, m0, offs_m, d, dm, kpos, kl, Tq,
                                sqt, sdot, spt, qk_scale, True)
        for m0 in tl.range(mid, hi, BLOCK_M, num_stages=NUM_STAGES):
            dk, dv = _dkdv_step(dk, dv, k, v, qb, dob, lseb, deltab, posb, m0, offs_m, d, dm, kpos, kl, Tq,
                                sqt, sdot, spt, qk_scale, False)
    dk = dk * scale
    smask = kin[:, None] & dm[None, :]
    tl.store(DK + b64 * sdkb + kvh * sdkh + kpos[:, None] * sdkt + d[None, :], dk.to(DK.dtype.element_ty), mask=smask)
    tl.store(DV + b64 * sdvb + kvh * sdvh + kpos[:, None] * sdvt + d[None, :], dv.to(DV.dtype.element_ty), mask=smask)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt, qk_scale,
             MASKED: tl.constexpr):
    kpos = start + offs_n
    if MASKED:
        kin = kpos < Tk
        k = tl.load(kb + kpos[:, None] * skt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
        v = tl.load(vb + kpos[:, None] * svt + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
    else:
        k = tl.load(kb + kpos[:, None] * skt + d[None, :], mask=dm[None, :], other=0.0)
        v = tl.load(vb + kpos[:, None] * svt + d[None, :], mask=dm[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k))
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < kl)
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(q.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["Tq", "Tk", "HQ", "HKV"])
def _dq_kernel(Q, K, V, DO, LSE, DELTA, QPOS, KLEN, DQ, qk_scale, scale,
               Tq, Tk, HQ, HKV,
               sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, spb, spt, sdqb, sdqt, sdqh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (latest) tiles first
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    hq = pid_bh % HQ
    kvh = hq // G
    b64 = b.to(tl.int64)
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tv = t < Tq
    pos = tl.load(QPOS + b64 * spb + t * spt, mask=tv, other=-1).to(tl.int32)
    kl = tl.minimum(tl.load(KLEN + b), Tk).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qmask = tv[:, None] & dm[None, :]
    q = tl.load(Q + b64 * sqb + hq * sqh + t[:, None] * sqt + d[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + b64 * sdob + hq * sdoh + t[:, None] * sdot + d[None, :], mask=qmask, other=0.0).to(q.dtype)
    active = pos >= 0
    rowb = (b * HQ + hq).to(tl.int64) * Tq
    lse = tl.load(LSE + rowb + t, mask=tv, other=0.0)
    # inactive rows: lse2 = +inf makes p = exp2(-inf) = 0 even on the unmasked path
    lse2 = tl.where(active, lse * 1.4426950408889634, float("inf"))
    delta = tl.load(DELTA + rowb + t, mask=tv, other=0.0)
    hi = tl.minimum(tl.max(pos, 0) + 1, kl)
    full = tl.minimum(tl.min(tl.where(active, pos + 1, 1 << 30), 0), kl)
    full = tl.maximum((full // BLOCK_N) * BLOCK_N, 0)
    full = tl.minimum(full, tl.maximum(hi, 0))
    offs_n = tl.arange(0, BLOCK_N)
    kb = K + b64 * skb + kvh * skh
    vb = V + b64 * svb + kvh * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in tl.range(0, full, BLOCK_N, num_stages=NUM_STAGES):
        dq = _dq_step(dq, q, do, lse2, delta, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt, qk_scale, False)
    for start in tl.range(full, hi, BLOCK_N, num_stages=NUM_STAGES):
        dq = _dq_step(dq, q, do, lse2, delta, kb, vb, start, offs_n, d, dm, pos, kl, Tk, skt, svt, qk_scale, True)
    dq = dq * scale
    tl.store(DQ + b64 * sdqb + hq * sdqh + t[:, None] * sdqt + d[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


def _query_block_table(qpos: torch.Tensor, klen: torch.Tensor, tk: int, block_m: int, block_n: int) -> torch.Tensor:
    """int32 [B, nkb, 3]: per key block, query blocks [lo, mid) need the mask, [mid, hi) are fully visible.

    Blocks outside [lo, hi) see none of the key block; blocks in [mid, hi) have every row
    active with position >= the block's last key, and the block lies below k_length.
    """
    b, tq = qpos.shape
    nqb = triton.cdiv(tq, block_m)
    nkb = triton.cdiv(tk, block_n)
    qp = torch.nn.functional.pad(qpos, (0, nqb * block_m - tq), value=-1).view(b, nqb, block_m)
    qmax, qmin = qp.amax(-1), qp.amin(-1)
    pref_max = qmax.cummax(-1).values
    suf_max = qmax.flip(-1).cummax(-1).values.flip(-1)
    starts = torch.arange(nkb, device=qpos.device, dtype=qpos.dtype) * block_n
    lo = (pref_max[:, None, :] < starts[None, :, None]).sum(-1)
    hi = torch.maximum((suf_max[:, None, :] >= starts[None, :, None]).sum(-1), lo)
    kl = torch.clamp(klen, max=tk)[:, None]
    hi = torch.where(starts[None, :] < kl, hi, lo)
    # mid: start of the trailing run of fully visible blocks inside [lo, hi)
    j = torch.arange(nqb, device=qpos.device)
    bad = (qmin[:, None, :] < (starts + block_n - 1)[None, :, None]) & (j[None, None, :] < hi[:, :, None])
    mid = torch.where(bad, j[None, None, :], -1).amax(-1) + 1
    mid = torch.where((starts + block_n)[None, :] <= kl, mid, hi)
    mid = torch.minimum(torch.maximum(mid, lo), hi)
    return torch.stack([lo, mid, hi], dim=-1).to(torch.int32).contiguous()


def attention_bwd(grad_out, q, k, v, out, lse, q_positions, k_lengths, scale, dkdv_cfg=None, dq_cfg=None):
    """(dq, dk, dv) of the causal GQA attention (see the module docstring)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention_backward (cuda): q, k, v must share a bf16/fp16 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v, out, grad_out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, out, grad_out))
    lse = lse.to(torch.float32).contiguous()
    g = hq // hkv
    dq = torch.empty((b, tq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, tk, hkv, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, tk, hkv, d), dtype=v.dtype, device=q.device)
    if b == 0 or tk == 0 or d == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if tq == 0:
        return dq, dk.zero_(), dv.zero_()
    qpos = q_positions.to(device=q.device, dtype=torch.int64)
    klen = k_lengths.to(device=q.device, dtype=torch.int64)
    block_d = max(16, next_pow2(d))
    qk_scale = float(scale) * LOG2E

    delta = torch.empty((b, hq, tq), dtype=torch.float32, device=q.device)
    bt = 32
    _delta_kernel[(triton.cdiv(tq, bt), b * hq)](
        out, grad_out, delta, tq, hq, out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), D=d, BLOCK_D=block_d, BLOCK_T=bt)

    bm, bn, warps, stages = dkdv_cfg or _cfg("MC_ATTN_BWD_DKDV", _DKDV_CFG)
    tab = _query_block_table(qpos, klen, tk, bm, bn)
    nkb = tab.shape[1]
    _dkdv_kernel[(nkb, b * hkv)](
        q, k, v, grad_out, lse, delta, qpos, klen, tab, dk, dv, qk_scale, float(scale),
        tq, tk, hq, hkv, nkb,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        qpos.stride(0), qpos.stride(1),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        G=g, D=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages,
    )

    bm, bn, warps, stages = dq_cfg or _cfg("MC_ATTN_BWD_DQ", _DQ_CFG)
    _dq_kernel[(triton.cdiv(tq, bm), b * hq)](
        q, k, v, grad_out, lse, delta, qpos, klen, dq, qk_scale, float(scale),
        tq, tk, hq, hkv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        qpos.stride(0), qpos.stride(1), dq.stride(0), dq.stride(1), dq.stride(2),
        G=g, D=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv


@register("attention_backward", "cuda")
def _attention_backward_cuda(grad_out, q, k, v, out, lse, q_positions, k_lengths, scale):
    return attention_bwd(grad_out, q, k, v, out, lse, q_positions, k_lengths, scale)
