"""Dense causal GQA attention (training, prefill) on Hopper written in Gluon: the committed kernel's per-row arithmetic
with two warp groups taking turns on the tensor cores -- opt-in (``MC_GLUON=1``).

Why (docs/benchmarks.md, issue #15): the committed Triton kernel (``kernels/triton/attention.py``) runs dense prefill
at 0.57-0.66 of vLLM's FA3 on the H200.  Triton 3.6 waits for each ``wgmma`` right after issuing it and its warp
specialisation does not compile on Hopper for this loop (sessions 12, 14), so a warp group's softmax never overlaps a
tensor-core chain.  Here a producer warp loads each key block's K and V by TMA into a ring of shared-memory slots, and
two consumer warp groups take the upper and lower 64 rows of a 128-row query tile and walk the same key blocks, each
releasing a slot once its chains on it are done; nothing else synchronises them, so one group's softmax runs while
the other's ``wgmma`` runs (the structure of FA3's two consumer warp groups, without its explicit ping-pong).

Numerics: the contract of ``attention.py`` (its module docstring), unchanged, so the bits must equal
``attention.attention_fwd``'s: query rows packed token-major then the ``G`` heads of a kv head into the same 128-row
tiles (not needed for the bits: a row's arithmetic does not depend on its tile); key blocks of ``KV_BLOCK_GPU`` (64)
in increasing order, partitions of ``PART_BLOCKS`` blocks from a fresh state; per block ``s = q . k`` by the tensor
cores from nothing (head dimension in 16-wide steps), invisible keys ``-inf`` (blocks below the tile's ``full`` key
are visible to every active row and skip the mask, as there), ``m' = max(m, max s)``, ``alpha = exp2((m - m_ref) *
c)``, ``p = exp2((s - m_ref) * c)`` rounded to the input dtype, ``l = mma(p, 1, l * alpha)``, ``acc = mma(p, v, acc *
alpha)``; partitions merged in order with the same ``fma`` formula, an empty one selected away; ``out = round(acc /
l)``, ``lse = fma(M, c, log2 L) * ln2``.  Keys past the key tensor's length read as 0 (the TMA unit fills them), as
the committed kernel's masked loads.

Use: with ``MC_GLUON=1`` the registered ``("attention", "cuda")`` op (the trainer's attention) runs ``ws lookahead``
where ``attention.gluon_attention_applies`` says (prefill-sized bf16 / fp16 calls, head dim 64 or 128, Hopper).  The
engine's paged prefill keeps the Triton kernel.  Bits and speed (session 24, H200: bits equal in every case, dense
prefill T = 4k / 16k 1.07-1.24x the committed kernel, 0.63-0.79 of FA3): ``tests/test_gpu_gluon_candidates.py -k
attention`` (``torch.equal`` against ``attention_fwd``: partitions, ragged blocks, chunks over a prefix, padding,
strided views, GQA / MHA, D 64 / 128; a wrong partition caught) and ``python benchmarks/bench_gpu_attention.py
--gluon``; sm_90a compile without a GPU: ``benchmarks/offline_compile_gluon.py --only attention``.
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
from .attention import GLUON_ATTENTION_HEAD_DIMS, KV_BLOCK_GPU, PART_BLOCKS
from .gluon_ring import GL_DTYPES

BLOCK_M = 128  # a tile's packed query rows: two consumer warp groups of 64
STAGES = 4  # ring slots of one key block's K and V (4 x 32 KB at D = 128)
# name -> LOOKAHEAD: "ws" -- each consumer waits for every chain right after issuing it (the other consumer keeps
# the tensor cores busy meanwhile); "ws lookahead" -- block j + 1's scores issued before block j's two chains, whose
# wait comes after block j + 1's softmax (FA3's overlap inside a warp group).  Same arithmetic, same bits.
SCHEDULES = {"ws": False, "ws lookahead": True}
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
def _rows(tile, b, kvh, QPOS, Tq, spb, spt, ROW0: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr, layout: gl.constexpr):
    """Packed rows ``ROW0 .. ROW0 + ROWS`` of ``tile`` -> (valid, token, query head, position: -1 if not valid)."""
    rr = tile * (2 * ROWS) + ROW0 + gl.arange(0, ROWS, layout=layout)
    t = rr // G
    rv = t < Tq
    pos = gl.load(QPOS + b.to(gl.int64) * spb + t.to(gl.int64) * spt, mask=rv, other=-1).to(gl.int32)
    return rv, t, kvh * G + rr % G, pos


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, ones_smem, ready, empty, QPOS, O, LSE, qk_scale, tile, b, kvh, kl, n_blocks,
              full, Tq, HQ, spb, spt, sob, sot, soh, WG: gl.constexpr, G: gl.constexpr, PART_BLOCKS: gl.constexpr,
              STAGES: gl.constexpr, STORE_LSE: gl.constexpr, LOOKAHEAD: gl.constexpr):
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
    q_rows = q_smem.slice(WG * ROWS, ROWS)
    _, _, _, pos = _rows(tile, b, kvh, QPOS, Tq, spb, spt, WG * ROWS, ROWS, G, row_s)
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
        s = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_init, use_acc=False)
        m_i, alpha, p = _probabilities(s, m_i, pos, kcols, 0, full, kl, qk_scale, dtype)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        l_mat = l_mat * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
        for j in range(n_blocks):
            slot = j % STAGES
            nxt = (j + 1) % STAGES  # past the last block: a slot's stale keys, scored and never used
            mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1, pred=j + 1 < n_blocks)
            s_next = warpgroup_mma(q_rows, k_bufs.index(nxt).permute((1, 0)), s_init, use_acc=False, is_async=True)
            p_o = gl.convert_layout(p, dot_o)
            p_l = gl.convert_layout(p, dot_l)
            acc_next = warpgroup_mma(p_o, v_bufs.index(slot), acc, is_async=True)
            l_next = warpgroup_mma(p_l, ones_smem, l_mat, is_async=True)
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
    rv, t, hq, pos_o = _rows(tile, b, kvh, QPOS, Tq, spb, spt, WG * ROWS, ROWS, G, row_o)
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


@gluon.jit(do_not_specialize=["Tq", "Tk", "HQ", "HKV"])
def _gluon_attn_kernel(k_desc, v_desc, Q, QPOS, KLEN, O, LSE, qk_scale, Tq, Tk, HQ, HKV, sqb, sqt, sqh, spb, spt,
                       sob, sot, soh, G: gl.constexpr, PART_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                       STORE_LSE: gl.constexpr, LOOKAHEAD: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query tile, sequence x kv head), heaviest tile first (as ``attention._map_tile``): the tile's
    queries into shared memory, its key range (the committed kernel's ``hi`` and ``full``), then the producer warp
    (:func:`_kv_producer`) and the two consumer warp groups (:func:`_consumer`; the first is the default partition)."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    BM: gl.constexpr = 2 * 64
    dtype: gl.constexpr = k_desc.dtype
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    b = gl.program_id(1) // HKV
    kvh = gl.program_id(1) % HKV
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rv, t, hq, pos = _rows(tile, b, kvh, QPOS, Tq, spb, spt, 0, BM // 2, G, gl.SliceLayout(1, q_layout))
    rv2, t2, hq2, pos2 = _rows(tile, b, kvh, QPOS, Tq, spb, spt, BM // 2, BM // 2, G, gl.SliceLayout(1, q_layout))
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
    kl = gl.minimum(gl.load(KLEN + b), Tk).to(gl.int32)
    top = gl.maximum(gl.max(pos, 0), gl.max(pos2, 0))
    hi = gl.maximum(gl.minimum(top + 1, kl), 0)
    low = gl.minimum(gl.min(gl.where(pos >= 0, pos + 1, 1 << 30), 0), gl.min(gl.where(pos2 >= 0, pos2 + 1, 1 << 30), 0))
    full = gl.maximum((gl.minimum(low, kl) // BLOCK_N) * BLOCK_N, 0)
    full = gl.minimum(full, hi)
    n_blocks = (hi + BLOCK_N - 1) // BLOCK_N
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], ring_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], ring_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([(_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, QPOS, O, LSE, qk_scale, tile, b,
                                     kvh, kl, n_blocks, full, Tq, HQ, spb, spt, sob, sot, soh, 0, G, PART_BLOCKS,
                                     STAGES, STORE_LSE, LOOKAHEAD)),
                        (_consumer, (q_smem, k_bufs, v_bufs, ones_smem, ready, empty, QPOS, O, LSE, qk_scale, tile, b,
                                     kvh, kl, n_blocks, full, Tq, HQ, spb, spt, sob, sot, soh, 1, G, PART_BLOCKS,
                                     STAGES, STORE_LSE, LOOKAHEAD)),
                        (_kv_producer, (k_desc, v_desc, ready, empty, k_bufs, v_bufs, b, kvh * D, n_blocks, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def kv_descriptor(x: torch.Tensor) -> TensorDescriptor:
    """TMA descriptor of ``x [B, Tk, Hkv, D]`` (heads contiguous) as ``[B, Tk, Hkv * D]`` in blocks of one sequence's
    ``KV_BLOCK_GPU`` keys x one head: keys past ``Tk`` read as 0."""
    b, tk, hkv, d = x.shape
    block = [1, KV_BLOCK_GPU, d]
    return TensorDescriptor(x, [b, tk, hkv * d], [x.stride(0), x.stride(1), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[x.dtype]))


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a TMA descriptor takes it (last dim contiguous, heads adjacent, 16-byte aligned base and rows), copied
    if not."""
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:2])
    return x if aligned and x.stride(-1) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def gluon_attention_fwd(q, k, v, q_positions, k_lengths, scale, schedule: str = "ws"):
    """``attention.attention_fwd``'s ``(out, lse)`` (module docstring) by the warp-specialised Gluon kernel, on Hopper,
    in one of :data:`SCHEDULES`; ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]`` bf16 / fp16, D 64 or 128,
    ``q_positions [B, Tq]`` (-1 padding), ``k_lengths [B]``."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"gluon attention: q, k, v must share a bf16 / fp16 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in GLUON_ATTENTION_HEAD_DIMS:
        raise ValueError(f"gluon attention: head dim {d}; this kernel serves {GLUON_ATTENTION_HEAD_DIMS}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k, v = _heads_contiguous(k), _heads_contiguous(v)
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, tq), dtype=torch.float32, device=q.device)
    if b == 0 or tq == 0:
        return out, lse
    qpos = q_positions.to(device=q.device, dtype=torch.int64)
    klen = k_lengths.to(device=q.device, dtype=torch.int64)
    g = hq // hkv
    grid = (triton.cdiv(tq * g, BLOCK_M), b * hkv)
    _gluon_attn_kernel[grid](kv_descriptor(k), kv_descriptor(v), q, qpos, klen, out, lse, float(scale) * LOG2E,
                             tq, tk, hq, hkv, q.stride(0), q.stride(1), q.stride(2), qpos.stride(0), qpos.stride(1),
                             out.stride(0), out.stride(1), out.stride(2), G=g, PART_BLOCKS=PART_BLOCKS, STAGES=STAGES,
                             STORE_LSE=True, LOOKAHEAD=SCHEDULES[schedule], num_warps=WARPS)
    return out, lse
