"""Causal GQA attention for CUDA (Triton): one per-row arithmetic for training, prefill, chunked prefill and decode.

Two entry points share every ``@triton.jit`` helper of the per-row arithmetic (key block,
partition, merge, finalisation): :func:`attention_fwd` (dense ``[B, T, H, D]`` K/V, the trainer
and the registered ``("attention", "cuda")`` op) and :func:`.paged_attention.paged_attention`
(vLLM-style paged KV cache, varlen queries, CUDA-graph capturable; module :mod:`.paged_attention`,
which also holds the KV-cache write).

GPU numerics contract (one query row = one (token, query head)):

* the key axis is cut into **partitions** of ``PART_KEYS`` = ``PART_BLOCKS`` (8) x
  ``KV_BLOCK_GPU`` (64) = 512 keys, aligned at absolute position 0 — a fixed cut that depends
  on nothing but the key positions (not the batch, the tile, the path or how the row reached
  the kernel: whole sequence, prefill chunk over a cached prefix, decode step);
* inside a partition, keys are visited in blocks of 64 (aligned at 0) in increasing order, from
  a fresh state ``m = -inf, l = 0, acc = 0``:

  - raw scores ``s = q . k`` by the tensor cores (bf16/fp16 inputs, float32 accumulate, head dim
    in increasing 16-wide steps); invisible keys get ``-inf``;
  - ``m' = max(m, max_j s)``, ``alpha = exp2((m - m') * c)``, ``p = exp2((s - m') * c)`` with
    ``c = scale * log2(e)`` (subtract first, then scale: no FMA contraction can change a row's
    bits between masked and unmasked blocks; ``m' = -inf`` is replaced by 0 in both);
  - ``p`` is rounded to the input dtype; ``acc = mma(p, v, acc * alpha)`` and
    ``l = mma(p, 1, l * alpha)`` — the normaliser is summed by the tensor cores over the same
    rounded ``p`` as the numerator (the row max is exact);

* partitions are merged into a running ``(M, L, ACC)`` (initially ``-inf, 0, 0``) in increasing
  order by one formula: ``M' = max(M, m)``, ``a = exp2((M - R) * c)``, ``b = exp2((m - R) * c)``
  with ``R = M'`` (0 if ``-inf``), ``L' = fma(L, a, l * b)``, ``ACC' = fma(ACC, a, acc * b)``
  (explicit ``tl.fma``, so no contraction choice differs between kernels); a partition with no
  visible key (``m = -inf``) leaves the running state bitwise unchanged (selected, not computed),
  so trailing partitions, padding and batch neighbours never change a row;
* ``out = round(ACC / L)``; ``lse = fma(M, c, log2(L)) * ln2``; a row with no visible key (or
  position -1) gives ``out = 0``, ``lse = -inf``.

Two execution paths give identical bits (the path is chosen from shapes only, or forced with
``split=``): **in-program** — one program per (query tile, kv head) walks its partitions in order
and merges as it goes (prefill, training, large batches); **split** — one program per (query
tile, kv head, partition) writes the partition's float32 ``(m, l, acc)`` to a workspace and a
second launch merges them in partition order (decode at small batch / long context, to fill the
SMs); partitions past the workspace (a row longer than the launch's ``max_seq_len`` hint) are
computed by the merging program itself.  Both paths are one ``_attn_kernel`` (``MODE`` 0 / 1+2) calling the same
``_walk`` / ``_merge`` / ``_finalize`` helpers.  In-program launches of the paged path with pages
shorter than a key block walk all partitions of a row in one pipelined loop (``_walk`` with ``FOLD``: the loads
of the next partition do not wait for the previous one's merge); the others walk one partition per loop.

Query rows of one (sequence, kv head) are packed (token-major, then the ``G`` query heads that
share the kv head) into tiles of 16, 64 or 128 rows by the number of rows; a row's arithmetic
does not depend on the tile it lands in (tests/test_gpu_kernels.py, tests/test_gpu_paged_attention.py
check this bitwise).

FP8 KV cache (paged path, ``float8_e4m3fn`` with a per-tensor ``kv_scale``): a loaded key/value is
``round_to_q_dtype(float32(k8) * kv_scale)`` — :func:`megatron_consistent.kernels.fp8.kv_dequantize`
— so a paged FP8 row equals :func:`attention_fwd` on the dequantized K/V.

Unless ``MC_GLUON=0`` the registered dense op hands prefill-sized calls on Hopper to :mod:`.gluon_attention`: this
contract, warp-specialised in Gluon, the same bits (:func:`gluon_attention_applies`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..attention import CUDA_MAX_HEAD_DIM
from ..dispatch import env_switch, register
from ..numerics import LOG2E
from ._common import GLUON, next_pow2, on_hopper

KV_BLOCK_GPU = 64
PART_BLOCKS = 8
PART_KEYS = KV_BLOCK_GPU * PART_BLOCKS
ZERO_BLOCK_T = tl.constexpr(16)  # padding-token rows a zeroing program of a paged call's last launch writes

# Test-only: when True the partition size is derived from the call's longest key range (a batch
# property), which breaks the contract on purpose; tests/test_gpu_paged_attention.py must catch it.
_TEST_BATCH_DEPENDENT_PARTITION = False


def _part_blocks(max_kv: int) -> int:
    if _TEST_BATCH_DEPENDENT_PARTITION:
        return max(1, triton.cdiv(max(int(max_kv), 1), KV_BLOCK_GPU * 4))
    return PART_BLOCKS


# ----------------------------------------------------------------------------- per-row arithmetic


@triton.jit
def _load_kv(q, kb, vb, pt, p0, start, kpos, kbound, d, dm, skp, skt, svp, svt, kv_scale, kn, vn, kn0, sknt, svnt,
             BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PART_PAGES: tl.constexpr, FP8: tl.constexpr,
             MASKED: tl.constexpr, NEW: tl.constexpr):
    """K, V tiles ``[BLOCK_N, BLOCK_D]`` of keys ``kpos = start + arange(BLOCK_N)``; keys at or past ``kbound``
    read as 0.  Dense: ``PAGE == 0``.  Paged: ``pt`` is the row's page table (``PAGE < BLOCK_N``: each key's page
    id is loaded with it, a load Triton pipelines one stage ahead of the keys'), or (``PAGE`` a multiple of
    ``BLOCK_N``) the page ids of the partition from page ``p0 // PAGE`` on, in registers: a block lies in one page,
    and its keys' addresses wait on no load in the key loop, so the keys pipeline as the dense path's do.  ``NEW``:
    every key of the block is one of the step's new tokens, read from the step's dense ``[T, Hkv, D]`` K/V ``kn, vn``
    at token ``kpos + kn0`` and addressed as the dense path (the cache holds the same values: bf16 / fp16 only)."""
    kin = kpos < kbound
    if NEW:
        kb = kn
        vb = vn
        koff = (kpos + kn0).to(tl.int64) * sknt
        voff = (kpos + kn0).to(tl.int64) * svnt
    elif PAGE == 0:
        koff = kpos.to(tl.int64) * skt
        voff = kpos.to(tl.int64) * svt
    elif PAGE % BLOCK_N == 0:
        first = start // PAGE - p0 // PAGE
        page = tl.sum(tl.where(tl.arange(0, PART_PAGES) == first, pt, 0), axis=0)
        in_page = kpos - (start // PAGE) * PAGE
        koff = page * skp + in_page * skt
        voff = page * svp + in_page * svt
    else:
        if MASKED:
            page = tl.load(pt + kpos // PAGE, mask=kin, other=0).to(tl.int64)
        else:
            page = tl.load(pt + kpos // PAGE).to(tl.int64)
        koff = page * skp + (kpos % PAGE) * skt
        voff = page * svp + (kpos % PAGE) * svt
    if MASKED:
        lm = kin[:, None] & dm[None, :]
    else:
        lm = (kpos >= 0)[:, None] & dm[None, :]
    k = tl.load(kb + koff[:, None] + d[None, :], mask=lm, other=0.0)
    v = tl.load(vb + voff[:, None] + d[None, :], mask=lm, other=0.0)
    if FP8:
        k = (k.to(tl.float32) * kv_scale).to(q.dtype)
        v = (v.to(tl.float32) * kv_scale).to(q.dtype)
    return k, v


@triton.jit
def _attn_block(q, k, v, kpos, pos, kl, m_i, l_mat, acc, ones, qk_scale, MASKED: tl.constexpr):
    """One 64-key block of the online softmax (see the module docstring)."""
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


@triton.jit
def _step(q, kb, vb, pt, start, lo, offs_n, d, dm, ones, pos, kl, kbound, m_r, l_r, acc_r, m_i, l_mat, acc,
          skp, skt, svp, svt, kv_scale, qk_scale, kn, vn, kn0, sknt, svnt, BLOCK_N: tl.constexpr, PART: tl.constexpr,
          PAGE: tl.constexpr, PART_PAGES: tl.constexpr, FP8: tl.constexpr, FOLD: tl.constexpr, MASKED: tl.constexpr,
          NEW: tl.constexpr):
    """The key block at ``start``; with ``FOLD``, a block that opens a partition first merges the finished one
    into the running state and starts from a fresh state."""
    if FOLD:
        if (start > lo) & (start % PART == 0):
            m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, m_i, tl.max(l_mat, 1), acc, qk_scale)
            m_i = tl.full(m_i.shape, float("-inf"), dtype=tl.float32)
            l_mat = tl.zeros(l_mat.shape, dtype=tl.float32)
            acc = tl.zeros(acc.shape, dtype=tl.float32)
    kpos = start + offs_n
    k, v = _load_kv(q, kb, vb, pt, lo, start, kpos, kbound, d, dm, skp, skt, svp, svt, kv_scale, kn, vn, kn0, sknt,
                    svnt, BLOCK_N, PAGE, PART_PAGES, FP8, MASKED, NEW)
    m_i, l_mat, acc = _attn_block(q, k, v, kpos, pos, kl, m_i, l_mat, acc, ones, qk_scale, MASKED)
    return m_r, l_r, acc_r, m_i, l_mat, acc


@triton.jit
def _walk(q, kb, vb, tab, lo, hi, full, pos, kl, kbound, m_r, l_r, acc_r, skp, skt, svp, svt, kv_scale, qk_scale,
          kn, vn, kn0, newc, sknt, svnt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
          D: tl.constexpr, PART: tl.constexpr, PAGE: tl.constexpr, PART_PAGES: tl.constexpr, FP8: tl.constexpr,
          FOLD: tl.constexpr, NEW_KV: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Key blocks ``[lo, hi)`` (``lo`` on a partition boundary) in increasing order, each partition from a fresh
    online-softmax state -> ``(m_r, l_r, acc_r, m, l, acc)``: the running state with every finished partition merged
    in (in order; only with ``FOLD``) and the state of the last partition, not merged.  Without ``FOLD`` (and always
    for pages of ``BLOCK_N`` keys or more, whose page ids are loaded here once) ``[lo, hi)`` lies in one partition.

    With ``FOLD`` one loop walks all partitions, so the software pipeliner keeps loading across partition boundaries
    instead of draining at each; the arithmetic per partition and the merge order are those of the module
    docstring.  Blocks below ``full`` are visible to every active row of the tile and skip the mask; with ``NEW_KV``,
    those of them from ``newc`` on (blocks of the step's new tokens only) are read from the step's K/V (see
    :func:`_load_kv`): the same values, so the same bits, with dense addresses."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ones = tl.full((BLOCK_N, 16), 1.0, dtype=tl.float32).to(q.dtype)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_mat = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if PAGE > 0 and PAGE % BLOCK_N == 0:  # the partition's page ids, once (see _load_kv)
        pid = lo // PAGE + tl.arange(0, PART_PAGES)
        pt = tl.load(tab + pid, mask=pid * PAGE < kbound, other=0).to(tl.int64)
    else:
        pt = tab
    u = tl.minimum(tl.maximum(full, lo), hi)
    if NEW_KV:
        c = tl.minimum(tl.maximum(newc, lo), u)
    else:
        c = u
    for start in tl.range(lo, c, BLOCK_N, num_stages=NUM_STAGES):
        m_r, l_r, acc_r, m_i, l_mat, acc = _step(
            q, kb, vb, pt, start, lo, offs_n, d, dm, ones, pos, kl, kbound, m_r, l_r, acc_r, m_i, l_mat, acc,
            skp, skt, svp, svt, kv_scale, qk_scale, kn, vn, kn0, sknt, svnt, BLOCK_N, PART, PAGE, PART_PAGES, FP8,
            FOLD, False, False)
    if NEW_KV:
        for start in tl.range(c, u, BLOCK_N, num_stages=NUM_STAGES):
            m_r, l_r, acc_r, m_i, l_mat, acc = _step(
                q, kb, vb, pt, start, lo, offs_n, d, dm, ones, pos, kl, kbound, m_r, l_r, acc_r, m_i, l_mat, acc,
                skp, skt, svp, svt, kv_scale, qk_scale, kn, vn, kn0, sknt, svnt, BLOCK_N, PART, PAGE, PART_PAGES, FP8,
                FOLD, False, True)
    for start in tl.range(u, hi, BLOCK_N, num_stages=NUM_STAGES):
        m_r, l_r, acc_r, m_i, l_mat, acc = _step(
            q, kb, vb, pt, start, lo, offs_n, d, dm, ones, pos, kl, kbound, m_r, l_r, acc_r, m_i, l_mat, acc,
            skp, skt, svp, svt, kv_scale, qk_scale, kn, vn, kn0, sknt, svnt, BLOCK_N, PART, PAGE, PART_PAGES, FP8,
            FOLD, True, False)
    return m_r, l_r, acc_r, m_i, tl.max(l_mat, 1), acc  # all 16 columns of l_mat are equal


@triton.jit
def _merge(m1, l1, acc1, m2, l2, acc2, qk_scale):
    """Running state (m1, l1, acc1) followed by partition (m2, l2, acc2); an empty partition is the identity."""
    m = tl.maximum(m1, m2)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    a1 = tl.math.exp2((m1 - m_ref) * qk_scale)
    a2 = tl.math.exp2((m2 - m_ref) * qk_scale)
    l = tl.fma(l1, a1, l2 * a2)
    acc = tl.fma(acc1, a1[:, None], acc2 * a2[:, None])
    empty = m2 == float("-inf")
    return tl.where(empty, m1, m), tl.where(empty, l1, l), tl.where(empty[:, None], acc1, acc)


@triton.jit
def _finalize(m, l, acc, pos, qk_scale):
    empty = (l == 0.0) | (pos < 0)
    out = acc / tl.where(empty, 1.0, l)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.fma(m, qk_scale, tl.math.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453
    lse = tl.where(empty, float("-inf"), lse)
    return out, lse


@triton.jit
def _map_tile(pid0, pid1, QPOS, KLEN, QSL, SEQ, TAB, NSEQ, Tq, Tk, HKV, spb, spt, stab,
              G: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr):
    """Rows of program (pid0, pid1) -> (has_work, tile id, seq, kv head, row valid, token, q head, pos, k_len, key bound,
    page table, the first new key's position and token: paged only, the step's new tokens are the sequence's last).

    Dense (``PAGE == 0``): pid0 = query tile (heaviest first), pid1 = batch * HKV + kv head.
    Paged: pid1 = kv head; pid0 = a virtual tile: sequence ``s`` owns virtual tiles
    ``[V_s, V_s + cdiv(q_len_s * G, BLOCK_M))`` with ``V_s = (query_start_loc[s] * G) // BLOCK_M + s``
    (found by binary search); virtual tiles past a sequence's rows have no work."""
    r = tl.arange(0, BLOCK_M)
    if PAGE == 0:
        tile = tl.num_programs(0) - 1 - pid0
        b = pid1 // HKV
        kvh = pid1 % HKV
        rr = tile * BLOCK_M + r
        t = rr // G
        rv = t < Tq
        pos = tl.load(QPOS + b * spb + t * spt, mask=rv, other=-1).to(tl.int32)
        kl = tl.minimum(tl.load(KLEN + b), Tk).to(tl.int32)
        kbound = Tk
        tab = TAB
        work = tile >= 0
        hq = kvh * G + (rr % G)
        new0 = kbound
        tnew0 = 0
    else:
        tile = pid0
        kvh = pid1
        lo = pid0 * 0
        hi = lo + NSEQ - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            vmid = (tl.load(QSL + mid) * G) // BLOCK_M + mid
            ok = vmid <= pid0
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        b = lo
        q0 = tl.load(QSL + b)
        qlen = tl.load(QSL + b + 1) - q0
        lt = pid0 - ((q0 * G) // BLOCK_M + b)
        rr = lt * BLOCK_M + r
        tloc = rr // G
        rv = tloc < qlen
        seqlen = tl.load(SEQ + b).to(tl.int32)
        t = q0 + tloc
        pos = tl.where(rv, seqlen - qlen + tloc, -1).to(tl.int32)
        kl = seqlen
        kbound = seqlen
        tab = TAB + b.to(tl.int64) * stab
        work = lt * BLOCK_M < qlen * G
        hq = kvh * G + (rr % G)
        new0 = seqlen - qlen
        tnew0 = q0
    return work, tile, b, kvh, rv, t, hq, pos, kl, kbound, tab, new0, tnew0


@triton.jit
def _merge_workspace(WS_M, WS_L, WS_ACC, wb, n_ws, r, rv, cols, qk_scale, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, WIDTH: tl.constexpr, MERGE_STAGES: tl.constexpr):
    """The workspace's first ``n_ws`` partitions of a tile merged in order from a fresh running state, over the
    accumulator columns ``cols`` (``WIDTH`` of them; read through L2: other programs wrote them).  The arithmetic is
    per row (``m``, ``l``) and per (row, column), so a column's bits do not depend on which columns a program merges.
    Only the tile's valid rows ``rv`` are read (the split launch writes only those; a decode tile of 16 rows holds
    the G query heads of one KV head, e.g. 4): the other rows' results are never stored."""
    m_r = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_r = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
    for p in tl.range(0, n_ws, num_stages=MERGE_STAGES):  # MERGE_STAGES > 1: workspace loads run ahead
        w = (wb + p) * BLOCK_M
        m_p = tl.load(WS_M + w + r, mask=rv, other=float("-inf"), cache_modifier=".cg")
        l_p = tl.load(WS_L + w + r, mask=rv, other=0.0, cache_modifier=".cg")
        acc_p = tl.load(WS_ACC + (w + r)[:, None] * BLOCK_D + cols[None, :], mask=rv[:, None], other=0.0,
                        cache_modifier=".cg")
        m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, m_p, l_p, acc_p, qk_scale)
    return m_r, l_r, acc_r


@triton.jit
def _store_rows(O, LSE, out, lse, b64, b, t, hq, rv, lse_rows, cols, sob, sot, soh, HQ, Tq, D: tl.constexpr,
                STORE_LSE: tl.constexpr):
    """``out`` (columns ``cols`` of the valid rows ``rv``) and, with ``STORE_LSE``, ``lse`` of the rows ``lse_rows``."""
    tl.store(O + b64 * sob + t.to(tl.int64)[:, None] * sot + hq[:, None] * soh + cols[None, :],
             out.to(O.dtype.element_ty), mask=rv[:, None] & (cols < D)[None, :])
    if STORE_LSE:
        tl.store(LSE + (b * HQ + hq).to(tl.int64) * Tq + t, lse, mask=lse_rows)


@triton.jit
def _complete(q, kb, vb, tab, n_ws, hi, full, pos, kl, kbound, WS_M, WS_L, WS_ACC, wb, r, d, dm, O, LSE,
              b64, b, t, hq, rv, sob, sot, soh, HQ, Tq, skp, skt, svp, svt, kv_scale, qk_scale, kn, vn, kn0, newc, sknt,
              svnt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
              PART: tl.constexpr, PAGE: tl.constexpr, PART_PAGES: tl.constexpr, FP8: tl.constexpr,
              ONE_WALK: tl.constexpr, NEW_KV: tl.constexpr, STORE_LSE: tl.constexpr, NUM_STAGES: tl.constexpr,
              MERGE_STAGES: tl.constexpr):
    """A tile's rows from a fresh running state: merge the workspace's first ``n_ws`` partitions in order (read
    through L2: other programs wrote them), walk and merge the partitions after them (``ONE_WALK``: in one loop,
    see :func:`_walk`), finalize, store ``out`` (and ``lse``)."""
    m_r, l_r, acc_r = _merge_workspace(WS_M, WS_L, WS_ACC, wb, n_ws, r, rv, d, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D,
                                       MERGE_STAGES)
    if ONE_WALK:
        m_r, l_r, acc_r, m_p, l_p, acc_p = _walk(q, kb, vb, tab, n_ws * PART, hi, full, pos, kl, kbound,
                                                 m_r, l_r, acc_r, skp, skt, svp, svt, kv_scale, qk_scale,
                                                 kn, vn, kn0, newc, sknt, svnt, BLOCK_M, BLOCK_N, BLOCK_D, D, PART,
                                                 PAGE, PART_PAGES, FP8, True, NEW_KV, NUM_STAGES)
        m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, m_p, l_p, acc_p, qk_scale)
    else:  # a walk per partition
        for p0 in range(n_ws * PART, hi, PART):
            _, _, _, m_p, l_p, acc_p = _walk(q, kb, vb, tab, p0, tl.minimum(p0 + PART, hi), full, pos, kl, kbound,
                                             m_r, l_r, acc_r, skp, skt, svp, svt, kv_scale, qk_scale,
                                             kn, vn, kn0, newc, sknt, svnt, BLOCK_M, BLOCK_N, BLOCK_D, D, PART, PAGE,
                                             PART_PAGES, FP8, False, NEW_KV, NUM_STAGES)
            m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, m_p, l_p, acc_p, qk_scale)
    out, lse = _finalize(m_r, l_r, acc_r, pos, qk_scale)
    _store_rows(O, LSE, out, lse, b64, b, t, hq, rv, rv, d, sob, sot, soh, HQ, Tq, D, STORE_LSE)


@triton.jit
def _zero_padding_rows(O, QSL, NSEQ, Tq, z, kvh, sot, soh, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``O[t, kvh G .. (kvh + 1) G) = 0`` for the padding tokens ``query_start_loc[NSEQ] <= t < Tq`` among rows
    ``[z ZERO_BLOCK_T, (z + 1) ZERO_BLOCK_T)`` (a paged call's CUDA-graph padding)."""
    t = z * ZERO_BLOCK_T + tl.arange(0, ZERO_BLOCK_T)
    tm = (t >= tl.load(QSL + NSEQ)) & (t < Tq)
    d = tl.arange(0, BLOCK_D)
    rows = O + t.to(tl.int64)[:, None] * sot + d[None, :]
    for g in tl.static_range(G):
        tl.store(rows + (kvh * G + g) * soh, tl.zeros((ZERO_BLOCK_T, BLOCK_D), dtype=O.dtype.element_ty),
                 mask=tm[:, None] & (d < D)[None, :])


@triton.jit(do_not_specialize=["NSEQ", "Tq", "Tk", "HQ", "HKV", "NPARTS", "ZFROM"])
def _attn_kernel(Q, K, V, KN, VN, TAB, QSL, SEQ, QPOS, KLEN, O, LSE, WS_M, WS_L, WS_ACC, qk_scale, kv_scale,
                 NSEQ, Tq, Tk, HQ, HKV, NPARTS, ZFROM,
                 sqb, sqt, sqh, skb, skp, skt, skh, svb, svp, svt, svh, sknt, sknh, svnt, svnh, sob, sot, soh, spb, spt,
                 stab, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, PART_BLOCKS: tl.constexpr, PAGE: tl.constexpr, PART_PAGES: tl.constexpr,
                 FP8: tl.constexpr, NEW_KV: tl.constexpr, MODE: tl.constexpr, STORE_LSE: tl.constexpr,
                 NUM_STAGES: tl.constexpr, MERGE_STAGES: tl.constexpr, MERGE_DSPLIT: tl.constexpr,
                 PDL: tl.constexpr = False, ZERO_ROWS: tl.constexpr = False):
    """MODE 0: in-program (walk and merge every partition).  MODE 1: split, one partition per program
    (grid axis 2), float32 partials to the workspace.  MODE 2: merge the first ``NPARTS`` partitions
    from the workspace in order, then compute and merge any further ones in-program (so a row longer
    than the launch's ``max_seq_len`` bound is still complete, with the same bits); with ``MERGE_DSPLIT`` > 1, grid
    axis 2 cuts the head dimension into that many column slices, each merged by its own program (a tile whose keys
    reach past the workspace is done whole by slice 0).  ``NEW_KV`` (paged, bf16 / fp16
    cache): ``KN, VN [T, Hkv, D]`` are the step's new keys and values (those the cache holds for the sequences' last
    ``q_len`` positions); key blocks of new tokens only are read from them (see :func:`_walk`).  ``PDL`` (split path,
    Hopper): the merge launch is a programmatic dependent launch -- every MODE 1 program lets it start at once, and
    MODE 2 waits for MODE 1's grid (``griddepcontrol.wait``: its writes visible) before anything it reads from the
    workspace; scheduling only, the same loads and arithmetic.  ``ZERO_ROWS`` (a paged call's last launch): the
    programs from ``ZFROM`` on along axis 0 write the padding tokens' rows 0 (:func:`_zero_padding_rows`; slice 0
    of a sliced merge) in place of a launch of their own."""
    tl.static_assert(not (NEW_KV and FP8), "an FP8 cache is read from the cache only")
    tl.static_assert(not (ZERO_ROWS and MODE == 1), "the padding rows are written by the last launch")
    if PDL and MODE == 1:
        gdc_launch_dependents()
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    if ZERO_ROWS:
        if pid0 >= ZFROM:
            if tl.program_id(2) == 0:
                _zero_padding_rows(O, QSL, NSEQ, Tq, pid0 - ZFROM, pid1, sot, soh, G, D, BLOCK_D)
            return
    work, tile, b, kvh, rv, t, hq, pos, kl, kbound, tab, new0, tnew0 = _map_tile(
        pid0, pid1, QPOS, KLEN, QSL, SEQ, TAB, NSEQ, Tq, Tk, HKV, spb, spt, stab, G, BLOCK_M, PAGE)
    if not work:
        return
    PART: tl.constexpr = PART_BLOCKS * BLOCK_N
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    r = tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)
    active = pos >= 0
    hi = tl.minimum(tl.max(pos, 0) + 1, kl)
    wb = (tile.to(tl.int64) * tl.num_programs(1) + pid1) * NPARTS
    if MODE == 1:
        p = tl.program_id(2)
        if p * PART >= hi:
            return
    q = tl.load(Q + b64 * sqb + t.to(tl.int64)[:, None] * sqt + hq[:, None] * sqh + d[None, :],
                mask=rv[:, None] & dm[None, :], other=0.0)
    kb = K + b64 * skb + kvh * skh
    vb = V + b64 * svb + kvh * svh
    kn = KN + kvh * sknh
    vn = VN + kvh * svnh
    kn0 = tnew0 - new0  # token of key position j among the new tokens: j + kn0
    newc = ((new0 + BLOCK_N - 1) // BLOCK_N) * BLOCK_N  # the first key block of new tokens only
    full = tl.minimum(tl.min(tl.where(active, pos + 1, 1 << 30), 0), kl)
    full = tl.maximum((full // BLOCK_N) * BLOCK_N, 0)
    full = tl.minimum(full, tl.maximum(hi, 0))
    n_ws = tl.minimum((hi + PART - 1) // PART, NPARTS)  # workspace partitions holding keys of the tile
    if PDL and MODE == 2:
        gdc_wait()
    if MODE == 1:
        m_r = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_r = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_r = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        p0 = p * PART
        _, _, _, m_p, l_p, acc_p = _walk(q, kb, vb, tab, p0, tl.minimum(p0 + PART, hi), full, pos, kl, kbound,
                                         m_r, l_r, acc_r, skp, skt, svp, svt, kv_scale, qk_scale,
                                         kn, vn, kn0, newc, sknt, svnt, BLOCK_M, BLOCK_N, BLOCK_D, D, PART, PAGE,
                                         PART_PAGES, FP8, False, NEW_KV, NUM_STAGES)
        w = (wb + p) * BLOCK_M
        tl.store(WS_M + w + r, m_p, mask=rv)  # valid rows only: the merge reads no other
        tl.store(WS_L + w + r, l_p, mask=rv)
        tl.store(WS_ACC + (w + r)[:, None] * BLOCK_D + d[None, :], acc_p, mask=rv[:, None])
    elif MODE == 2 and MERGE_DSPLIT > 1:
        c = tl.program_id(2)
        if n_ws * PART < hi:  # keys past the workspace: slice 0 walks them with the whole head dimension
            if c == 0:
                _complete(q, kb, vb, tab, n_ws, hi, full, pos, kl, kbound, WS_M, WS_L, WS_ACC, wb, r, d, dm,
                          O, LSE, b64, b, t, hq, rv, sob, sot, soh, HQ, Tq, skp, skt, svp, svt, kv_scale, qk_scale,
                          kn, vn, kn0, newc, sknt, svnt, BLOCK_M, BLOCK_N, BLOCK_D, D, PART, PAGE, PART_PAGES, FP8,
                          False, NEW_KV, STORE_LSE, NUM_STAGES, MERGE_STAGES)
        else:
            WIDTH: tl.constexpr = BLOCK_D // MERGE_DSPLIT
            cols = c * WIDTH + tl.arange(0, WIDTH)
            m_r, l_r, acc_r = _merge_workspace(WS_M, WS_L, WS_ACC, wb, n_ws, r, rv, cols, qk_scale, BLOCK_M, BLOCK_D,
                                               WIDTH, MERGE_STAGES)
            out, lse = _finalize(m_r, l_r, acc_r, pos, qk_scale)
            # slice 0 stores the rows' lse; the mask a row tensor (Triton 3.9's interpreter refuses tensor & scalar)
            lse_rows = rv & (t * 0 + c == 0)
            _store_rows(O, LSE, out, lse, b64, b, t, hq, rv, lse_rows, cols, sob, sot, soh, HQ, Tq, D, STORE_LSE)
    else:
        if MODE == 0:
            n_ws = 0
        _complete(q, kb, vb, tab, n_ws, hi, full, pos, kl, kbound, WS_M, WS_L, WS_ACC, wb, r, d, dm,
                  O, LSE, b64, b, t, hq, rv, sob, sot, soh, HQ, Tq, skp, skt, svp, svt, kv_scale, qk_scale,
                  kn, vn, kn0, newc, sknt, svnt, BLOCK_M, BLOCK_N, BLOCK_D, D, PART, PAGE, PART_PAGES, FP8,
                  MODE == 0 and PAGE > 0 and PAGE < BLOCK_N, NEW_KV, STORE_LSE, NUM_STAGES, MERGE_STAGES)


# ----------------------------------------------------------------------------- host side

_FORCE_BLOCK_M = int(os.environ.get("MC_ATTN_BLOCK_M", "0"))
# Software-pipeline stages of the split path's merge loop over the workspace (1: a plain loop, each partition's loads
# waited for in turn; more: loads of later partitions issued ahead).  Loads only, never bits.  4 measured on the H200
# (``bench_gpu_attention.py``, session 13, bits checked): -3 to -9 % split decode time at 16k-32k context, within 2 %
# at 4k-8k; ``MC_ATTN_MERGE_STAGES`` overrides it (experiments).
MERGE_STAGES = int(os.environ.get("MC_ATTN_MERGE_STAGES", "4") or "4")
if MERGE_STAGES < 1:
    raise ValueError(f"MC_ATTN_MERGE_STAGES={MERGE_STAGES}: the merge loop needs at least 1 stage")
# The split path's merge launch cut into head-dimension slices (grid axis 2), each merged by its own program: more
# programs for a merge that is latency-bound.  Columns only, never bits (the merge is per row and column).  By default
# :func:`_merge_slices` picks them from the merge grid (measured on the H200, session 14); ``MC_ATTN_MERGE_DSPLIT``
# (1, 2, 4, 8) forces a count (experiments, the benchmark's variants).
MERGE_DSPLIT = int(os.environ.get("MC_ATTN_MERGE_DSPLIT", "0") or "0")
if MERGE_DSPLIT not in (0, 1, 2, 4, 8):
    raise ValueError(f"MC_ATTN_MERGE_DSPLIT={MERGE_DSPLIT}: the head-dimension slices of the merge are 1, 2, 4 or 8 "
                     f"(0: by the merge grid)")
_DEFAULT_SMS = 132


# Launch shape of a query tile: (BLOCK_M, split path) -> (num_warps, num_stages).  Numerics-neutral (a row's
# bits do not depend on it: tests/test_gpu_kernels.py and tests/test_gpu_paged_attention.py check tiles and paths
# bitwise).  Measured by ``benchmarks/bench_gpu_attention.py --tiles`` on the H200 (docs/benchmarks.md): the
# split decode path runs 2 warps / 2 stages (B = 1 at 32k: 0.074 -> 0.066 ms).  The in-program decode tile is also
# 2 / 2, although the kernel benchmark alone at B = 64 favours 4 / 4 (H100, session 46: 4k 0.353 vs 0.434 ms): in the
# rollout of shape (b) in one run, 4 / 4 gave 0.784 of stock against 2 / 2's 0.879 (session 46, docs/gpu.md).
ATTN_TILES: dict[tuple[int, bool], tuple[int, int]] = {
    (16, False): (2, 2),
    (16, True): (2, 2),
    (64, False): (4, 3),
    (64, True): (4, 3),
    (128, False): (8, 3),
    (128, True): (8, 3),
}


def tiles_from_spec(spec: str) -> dict[tuple[int, bool], tuple[int, int]]:
    """``"BLOCK_M:split:warps:stages;..."`` (split 0 / 1) -> ATTN_TILES entries; ``MC_ATTN_TILES`` overrides the
    table with it (experiments, e.g. a rollout benchmark variant: launch shapes only, never bits)."""
    tiles = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts) or parts[1] not in ("0", "1") \
                or (int(parts[0]), parts[1] == "1") not in ATTN_TILES:
            raise ValueError(f"MC_ATTN_TILES: {item!r} is not BLOCK_M:split:warps:stages with BLOCK_M in 16/64/128, split 0/1")
        tiles[(int(parts[0]), parts[1] == "1")] = (int(parts[2]), int(parts[3]))
    return tiles


ATTN_TILES.update(tiles_from_spec(os.environ.get("MC_ATTN_TILES", "")))


def _block_m_for(rows: int, head_dim: int, forced: int = 0) -> int:
    """BLOCK_M by the number of packed query rows (numerics-neutral).  Tiles of 128 rows only for head dims up to
    128: a 128 x 256 tile's pipeline needs 258 KB of shared memory, over the H100 / H200's 227 KB
    (``benchmarks/offline_compile_attention.py``)."""
    if head_dim > CUDA_MAX_HEAD_DIM:
        raise ValueError(f"attention (cuda): head dim up to {CUDA_MAX_HEAD_DIM}, got {head_dim}")
    widest = 128 if head_dim <= 128 else 64
    forced = forced or _FORCE_BLOCK_M
    if forced > widest:
        raise ValueError(f"attention (cuda): a query tile of {forced} rows does not fit in shared memory with head "
                         f"dim {head_dim}; at most {widest}")
    return forced or (16 if rows <= 16 else 64 if rows <= 64 or widest == 64 else 128)


def _merge_stages(bm: int, block_d: int) -> int:
    """Pipeline stages of the merge loop of a ``bm``-row tile with a ``block_d``-wide head: ``MERGE_STAGES`` up to
    64 x 128 (decode tiles, where 4 stages were measured), at most 2 beyond (``BLOCK_M`` 128 x D 128 with 4 stages
    needs 236 KB of shared memory, ``BLOCK_M`` 64 x D 256 234 KB, over the H200's 227 KB, whatever the slices:
    ``offline_compile_attention.py``).  Loads only, never bits."""
    return MERGE_STAGES if bm * block_d <= 64 * 128 else min(MERGE_STAGES, 2)


def _sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return _DEFAULT_SMS
    from ._common import num_sms
    return num_sms(dev.index if dev.index is not None else torch.cuda.current_device())


# The path rule: split when the in-program grid has fewer than this many programs per SM.  Shapes only, never bits.
# 1, measured on an H100 (session 42, ``bench_gpu_attention.py`` decode cases, GQA 32/8, D 128, both paths timed
# in one run; a decode row is one 16-row tile per KV head, so B sequences make 8 B programs): up to B = 16 (128
# programs, under one per SM) the split path is faster at every context measured, 1k-32k (B = 16: 1k 0.0361 vs
# 0.0393 ms, 32k 0.768 vs 1.006); from B = 32 (256 programs) the in-program one is (B = 32: 1k 0.0545 vs 0.0789 ms,
# 4k 0.192 vs 0.211, 32k 1.483 vs 1.507; B = 24: 4k 0.151 vs 0.160, 16k within 2 %), where the old default 2 split.
# Left in-program by both rules: B = 64 at 4k-32k, where splitting measured 4-13 % faster (1k-2k: 8-24 % slower);
# ``MC_ATTN_SPLIT_PER_SM`` (e.g. 8) lets a rollout variant try it.
SPLIT_PER_SM = int(os.environ.get("MC_ATTN_SPLIT_PER_SM", "1") or "1")
if SPLIT_PER_SM < 0:
    raise ValueError(f"MC_ATTN_SPLIT_PER_SM={SPLIT_PER_SM}: programs per SM below which the split path runs, >= 0")
# The split path's merge as a programmatic dependent launch on Hopper (``MC_ATTN_PDL=1``; off by default until a run
# on the GPU times it): the merge grid starts while the split grid's last programs run and waits for them in-kernel
# (``_attn_kernel``'s ``PDL``), hiding the second launch's latency -- at decode, where the split path runs, a few
# microseconds of a 20-50 us call.  Scheduling only, never bits.
SPLIT_PDL = env_switch("MC_ATTN_PDL", False)


def _use_split(split: bool | None, programs: int, nparts: int, dev: torch.device) -> bool:
    """Shapes-only path choice (never changes bits): split when too few programs fill the SMs."""
    if split is not None:
        return bool(split) and nparts > 1
    return nparts > 1 and programs < SPLIT_PER_SM * _sms(dev)


def _merge_slices(programs: int, block_d: int, dev: torch.device) -> int:
    """Head-dimension slices of the merge launch for ``programs`` merging programs (query tiles with rows x kv
    heads): doubled (up to 8) while the sliced grid still fits in one wave of the SMs, each slice at least 16 columns
    wide.  The H200's fastest bit-equal count in every split decode case of ``bench_gpu_attention.py`` but one
    (session 14, GQA 32/8, D 128): 8 at B = 1 (32k: 0.0512 vs 0.0671 ms unsliced), 4 at B = 4 (32k: 0.1634 vs
    0.1727), 2 at B = 8 (16k: 0.1591 vs 0.1629), 1 at B = 16 (32k: 0.5701; 2 slices 0.5636).  Scheduling only, never
    bits."""
    slices = MERGE_DSPLIT
    if not slices:
        slices = 1
        while slices < 8 and 2 * slices * programs <= _sms(dev):
            slices *= 2
    return max(1, min(slices, block_d // 16))


def _merge_slice_counts(block_d: int) -> tuple[int, ...]:
    """Every slice count :func:`_merge_slices` can pick for a ``block_d``-wide head (the forced one alone)."""
    counts = (MERGE_DSPLIT,) if MERGE_DSPLIT else (1, 2, 4, 8)
    return tuple(sorted({max(1, min(c, block_d // 16)) for c in counts}))


# the merge launches whose every slice count is compiled in this process, by their other constexprs and options
_merge_binaries_built: set[tuple] = set()


def _build_merge_binaries(args: tuple, grid: tuple, merge: dict, block_d: int, dev: torch.device) -> None:
    """Compile, without launching, the merge launch's binary for every slice count the step could pick, the first time a
    split launch of these constexprs runs in the process.  The count follows the step's programs (its batch), so a
    rollout met a new one mid-pass and compiled it there (session 46, H100, shape b: the first timed pass 8.3 s
    against 5.6, one ``MERGE_DSPLIT`` binary; the 4 / 4 tile's engine three).  Compiles only (Triton's ``warmup``):
    no launch, never a bit; CUDA only (the interpreter compiles nothing).  Keyed by constexprs and options, not by
    Triton's argument specialisation (an integer argument's divisibility, a pointer's alignment): a launch with a new
    one compiles its binary there, as before -- an engine's strides and block-table width do not change."""
    key = (dev.index, *(item for item in merge.items() if item[0] != "MERGE_DSPLIT"))  # ~1.5 us a launch
    if dev.type != "cuda" or key in _merge_binaries_built:
        return
    _merge_binaries_built.add(key)
    for slices in _merge_slice_counts(block_d):
        if slices != merge["MERGE_DSPLIT"]:
            _attn_kernel.warmup(*args, grid=grid[:2] + (slices,), **dict(merge, MERGE_DSPLIT=slices))


def _workspace(rows: int, block_d: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split path's float32 partials ``(m, l, acc)``, one slot per (query row, partition), uninitialised: a
    partition's slot is written before any program reads it (tests fill it with NaN to check that)."""
    return (torch.empty(rows, dtype=torch.float32, device=dev), torch.empty(rows, dtype=torch.float32, device=dev),
            torch.empty((rows, block_d), dtype=torch.float32, device=dev))


def _launch(*, q, k, v, tab, qsl, seq, qpos, klen, out, lse, scale, kv_scale, nseq, tq, tk, hq, hkv,
            qs, ks, vs, os_, ps, stab, grid0, n1, max_kv, page, fp8, split, bm, d, k_new=None, v_new=None,
            programs: int = 0, zero_padding: bool = False):
    """One attention call's launches.  ``k_new, v_new [T, Hkv, D]`` (paged, non-FP8 cache): the step's new keys and
    values, read in place of the cache for key blocks of new tokens only (same values: never a bit).  ``programs``:
    the programs of the ``grid0 x n1`` grid that have rows (0: all of them), for the merge's slices.
    ``zero_padding`` (paged): the last launch also writes the rows of tokens ``query_start_loc[nseq] .. tq`` 0."""
    g = hq // hkv
    block_d = max(16, next_pow2(d))
    part_blocks = _part_blocks(max_kv)
    nparts = max(1, triton.cdiv(max(int(max_kv), 1), part_blocks * KV_BLOCK_GPU))
    qk_scale = float(scale) * LOG2E
    use_split = _use_split(split, grid0 * n1, nparts, q.device)
    warps, stages = ATTN_TILES[(bm, use_split)]
    if use_split:
        ws_m, ws_l, ws_acc = _workspace(grid0 * n1 * nparts * bm, block_d, q.device)
        grid = (grid0, n1, nparts)
    else:
        ws_m = ws_l = ws_acc = out
        grid = (grid0, n1)
    # page ids a partition's keys can touch, for pages of KV_BLOCK_GPU keys or more (one more when the test-only
    # partition does not start on a page)
    part_keys = part_blocks * KV_BLOCK_GPU
    part_pages = next_pow2(triton.cdiv(part_keys, page) + (part_keys % page != 0)) if page >= KV_BLOCK_GPU else 1
    common = {"G": g, "D": d, "BLOCK_D": block_d, "BLOCK_M": bm, "BLOCK_N": KV_BLOCK_GPU, "PART_BLOCKS": part_blocks,
              "PAGE": page, "PART_PAGES": part_pages, "FP8": fp8, "NEW_KV": k_new is not None,
              "STORE_LSE": lse is not None, "NUM_STAGES": stages,
              "MERGE_STAGES": MERGE_STAGES, "MERGE_DSPLIT": 1, "num_warps": warps, "num_stages": stages}
    lse_arg = lse if lse is not None else out
    kn, vn = (k_new, v_new) if k_new is not None else (k, v)
    new_strides = (kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1)) if k_new is not None else (0, 0, 0, 0)
    args = (q, k, v, kn, vn, tab, qsl, seq, qpos, klen, out, lse_arg, ws_m, ws_l, ws_acc, qk_scale,
            float(kv_scale), nseq, tq, tk, hq, hkv, nparts, grid0, *qs, *ks, *vs, *new_strides, *os_, *ps, stab)
    last0 = grid0 + (triton.cdiv(tq, ZERO_BLOCK_T.value) if zero_padding else 0)  # the last launch's axis 0
    if use_split:
        pdl = SPLIT_PDL and on_hopper(q)
        _attn_kernel[grid](*args, MODE=1, **dict(common, PDL=pdl))
        dsplit = _merge_slices(programs or grid0 * n1, block_d, q.device)
        merge = dict(common, MODE=2, MERGE_DSPLIT=dsplit, PDL=pdl, MERGE_STAGES=_merge_stages(bm, block_d),
                     ZERO_ROWS=zero_padding)
        if pdl:  # the launch option only where it is on: every other launch exactly as before
            merge["launch_pdl"] = True
        _attn_kernel[(last0, n1, dsplit)](*args, **merge)
        _build_merge_binaries(args, (last0, n1, dsplit), merge, block_d, q.device)
    else:
        _attn_kernel[(last0,) + grid[1:]](*args, MODE=0, **dict(common, ZERO_ROWS=zero_padding))
    return use_split


def attention_fwd(q, k, v, q_positions, k_lengths, scale, block_m: int = 0, split: bool | None = None,
                  gluon: str | None = None):
    """Dense causal GQA attention -> ``(out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32)``.

    ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]`` bf16/fp16 (last dim contiguous, else copied),
    ``q_positions [B, Tq]`` (-1 = padding), ``k_lengths [B]``.  ``block_m`` forces the query tile and
    ``split`` the path (``None``: chosen from shapes); neither changes a bit (module docstring).  ``gluon``: a
    schedule of :data:`.gluon_attention.SCHEDULES` -- the same result by the Gluon kernel (Hopper; head dim 64 or
    128)."""
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
    if gluon is not None:
        if d not in GLUON_ATTENTION_HEAD_DIMS:
            raise ValueError(f"attention (cuda): the Gluon kernel serves head dims {GLUON_ATTENTION_HEAD_DIMS}, got {d}")
        from .gluon_attention import gluon_attention_fwd

        return gluon_attention_fwd(q, k, v, qpos, klen, scale, out, lse, kv_block=KV_BLOCK_GPU,
                                   part_blocks=_part_blocks(tk), schedule=gluon)
    bm = _block_m_for(tq * g, d, block_m)
    _launch(q=q, k=k, v=v, tab=klen, qsl=klen, seq=klen, qpos=qpos, klen=klen, out=out, lse=lse, scale=scale,
            kv_scale=1.0, nseq=b, tq=tq, tk=tk, hq=hq, hkv=hkv,
            qs=(q.stride(0), q.stride(1), q.stride(2)), ks=(k.stride(0), 0, k.stride(1), k.stride(2)),
            vs=(v.stride(0), 0, v.stride(1), v.stride(2)), os_=(out.stride(0), out.stride(1), out.stride(2)),
            ps=(qpos.stride(0), qpos.stride(1)), stab=0, grid0=triton.cdiv(tq * g, bm), n1=b * hkv,
            max_kv=tk, page=0, fp8=False, split=split, bm=bm, d=d)
    return out, lse


GLUON_ATTENTION_HEAD_DIMS = (64, 128)  # the Gluon prefill kernel (.gluon_attention) serves these
GLUON_ATTENTION_SCHEDULE = "ws lookahead"  # session 24, dense prefill T = 4k / 16k: 1.14-1.24x this kernel, the same bits


def gluon_attention_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the Gluon kernel (:mod:`.gluon_attention`, :data:`GLUON_ATTENTION_SCHEDULE`; ``MC_GLUON``, default on)
    takes a dense call (the caller checks the device): bf16 / fp16, head dim in :data:`GLUON_ATTENTION_HEAD_DIMS`, prefill-sized
    (more than 64 packed query rows: this kernel's 128-row tiles; decode keeps its split path)."""
    return GLUON and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in GLUON_ATTENTION_HEAD_DIMS \
        and q.shape[1] * (q.shape[2] // k.shape[2]) > 64


@register("attention", "cuda")
def _attention_cuda(q, k, v, q_positions, k_lengths, scale):
    gluon = GLUON_ATTENTION_SCHEDULE if gluon_attention_applies(q, k) and on_hopper(q) else None
    return attention_fwd(q, k, v, q_positions, k_lengths, scale, gluon=gluon)
