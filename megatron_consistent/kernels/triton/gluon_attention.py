"""Causal GQA attention for prefill on Hopper written in Gluon -- dense (the trainer) and paged (the engine) -- the
committed kernel's per-row arithmetic with two warp groups taking turns on the tensor cores; on Hopper by default (``MC_GLUON=0``: off).

Why (docs/benchmarks.md, issue #15): the committed Triton kernel (``kernels/triton/attention.py``) runs dense prefill
at 0.57-0.66 of vLLM's FA3 on the H200 and the engine's paged prefill at 0.51-0.59.  Triton 3.6 waits for each
``wgmma`` right after issuing it and its warp specialisation does not compile on Hopper for this loop (sessions 12,
14), so a warp group's softmax never overlaps a tensor-core chain.  Here a producer warp loads each key block's K and
V by TMA into a ring of shared-memory slots, and two consumer warp groups take the upper and lower 64 rows of a
128-row query tile and walk the same key blocks, each releasing a slot once its chains on it are done; nothing else
synchronises them (but in the ``pingpong`` schedule), so one group's softmax runs while the other's ``wgmma`` runs.
The schedules (:data:`SCHEDULES`) differ in what a consumer issues ahead and where its queries live, never in a bit.

Numerics: the contract of ``attention.py`` (its module docstring), unchanged, so the bits must equal the committed
kernels': query rows packed token-major then the ``G`` heads of a kv head into 128-row tiles (not needed for the
bits: a row's arithmetic does not depend on its tile); key blocks of ``KV_BLOCK_GPU`` (64) in increasing order,
partitions of ``PART_BLOCKS`` blocks from a fresh state; per block ``s = q . k`` by the tensor cores from nothing (head
dimension in 16-wide steps), invisible keys ``-inf`` (blocks below the tile's ``full`` key are visible to every
active row and skip the mask, as there), ``m' = max(m, max s)``, ``alpha = exp2((m - m_ref) * c)``, ``p = exp2((s -
m_ref) * c)`` rounded to the input dtype, ``l = mma(p, 1, l * alpha)``, ``acc = mma(p, v, acc * alpha)``;
partitions merged in order with the same ``fma`` formula, an empty one selected away; ``out = round(acc / l)``,
``lse = fma(M, c, log2 L) * ln2``.  Keys past the key tensor's length read as 0 (the TMA unit fills them, dense;
zeroed in shared memory, paged), as the committed kernels' masked loads.

Paged (vLLM's layouts, as ``paged_attention``): a program's sequence is found by binary search over the query
starts (the committed kernel's virtual tiles); key blocks of the step's new tokens only come from the step's K / V
(the same values), the others through the block table, one TMA load a page.

Use: unless ``MC_GLUON=0`` the registered ``("attention", "cuda")`` op (the trainer's attention) runs
``attention.GLUON_ATTENTION_SCHEDULE`` where ``attention.gluon_attention_applies`` says (prefill-sized bf16 / fp16
calls, head dim 64 or 128, Hopper), and ``paged_attention`` does for the engine's steps of prefills only
(``paged_attention.gluon_paged_applies``); ``attention_fwd(..., gluon=schedule)`` and ``paged_attention(...,
gluon=schedule)`` force a schedule.  The contract's constants come from those callers (``KV_BLOCK_GPU``,
``PART_BLOCKS``): this module imports nothing of ``attention``.  Session 24 on the H200, dense: bits equal in every case, T = 4k / 16k
1.07-1.24x the committed kernel, 0.63-0.79 of FA3; the paged kernel and the ``q regs`` / ``pingpong`` schedules were
written after that run.  Bits: ``tests/test_gpu_gluon_candidates.py -k "attention or paged"`` (``torch.equal``
against the committed kernels: partitions, ragged blocks, chunks over a prefix, padding, strided views, GQA / MHA,
D 64 / 128, pages 16-128 with NaN in every unwritten cache slot; a wrong partition caught); speed: ``python
benchmarks/bench_gpu_attention.py --gluon``; sm_90a compile without a GPU: ``benchmarks/offline_compile_gluon.py
--only attention``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                      warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..numerics import LOG2E
from ._common import tma_ok
from .gluon_ring import GL_DTYPES

BLOCK_M = 128  # a tile's packed query rows: two consumer warp groups of 64
STAGES = 4  # ring slots of one key block's K and V (4 x 32 KB at D = 128)
# name -> constexprs: "ws" -- each consumer waits for every chain right after issuing it (the other consumer keeps
# the tensor cores busy meanwhile); "ws lookahead" -- block j + 1's scores issued before block j's two chains, whose
# wait comes after block j + 1's softmax (FA3's overlap inside a warp group); "q regs" -- the queries held in
# registers as the score chain's A operand (64 x 64 scores from shared memory read 2 KB of queries and 2 KB of keys a
# k-step: at the tensor cores' rate about the shared-memory bandwidth); "pingpong" -- with the lookahead, the two
# consumers take turns issuing their chains (FA3's ping-pong: one's softmax under the other's chains, by two
# mbarriers).  Same arithmetic, same bits.
SCHEDULES = {name: {"LOOKAHEAD": lookahead, "QREGS": qregs, "PINGPONG": pingpong}
             for name, (lookahead, qregs, pingpong) in {
                 "ws": (False, False, False), "ws lookahead": (True, False, False), "ws q regs": (False, True, False),
                 "ws lookahead q regs": (True, True, False), "ws lookahead pingpong": (True, False, True)}.items()}
CONSUMER_REGS: gl.constexpr = gl.constexpr(240)  # two 64 x D float32 tiles live (the running and the partition's)
PRODUCER_REGS: gl.constexpr = gl.constexpr(24)
WARPS = 4


@gluon.jit
def _kv_producer(k_desc, v_desc, ready, empty, k_bufs, v_bufs, b, kv_col, n_blocks, STAGES: gl.constexpr):
    """Key blocks ``0 .. n_blocks`` of (sequence ``b``, kv head at column ``kv_col``) in order into the ring: slot
    ``j % STAGES`` is refilled once both consumers released block ``j - STAGES``."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    for j in range(n_blocks):
        slot = j % STAGES
        # a fresh barrier is in phase 0, so the first pass over the ring waits for nothing (parity 1)
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, j * BLOCK_N, kv_col], bar, k_bufs.index(slot).reshape(k_desc.block_type.shape))
        tma.async_copy_global_to_shared(v_desc, [b, j * BLOCK_N, kv_col], bar,
                                        v_bufs.index(slot).reshape(v_desc.block_type.shape))


@gluon.jit
def _merge(m1, l1, acc1, m2, l2, acc2, qk_scale):
    """``attention._merge``: running state (m1, l1, acc1) followed by partition (m2, l2, acc2)."""
    m = gl.maximum(m1, m2)
    m_ref = gl.where(m == float("-inf"), 0.0, m)
    a1 = gl.exp2((m1 - m_ref) * qk_scale)
    a2 = gl.exp2((m2 - m_ref) * qk_scale)
    l = gl.fma(l1, a1, l2 * a2)
    acc = gl.fma(acc1, gl.expand_dims(a1, 1), acc2 * gl.expand_dims(a2, 1))
    empty = m2 == float("-inf")
    return gl.where(empty, m1, m), gl.where(empty, l1, l), gl.where(gl.expand_dims(empty, 1), acc1, acc)


@gluon.jit
def _probabilities(s, m_i, pos, kcols, start, full, kl, qk_scale, dtype: gl.constexpr):
    """One key block's online-softmax step on its raw scores ``s`` (module docstring): ``(m', alpha, p)`` with ``p``
    rounded to ``dtype``; blocks from ``full`` on mask the keys a row does not see."""
    if start >= full:
        kpos = gl.expand_dims(start + kcols, 0)
        vis = (kpos <= gl.expand_dims(pos, 1)) & (kpos < kl)
        s = gl.where(vis, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2((m_i - m_ref) * qk_scale)
    p = gl.exp2((s - gl.expand_dims(m_ref, 1)) * qk_scale).to(dtype)
    return m_new, alpha, p


@gluon.jit
def _rows(tile, b, kvh, QPOS, Tq, spb, spt, q0, qlen, kl, ROW0: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr,
          layout: gl.constexpr, PAGED: gl.constexpr):
    """Packed rows ``ROW0 .. ROW0 + ROWS`` of ``tile`` -> (valid, token, query head, position: -1 if not valid).
    Dense: token ``t`` of sequence ``b``, its position from ``QPOS``.  ``PAGED``: the sequence's ``qlen`` query tokens
    from token ``q0`` of the step, at its last ``qlen`` positions of ``kl``."""
    rr = tile * (2 * ROWS) + ROW0 + gl.arange(0, ROWS, layout=layout)
    tloc = rr // G
    if PAGED:
        rv = tloc < qlen
        t = q0 + tloc
        pos = gl.where(rv, kl - qlen + tloc, -1)
    else:
        t = tloc
        rv = t < Tq
        pos = gl.load(QPOS + b.to(gl.int64) * spb + t.to(gl.int64) * spt, mask=rv, other=-1).to(gl.int32)
    return rv, t, kvh * G + rr % G, pos


@gluon.jit
def _zero_tail(v_slot, start, kl, live):
    """Paged: the values of the keys from ``kl`` on in the key block at ``start`` (a ``live`` block of the ring) set to
    zero, as the committed kernel's masked loads read them.  Their ``p`` is 0, but the cache or the step's tensors
    may hold anything there (stale or unwritten slots, another sequence's tokens), and ``0 * nan`` is not 0.  Each
    consumer writes the same zeros over the same stale rows before its own ``wgmma`` reads them."""
    if live & (start + v_slot.type.shape[0] > kl):
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keys = start + gl.arange(0, v_slot.type.shape[0], layout=gl.SliceLayout(1, layout))
        v = v_slot.load(layout)
        v_slot.store(gl.where(gl.expand_dims(keys < kl, 1), v, gl.zeros_like(v)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, ones_smem, ready, empty, turns, QPOS, O, LSE, qk_scale, tile, b, kvh, kl, q0, qlen,
              n_blocks, full, Tq, HQ, spb, spt, sob, sot, soh, WG: gl.constexpr, G: gl.constexpr,
              PART_BLOCKS: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr, LOOKAHEAD: gl.constexpr,
              QREGS: gl.constexpr, PINGPONG: gl.constexpr, PAGED: gl.constexpr):
    """Consumer ``WG`` (one warp group): rows ``WG * 64 ..`` of the tile, every key block of the ring in order (the
    module docstring's arithmetic), each slot released once its two chains are done; then finalise and store."""
    ROWS: gl.constexpr = q_smem.type.shape[0] // 2
    D: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
    if QREGS:  # the scores' A operand from registers: the score chains read only the keys from shared memory
        q_rows = q_smem.slice(WG * ROWS, ROWS).load(gl.DotOperandLayout(0, s_layout, 2))
    else:
        q_rows = q_smem.slice(WG * ROWS, ROWS)
    _, _, _, pos = _rows(tile, b, kvh, QPOS, Tq, spb, spt, q0, qlen, kl, WG * ROWS, ROWS, G, row_s, PAGED)
    kcols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_r = gl.full([ROWS], float("-inf"), gl.float32, row_o)
    l_r = gl.zeros([ROWS], gl.float32, row_o)
    acc_r = gl.zeros([ROWS, D], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_mat = gl.zeros([ROWS, 16], gl.float32, l_layout)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    dot_o: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    dot_l: gl.constexpr = gl.DotOperandLayout(0, l_layout, 2)
    if LOOKAHEAD:
        # block j + 1's scores are issued before block j's two chains, and its softmax runs while they run
        mbarrier.wait(ready.index(0), 0, pred=n_blocks > 0)
        if PAGED:
            _zero_tail(v_bufs.index(0), 0, kl, n_blocks > 0)
        s = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_init, use_acc=False)
        m_i, alpha, p = _probabilities(s, m_i, pos, kcols, 0, full, kl, qk_scale, dtype)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        l_mat = l_mat * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
        for j in range(n_blocks):
            slot = j % STAGES
            nxt = (j + 1) % STAGES  # past the last block: a slot's stale keys, scored and never used
            mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1, pred=j + 1 < n_blocks)
            if PAGED:  # (past the last block the slot may still be the other consumer's: left alone)
                _zero_tail(v_bufs.index(nxt), (j + 1) * BLOCK_N, kl, j + 1 < n_blocks)
            p_o = gl.convert_layout(p, dot_o)
            p_l = gl.convert_layout(p, dot_l)
            if PINGPONG:  # this warp group's turn to issue (the other's first turn comes first)
                mbarrier.wait(turns.index(WG), (j & 1) ^ (1 - WG))
            s_next = warpgroup_mma(q_rows, k_bufs.index(nxt).permute((1, 0)), s_init, use_acc=False, is_async=True)
            acc_next = warpgroup_mma(p_o, v_bufs.index(slot), acc, is_async=True)
            l_next = warpgroup_mma(p_l, ones_smem, l_mat, is_async=True)
            if PINGPONG:  # the other's turn: its chains run while this one's softmax does
                mbarrier.arrive(turns.index(1 - WG), count=1)
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s_next,))
            m_part = m_i
            if (j + 1) % PART_BLOCKS == 0:  # block j + 1 opens a partition: from a fresh state
                m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
            m_i, alpha, p = _probabilities(s, m_i, pos, kcols, (j + 1) * BLOCK_N, full, kl, qk_scale, dtype)
            acc, l_mat, p_o, p_l = warpgroup_mma_wait(num_outstanding=0, deps=(acc_next, l_next, p_o, p_l))
            mbarrier.arrive(empty.index(slot), count=1)
            if ((j + 1) % PART_BLOCKS == 0) | (j + 1 == n_blocks):  # the partition ends: merge it, start afresh
                m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, gl.convert_layout(m_part, row_o),
                                         gl.convert_layout(gl.max(l_mat, 1), row_o), acc, qk_scale)
                l_mat = gl.zeros([ROWS, 16], gl.float32, l_layout)
                acc = gl.zeros([ROWS, D], gl.float32, o_layout)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_mat = l_mat * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
    else:
        for j in range(n_blocks):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            if PAGED:
                _zero_tail(v_bufs.index(slot), j * BLOCK_N, kl, True)
            s = warpgroup_mma(q_rows, k_bufs.index(slot).permute((1, 0)), s_init, use_acc=False)
            m_new, alpha, p = _probabilities(s, m_i, pos, kcols, j * BLOCK_N, full, kl, qk_scale, dtype)
            l_mat = warpgroup_mma(gl.convert_layout(p, dot_l), ones_smem,
                                  l_mat * gl.expand_dims(gl.convert_layout(alpha, row_l), 1))
            acc = warpgroup_mma(gl.convert_layout(p, dot_o), v_bufs.index(slot),
                                acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1))
            mbarrier.arrive(empty.index(slot), count=1)
            m_i = m_new
            if ((j + 1) % PART_BLOCKS == 0) | (j + 1 == n_blocks):  # the partition ends: merge it, start afresh
                m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, gl.convert_layout(m_i, row_o),
                                         gl.convert_layout(gl.max(l_mat, 1), row_o), acc, qk_scale)
                m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
                l_mat = gl.zeros([ROWS, 16], gl.float32, l_layout)
                acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    rv, t, hq, pos_o = _rows(tile, b, kvh, QPOS, Tq, spb, spt, q0, qlen, kl, WG * ROWS, ROWS, G, row_o, PAGED)
    empty_row = (l_r == 0.0) | (pos_o < 0)
    out = acc_r / gl.expand_dims(gl.where(empty_row, 1.0, l_r), 1)
    out = gl.where(gl.expand_dims(empty_row, 1), 0.0, out)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offs = b.to(gl.int64) * sob + t.to(gl.int64) * sot + hq.to(gl.int64) * soh
    gl.store(O + gl.expand_dims(offs, 1) + gl.expand_dims(d, 0), out.to(dtype),
             mask=gl.expand_dims(rv, 1) & gl.expand_dims(d < D, 0))
    if STORE_LSE:
        lse = gl.fma(m_r, qk_scale, gl.log2(gl.where(empty_row, 1.0, l_r))) * 0.6931471805599453
        lse = gl.where(empty_row, float("-inf"), lse)
        gl.store(LSE + (b * HQ + hq).to(gl.int64) * Tq + t, lse, mask=rv)


@gluon.jit
def _tile_setup(Q, QPOS, tile, b, kvh, kl, q0, qlen, Tq, spb, spt, sqb, sqt, sqh, G: gl.constexpr,
                BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, dtype: gl.constexpr,
                PAGED: gl.constexpr, num_warps: gl.constexpr):
    """A program's common start: the tile's queries into shared memory, the ones the normaliser's ``mma`` takes, the
    tile's key range as the committed kernel computes it (``n_blocks`` key blocks, masks from key ``full`` on), the
    ring and its barriers, the two consumers' turn barriers (``PINGPONG``) -> ``(q_smem, ones_smem, k_bufs, v_bufs,
    ready, empty, turns, n_blocks, full)``."""
    BM: gl.constexpr = 2 * 64
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, q_layout)
    rv, t, hq, pos = _rows(tile, b, kvh, QPOS, Tq, spb, spt, q0, qlen, kl, 0, BM // 2, G, rows, PAGED)
    rv2, t2, hq2, pos2 = _rows(tile, b, kvh, QPOS, Tq, spb, spt, q0, qlen, kl, BM // 2, BM // 2, G, rows, PAGED)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q_smem = gl.allocate_shared_memory(dtype, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], dtype))
    for half in gl.static_range(2):
        if half == 0:
            th, hh, vh = t, hq, rv
        else:
            th, hh, vh = t2, hq2, rv2
        q = gl.load(Q + b.to(gl.int64) * sqb + gl.expand_dims(th.to(gl.int64) * sqt + hh.to(gl.int64) * sqh, 1)
                    + gl.expand_dims(d, 0), mask=gl.expand_dims(vh, 1), other=0.0)
        q_smem.slice(half * (BM // 2), BM // 2).store(q)
    ones_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [num_warps, 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, 16], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 16], dtype),
                                          gl.full([BLOCK_N, 16], 1.0, dtype, ones_layout))
    fence_async_shared()
    top = gl.maximum(gl.max(pos, 0), gl.max(pos2, 0))
    hi = gl.maximum(gl.minimum(top + 1, kl), 0)
    low = gl.minimum(gl.min(gl.where(pos >= 0, pos + 1, 1 << 30), 0), gl.min(gl.where(pos2 >= 0, pos2 + 1, 1 << 30), 0))
    full = gl.maximum((gl.minimum(low, kl) // BLOCK_N) * BLOCK_N, 0)
    full = gl.minimum(full, hi)
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], ring_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], ring_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    return q_smem, ones_smem, k_bufs, v_bufs, ready, empty, turns, (hi + BLOCK_N - 1) // BLOCK_N, full


@gluon.jit
def _release_ring(ready, empty, turns, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turns.index(i))


@gluon.jit(do_not_specialize=["Tq", "Tk", "HQ", "HKV"])
def _gluon_attn_kernel(k_desc, v_desc, Q, QPOS, KLEN, O, LSE, qk_scale, Tq, Tk, HQ, HKV, sqb, sqt, sqh, spb, spt,
                       sob, sot, soh, G: gl.constexpr, PART_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                       STORE_LSE: gl.constexpr, LOOKAHEAD: gl.constexpr, QREGS: gl.constexpr,
                       PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """Dense: one program per (query tile, sequence x kv head), heaviest tile first (as ``attention._map_tile``):
    :func:`_tile_setup`, then the producer warp (:func:`_kv_producer`) and the two consumer warp groups
    (:func:`_consumer`; the first is the default partition)."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    b = gl.program_id(1) // HKV
    kvh = gl.program_id(1) % HKV
    kl = gl.minimum(gl.load(KLEN + b), Tk).to(gl.int32)
    q_smem, ones_smem, k_bufs, v_bufs, ready, empty, turns, n_blocks, full = _tile_setup(
        Q, QPOS, tile, b, kvh, kl, 0, 0, Tq, spb, spt, sqb, sqt, sqh, G, BLOCK_N, D, STAGES, k_desc.dtype, False,
        num_warps)
    gl.warp_specialize([(_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, turns, QPOS, O, LSE, qk_scale, tile, b,
                                     kvh, kl, 0, 0, n_blocks, full, Tq, HQ, spb, spt, sob, sot, soh, 0, G, PART_BLOCKS,
                                     STAGES, STORE_LSE, LOOKAHEAD, QREGS, PINGPONG, False)),
                        (_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, turns, QPOS, O, LSE, qk_scale, tile, b,
                                     kvh, kl, 0, 0, n_blocks, full, Tq, HQ, spb, spt, sob, sot, soh, 1, G, PART_BLOCKS,
                                     STAGES, STORE_LSE, LOOKAHEAD, QREGS, PINGPONG, False)),
                        (_kv_producer, (k_desc, v_desc, ready, empty, k_bufs, v_bufs, b, kvh * D, n_blocks, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    _release_ring(ready, empty, turns, STAGES)


@gluon.jit
def _paged_kv_producer(k_desc, v_desc, kn_desc, vn_desc, ready, empty, k_bufs, v_bufs, tab, kvh, seqlen, kn0, newc,
                       n_blocks, STAGES: gl.constexpr, PAGE: gl.constexpr, NEW_KV: gl.constexpr):
    """Key blocks ``0 .. n_blocks`` of one sequence and kv head, in order, into the ring (as :func:`_kv_producer`):
    a block of the step's new tokens only (from key ``newc`` on, with ``NEW_KV``) from the step's K / V at token
    ``key + kn0``, any other through the block table ``tab``, one TMA load per page it spans (a page of 64 keys or
    more: one load).  The values the committed kernel reads, but keys past the sequence's length: those read what the
    cache (or the next sequence's tokens) holds there, and the consumers zero their values (:func:`_zero_tail`)."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    BYTES: gl.constexpr = 2 * BLOCK_N * D * k_bufs.dtype.primitive_bitwidth // 8
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, BYTES)
        start = j * BLOCK_N
        k_slot = k_bufs.index(slot)
        v_slot = v_bufs.index(slot)
        if NEW_KV:
            if start >= newc:
                tma.async_copy_global_to_shared(kn_desc, [start + kn0, kvh, 0], bar,
                                                k_slot.reshape(kn_desc.block_type.shape))
                tma.async_copy_global_to_shared(vn_desc, [start + kn0, kvh, 0], bar,
                                                v_slot.reshape(vn_desc.block_type.shape))
            else:
                _load_pages(k_desc, v_desc, bar, k_slot, v_slot, tab, kvh, start, seqlen, PAGE)
        else:
            _load_pages(k_desc, v_desc, bar, k_slot, v_slot, tab, kvh, start, seqlen, PAGE)


@gluon.jit
def _load_pages(k_desc, v_desc, bar, k_slot, v_slot, tab, kvh, start, seqlen, PAGE: gl.constexpr):
    """The key block at ``start`` from the paged cache into ``k_slot`` / ``v_slot``: one TMA load per page it spans
    (the page ids from the block table ``tab``; past the sequence's length, page 0)."""
    BLOCK_N: gl.constexpr = k_slot.type.shape[0]
    SUB: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    D: gl.constexpr = k_slot.type.shape[1]
    k4 = k_slot.reshape([1, 1, BLOCK_N, D])
    v4 = v_slot.reshape([1, 1, BLOCK_N, D])
    for i in gl.static_range(BLOCK_N // SUB):
        key = start + i * SUB
        page = gl.load(tab + key // PAGE, mask=key < seqlen, other=0)
        tma.async_copy_global_to_shared(k_desc, [page, kvh, key % PAGE, 0], bar, k4.slice(i * SUB, SUB, dim=2))
        tma.async_copy_global_to_shared(v_desc, [page, kvh, key % PAGE, 0], bar, v4.slice(i * SUB, SUB, dim=2))


@gluon.jit(do_not_specialize=["NSEQ", "HQ"])
def _gluon_paged_attn_kernel(k_desc, v_desc, kn_desc, vn_desc, Q, TAB, QSL, SEQ, O, qk_scale, NSEQ, HQ, sqt, sqh,
                             sot, soh, stab, G: gl.constexpr, PART_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                             KV_BLOCK: gl.constexpr, PAGE: gl.constexpr, NEW_KV: gl.constexpr,
                             LOOKAHEAD: gl.constexpr, QREGS: gl.constexpr, PINGPONG: gl.constexpr,
                             num_warps: gl.constexpr):
    """Paged, varlen queries (vLLM's layout, as ``paged_attention``): program (virtual tile, kv head); sequence ``s``
    owns virtual tiles ``[V_s, V_s + cdiv(q_len_s * G, 128))`` with ``V_s = (query_start_loc[s] * G) // 128 + s``
    (found by binary search, as ``attention._map_tile``); a virtual tile past its sequence's rows walks no key."""
    D: gl.constexpr = k_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = KV_BLOCK
    pid0 = gl.program_id(0)
    kvh = gl.program_id(1)
    lo = pid0 * 0
    hi = lo + NSEQ - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = (gl.load(QSL + mid) * G) // 128 + mid <= pid0
        lo = gl.where(ok, mid, lo)
        hi = gl.where(ok, hi, mid - 1)
    b = lo
    q0 = gl.load(QSL + b)
    qlen = gl.load(QSL + b + 1) - q0
    tile = pid0 - ((q0 * G) // 128 + b)
    seqlen = gl.load(SEQ + b).to(gl.int32)
    new0 = seqlen - qlen
    q_smem, ones_smem, k_bufs, v_bufs, ready, empty, turns, n_blocks, full = _tile_setup(
        Q, SEQ, tile, b, kvh, seqlen, q0, qlen, 0, 0, 0, 0, sqt, sqh, G, BLOCK_N, D, STAGES, k_desc.dtype, True,
        num_warps)
    tab = TAB + b.to(gl.int64) * stab
    newc = ((new0 + BLOCK_N - 1) // BLOCK_N) * BLOCK_N  # the first key block of new tokens only
    gl.warp_specialize([(_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, turns, SEQ, O, O, qk_scale, tile, b,
                                     kvh, seqlen, q0, qlen, n_blocks, full, 0, HQ, 0, 0, 0, sot, soh, 0, G,
                                     PART_BLOCKS, STAGES, False, LOOKAHEAD, QREGS, PINGPONG, True)),
                        (_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, turns, SEQ, O, O, qk_scale, tile, b,
                                     kvh, seqlen, q0, qlen, n_blocks, full, 0, HQ, 0, 0, 0, sot, soh, 1, G,
                                     PART_BLOCKS, STAGES, False, LOOKAHEAD, QREGS, PINGPONG, True)),
                        (_paged_kv_producer, (k_desc, v_desc, kn_desc, vn_desc, ready, empty, k_bufs, v_bufs, tab,
                                              kvh, seqlen, q0 - new0, newc, n_blocks, STAGES, PAGE, NEW_KV))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    _release_ring(ready, empty, turns, STAGES)


def _descriptor(x: torch.Tensor, shape: list[int], strides: list[int], block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(x, shape, strides, block, gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[x.dtype]))


def _knobs(schedule: str) -> dict:
    if schedule not in SCHEDULES:
        raise ValueError(f"gluon attention: schedule {schedule!r}; the schedules are {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def kv_descriptor(x: torch.Tensor, kv_block: int) -> TensorDescriptor:
    """TMA descriptor of ``x [B, Tk, Hkv, D]`` (heads contiguous) as ``[B, Tk, Hkv * D]`` in blocks of one sequence's
    ``kv_block`` keys x one head: keys past ``Tk`` read as 0."""
    b, tk, hkv, d = x.shape
    return _descriptor(x, [b, tk, hkv * d], [x.stride(0), x.stride(1), 1], [1, kv_block, d])


def paged_cache_descriptor(cache: torch.Tensor, kv_block: int) -> TensorDescriptor:
    """TMA descriptor of a paged cache ``[blocks, page, Hkv, D]`` (any strides, last dim contiguous) as ``[blocks,
    Hkv, page, D]`` in blocks of one head's keys of one page (at most ``kv_block`` of them)."""
    nb, page, hkv, d = cache.shape
    return _descriptor(cache, [nb, hkv, page, d], [cache.stride(0), cache.stride(2), cache.stride(1), 1],
                       [1, 1, min(page, kv_block), d])


def step_kv_descriptor(x: torch.Tensor, kv_block: int) -> TensorDescriptor:
    """TMA descriptor of the step's keys or values ``[T, Hkv, D]`` in blocks of ``kv_block`` tokens of one head."""
    t, hkv, d = x.shape
    return _descriptor(x, [t, hkv, d], [x.stride(0), x.stride(1), 1], [kv_block, 1, d])


def gluon_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, out, k_new, v_new, *,
                          kv_block: int, part_blocks: int, schedule: str):
    """``paged_attention``'s rows (its docstring) by the warp-specialised Gluon kernel in one of :data:`SCHEDULES`,
    with the contract's key block and partition (``attention.KV_BLOCK_GPU``, ``PART_BLOCKS``).  What
    ``paged_attention`` has checked before calling: ``q [T, Hq, D]``, ``out [T, Hq, D]``, caches ``[blocks, page, Hkv,
    D]`` in q's dtype (bf16 / fp16, D 64 or 128), ``k_new, v_new [T, Hkv, D]`` or None (every key block through the
    block table), every K / V operand TMA-addressable; the padding tokens' rows are its to zero."""
    t_all, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    nseq = seq_lens.shape[0]
    g = hq // hkv
    kd, vd = paged_cache_descriptor(k_cache, kv_block), paged_cache_descriptor(v_cache, kv_block)
    new_kv = k_new is not None
    knd, vnd = (step_kv_descriptor(k_new, kv_block), step_kv_descriptor(v_new, kv_block)) if new_kv else (kd, vd)
    grid = (triton.cdiv(t_all * g, BLOCK_M) + nseq, hkv)
    _gluon_paged_attn_kernel[grid](kd, vd, knd, vnd, q, block_table, query_start_loc, seq_lens, out,
                                   float(scale) * LOG2E, nseq, hq, q.stride(0), q.stride(1), out.stride(0),
                                   out.stride(1), block_table.stride(0), G=g, PART_BLOCKS=part_blocks, STAGES=STAGES,
                                   KV_BLOCK=kv_block, PAGE=page, NEW_KV=new_kv, **_knobs(schedule),
                                   num_warps=WARPS)
    return out


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as :func:`kv_descriptor` takes it (TMA-addressable, heads adjacent), copied if not."""
    return x if tma_ok(x) and x.stride(2) == x.shape[3] else x.contiguous()


def gluon_attention_fwd(q, k, v, qpos, klen, scale, out, lse, *, kv_block: int, part_blocks: int, schedule: str):
    """``attention.attention_fwd``'s ``out`` and ``lse`` (allocated by it, written here) by the warp-specialised Gluon
    kernel in one of :data:`SCHEDULES`, with the contract's key block and partition.  What ``attention_fwd`` has
    checked before calling: ``q [B, Tq, Hq, D]`` (last dim contiguous), ``k, v [B, Tk, Hkv, D]`` bf16 / fp16, D 64 or
    128, ``qpos [B, Tq]`` / ``klen [B]`` int64 on q's device, B and Tq not 0."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    k, v = _heads_contiguous(k), _heads_contiguous(v)
    g = hq // hkv
    grid = (triton.cdiv(tq * g, BLOCK_M), b * hkv)
    _gluon_attn_kernel[grid](kv_descriptor(k, kv_block), kv_descriptor(v, kv_block), q, qpos, klen, out, lse,
                             float(scale) * LOG2E, tq, tk, hq, hkv, q.stride(0), q.stride(1), q.stride(2),
                             qpos.stride(0), qpos.stride(1), out.stride(0), out.stride(1), out.stride(2), G=g,
                             PART_BLOCKS=part_blocks, STAGES=STAGES, STORE_LSE=True, **_knobs(schedule),
                             num_warps=WARPS)
    return out, lse
