"""Row-parallel GEMM in one launch (issue #18): the K-segment tree of ``kernels.linear.row_parallel_linear`` on CUDA.

A rank holds ``K_local`` columns of x and w, cut into ``segments`` (1, 2, 4 or 8) equal segments of ``K_seg``.

GPU numerics contract (one output element):

* segment ``s`` is the persistent GEMM of :mod:`.linear` over its K slice, kept in float32: ``BLOCK_K`` and the split
  come from ``config_for(N, K_seg, dtype)`` (the segment's own table entry; never from M), the steps of a split are
  chained on the tensor cores from 0 in K order, split partials are summed in split order from 0 (one split: taken
  as is); a segment whose ``K_seg`` is not a multiple of ``BLOCK_K`` is zero-padded *inside the segment*.  That is
  exactly what ``gemm(x[:, slice], w[:, slice], None, float32)`` computes for the slice;
* the segment partials are summed by the tree of neighbours (``numerics.adjacent_tree_sum``):
  ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``;
* output: the float32 subtree (``out_dtype`` float32, no bias; to be all-gathered under tensor parallelism), or fused
  ``round(tree + bias)`` to ``out_dtype`` (TP = 1) -- the bits of the unfused ``(tree + bias.float()).to(dtype)``.

Schedules (none changes an element's arithmetic; chosen per call from the tile count and the tile's registers, or
forced by the config keys ``TREE_PATH`` / ``TREE_REG`` / ``TREE_LANES`` / ``TREE_PROGS`` of a table entry, or by
``path`` / ``reg_segments`` / ``lanes``):

* the segments are taken in aligned groups of ``REG`` (1, 2, 4, 8) whose subtree is summed in registers (the binary
  counter stack of partials: a group of 8 keeps up to 3 partials plus the running accumulator live);
* *serial*: one program walks all groups of a tile; with more than one group each group's value goes to a
  per-program float32 slot (L2) and the slot is reduced in tree order, a few tile rows at a time, at the end;
* *parallel* (few tiles): one program per (tile, group) writes its group value to a workspace; the last program of a
  tile (atomic counter, shared with :mod:`.linear`) reduces the workspace in tree order;
* *flat* (serial, one chain per segment): one software-pipelined loop over all the tile's K steps; at a segment's
  end its value (``REG`` 2: the pair's) goes to the slot and the accumulator restarts from 0 -- the loads do not
  drain at segment boundaries;
* *lanes* (``LANES`` 2 or 4, serial or parallel, no split inside a segment): the segments of a pair (of a quad) run
  their chains in one K loop with two (four) accumulators, so the group fills the software pipeline once;
* *programs per SM* (``TREE_PROGS`` 2): twice as many persistent programs as SMs, for tiles small enough that two
  fit on an SM, so one program's slot traffic and tree epilogue overlap another's MMAs;
* *partials* (``linear_segments``): one program per (tile, segment) writes the segment's float32 partial to
  ``out[s]`` (no reduction; one launch instead of one GEMM per segment).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ..linear import SEGMENT_COUNTS, check_segments
from ._common import GLUON, device_index, gemm_output, num_sms, on_hopper, tile_coords, tma_ok, tma_sources
from .linear import (_INTERPRETER_SMS, _counters, _epilogue, _epilogue_t, _k_step, _serial_splits, _tile_offsets,
                     config_for, gemm)

REG_BUDGET = 128  # float32 accumulator registers per thread a tree group may keep live (the rest spills to L2)
SMEM_BUDGET = 200 * 1024  # operand bytes the pipeline stages may hold (H100 / H200: 227 KB per block, less scratch)
LANES_MAX_STEPS = 8  # the planner's default LANES is 2 up to this many BLOCK_K steps per segment
WAVE_FILL = 0.9  # parallel path: fewer, longer units unless the last wave of units would leave > 10 % of SMs idle
_FORCE_TREE_PATH = os.environ.get("MC_TREE_PATH", "")  # "", "serial", "parallel", "flat": every call (scheduling only)
_SERIAL_PATH = os.environ.get("MC_TREE_SERIAL", "serial")  # the many-tiles schedule: "serial" or "flat"
_FORCE_LANES = int(os.environ.get("MC_TREE_LANES", "0"))  # 1, 2 or 4: every call (scheduling only); 0: the planner's
GLUON_TREE_MIN_M = 1024  # the Gluon tree from here (session 23, 8B o_proj / down: 0.82-0.90 of cuBLAS vs 0.69-0.83)
GLUON_TREE_SCHEDULE = "ws deep"  # its schedule (gluon_segment_tree.SCHEDULES): the first quad's tile in a global slot


@triton.jit
def _segment(a_src, b_src, off_m, off_n, seg, M, N, K_SEG, stride_am, stride_bn,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr,
             USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """Segment ``seg``'s float32 partial: the GEMM's split arithmetic (:func:`.linear._serial_splits`) over its
    K slice ``[seg K_SEG, (seg + 1) K_SEG)`` (split partials in split order from 0; one split taken as is)."""
    return _serial_splits(a_src, b_src, off_m, off_n, tl.cdiv(K_SEG, BK), M, N, K_SEG, stride_am, stride_bn,
                          BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, seg * K_SEG)


@triton.jit
def _lanes(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
           NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr, LANES: tl.constexpr):
    """The adjacent subtree of segments ``first .. first + LANES - 1`` (``LANES`` 2: ``s0 + s1``; 4:
    ``(s0 + s1) + (s2 + s3)``) with all their chains in ONE K loop (one accumulator each, each from 0 in its own K
    order: the bits of :func:`_segment` per segment), so the group fills the software pipeline once.  No split."""
    if SWAP:
        acc0 = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    if LANES == 4:
        acc2 = tl.zeros_like(acc0)
        acc3 = tl.zeros_like(acc0)
    rk = tl.arange(0, BK)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    k0 = first * K_SEG
    for ki in tl.range(0, tl.cdiv(K_SEG, BK), num_stages=NUM_STAGES):
        k = ki * BK
        acc0 = _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k0, k, M, N, K_SEG, stride_am, stride_bn, acc0,
                       USE_TMA, PRECISION, SWAP)
        acc1 = _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k0 + K_SEG, k, M, N, K_SEG, stride_am, stride_bn,
                       acc1, USE_TMA, PRECISION, SWAP)
        if LANES == 4:
            acc2 = _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k0 + 2 * K_SEG, k, M, N, K_SEG, stride_am,
                           stride_bn, acc2, USE_TMA, PRECISION, SWAP)
            acc3 = _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k0 + 3 * K_SEG, k, M, N, K_SEG, stride_am,
                           stride_bn, acc3, USE_TMA, PRECISION, SWAP)
    if LANES == 4:
        t = (acc0 + acc1) + (acc2 + acc3)
    else:
        t = acc0 + acc1
    return t


@triton.jit
def _pair(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr,
          USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
          LANES: tl.constexpr):
    """``s[first] + s[first + 1]`` (``LANES`` 2: both chains in one loop, :func:`_lanes`)."""
    if LANES == 2:
        t = _lanes(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                   BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP, 2)
    else:
        left = _segment(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                        BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP)
        right = _segment(a_src, b_src, off_m, off_n, first + 1, M, N, K_SEG, stride_am, stride_bn,
                         BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP)
        t = left + right
    return t


@triton.jit
def _quad(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr,
          USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
          LANES: tl.constexpr):
    """``(s[first] + s[first + 1]) + (s[first + 2] + s[first + 3])`` (``LANES`` 4: the four chains in one loop)."""
    if LANES == 4:
        t = _lanes(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                   BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP, 4)
    else:
        left = _pair(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                     BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
        right = _pair(a_src, b_src, off_m, off_n, first + 2, M, N, K_SEG, stride_am, stride_bn,
                      BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
        t = left + right
    return t


@triton.jit
def _subtree(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr,
             USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
             REG: tl.constexpr, LANES: tl.constexpr):
    """Adjacent tree over segments ``first .. first + REG - 1`` in registers, left subtree first (the live partials
    are a binary-counter stack: at most log2(REG) finished subtrees plus the running accumulator)."""
    if REG == 1:
        t = _segment(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                     BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP)
    elif REG == 2:
        t = _pair(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                  BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
    elif REG == 4:
        t = _quad(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                  BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
    else:
        tl.static_assert(REG == 8, "REG must be 1, 2, 4 or 8")
        left = _quad(a_src, b_src, off_m, off_n, first, M, N, K_SEG, stride_am, stride_bn,
                     BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
        right = _quad(a_src, b_src, off_m, off_n, first + 4, M, N, K_SEG, stride_am, stride_bn,
                      BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, LANES)
        t = left + right
    return t


@triton.jit
def _ld(ptr, offs, mask):
    if mask is None:
        v = tl.load(ptr + offs)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")  # .cg: other SMs may have written it
    return v


@triton.jit
def _slot_tree(base, offs, mask, STRIDE: tl.constexpr, G: tl.constexpr):
    """Adjacent tree over the ``G`` float32 values at ``base + g * STRIDE + offs``."""
    if G == 1:
        t = _ld(base, offs, mask)
    elif G == 2:
        t = _ld(base, offs, mask) + _ld(base + STRIDE, offs, mask)
    elif G == 4:
        t = ((_ld(base, offs, mask) + _ld(base + STRIDE, offs, mask))
             + (_ld(base + 2 * STRIDE, offs, mask) + _ld(base + 3 * STRIDE, offs, mask)))
    else:
        tl.static_assert(G == 8, "G must be 1, 2, 4 or 8")
        t = (((_ld(base, offs, mask) + _ld(base + STRIDE, offs, mask))
              + (_ld(base + 2 * STRIDE, offs, mask) + _ld(base + 3 * STRIDE, offs, mask)))
             + ((_ld(base + 4 * STRIDE, offs, mask) + _ld(base + 5 * STRIDE, offs, mask))
                + (_ld(base + 6 * STRIDE, offs, mask) + _ld(base + 7 * STRIDE, offs, mask))))
    return t


@triton.jit
def _tree_slot_epilogue(slot, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                        BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SWAP: tl.constexpr, CH: tl.constexpr, MASKED: tl.constexpr):
    """Tree of the ``G`` group values in ``slot`` (``[G, tile]`` float32), bias, one rounding; ``CH`` tile rows at a
    time (few registers).  ``MASKED``: only rows < M were written (another program's workspace: read through L2)."""
    if SWAP:
        R0: tl.constexpr = BN
        R1: tl.constexpr = BM
    else:
        R0: tl.constexpr = BM
        R1: tl.constexpr = BN
    offs = _tile_offsets(CH, R1)
    for c in tl.static_range(R0 // CH):
        if not MASKED:
            mask = None
        elif SWAP:
            mask = (off_m + tl.arange(0, R1)[None, :] < M) & (tl.arange(0, CH)[:, None] < CH)
        else:
            mask = (off_m + c * CH + tl.arange(0, CH)[:, None] < M) & (tl.arange(0, R1)[None, :] < R1)
        total = _slot_tree(slot + c * (CH * R1), offs, mask, BM * BN, G)
        if SWAP:
            _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n + c * CH, M, N, stride_om, BM, CH, HAS_BIAS)
        else:
            _epilogue(total, bias_ptr, out_ptr, off_m + c * CH, off_n, M, N, stride_om, CH, BN, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "num_progs"])
def _segment_tree_kernel(a_src, b_src, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                         M, N, K_SEG, stride_am, stride_bn, stride_om, num_progs,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                         SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr, SEGMENTS: tl.constexpr, REG: tl.constexpr,
                         MODE: tl.constexpr, USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
                         NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr, CH: tl.constexpr,
                         LANES: tl.constexpr):
    """MODE 0: serial (one program per tile), 1: parallel (one per (tile, group)), 2: partials (one per
    (tile, segment), ``out [SEGMENTS, M, N]`` float32), 3: flat serial (one pipelined K loop per tile)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    num_tiles = num_m * num_n
    G: tl.constexpr = SEGMENTS // REG
    if SWAP:
        offs = _tile_offsets(BN, BM)
    else:
        offs = _tile_offsets(BM, BN)
    if MODE == 2:
        for unit in tl.range(pid, num_tiles * SEGMENTS, num_progs):
            tile = unit // SEGMENTS
            s = unit % SEGMENTS
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            part = _segment(a_src, b_src, off_m, off_n, s, M, N, K_SEG, stride_am, stride_bn,
                            BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP)
            out_s = out_ptr + s.to(tl.int64) * M * N
            if SWAP:
                _epilogue_t(part, bias_ptr, out_s, off_m, off_n, M, N, stride_om, BM, BN, False)
            else:
                _epilogue(part, bias_ptr, out_s, off_m, off_n, M, N, stride_om, BM, BN, False)
    elif MODE == 1:
        for unit in tl.range(pid, num_tiles * G, num_progs):
            tile = unit // G
            g = unit % G
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            val = _subtree(a_src, b_src, off_m, off_n, g * REG, M, N, K_SEG, stride_am, stride_bn,
                           BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, REG, LANES)
            ws_tile = ws_ptr + tile.to(tl.int64) * (G * BM * BN)
            if SWAP:
                pmask = (off_m + tl.arange(0, BM)[None, :]) < M
            else:
                pmask = (off_m + tl.arange(0, BM)[:, None]) < M
            tl.store(ws_tile + g * (BM * BN) + offs, val, mask=pmask)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == G - 1:
                _tree_slot_epilogue(ws_tile, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                                    BM, BN, G, HAS_BIAS, SWAP, CH, True)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    elif MODE == 3:
        # flat: one pipelined loop over all SEGMENTS * k_steps steps of a tile (SPLITS == 1, REG 1 or 2), so loads
        # stream across segment boundaries; at a segment's last step its chain (REG 2: with the previous one) goes
        # to this program's slot and the accumulator restarts from 0
        scratch = ws_ptr + pid.to(tl.int64) * (G * BM * BN)
        k_steps = tl.cdiv(K_SEG, BK)
        rk = tl.arange(0, BK)
        for tile in tl.range(pid, num_tiles, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            if not USE_TMA:
                rm = off_m + tl.arange(0, BM)
                rn = off_n + tl.arange(0, BN)
            if SWAP:
                acc = tl.zeros((BN, BM), dtype=tl.float32)
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            prev = tl.zeros_like(acc)
            for i in tl.range(0, SEGMENTS * k_steps, num_stages=NUM_STAGES):
                seg = i // k_steps
                ki = i - seg * k_steps
                k = ki * BK
                if USE_TMA:
                    a = a_src.load([off_m, seg * K_SEG + k])
                    b = b_src.load([off_n, seg * K_SEG + k])
                else:
                    kk = k + rk
                    a = tl.load(a_src + rm[:, None].to(tl.int64) * stride_am + (seg * K_SEG + kk)[None, :],
                                mask=(rm[:, None] < M) & (kk[None, :] < K_SEG), other=0.0)
                    b = tl.load(b_src + rn[:, None].to(tl.int64) * stride_bn + (seg * K_SEG + kk)[None, :],
                                mask=(rn[:, None] < N) & (kk[None, :] < K_SEG), other=0.0)
                if SWAP:
                    acc = tl.dot(b, a.T, acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
                if ki == k_steps - 1:
                    if REG == 1:
                        tl.store(scratch + seg * (BM * BN) + offs, acc)
                    else:
                        if seg % 2 == 0:
                            prev = acc
                        else:
                            tl.store(scratch + (seg // 2) * (BM * BN) + offs, prev + acc)
                    acc = tl.zeros_like(acc)
            tl.debug_barrier()
            _tree_slot_epilogue(scratch, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                                BM, BN, G, HAS_BIAS, SWAP, CH, False)
            tl.debug_barrier()  # the slot is rewritten by this program's next tile
    else:
        scratch = ws_ptr + pid.to(tl.int64) * (G * BM * BN)  # G > 1 only: this program's slot
        for tile in tl.range(pid, num_tiles, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            if G == 1:
                total = _subtree(a_src, b_src, off_m, off_n, 0, M, N, K_SEG, stride_am, stride_bn,
                                 BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, REG, LANES)
                if SWAP:
                    _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)
                else:
                    _epilogue(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)
            else:
                for g in tl.range(0, G):
                    val = _subtree(a_src, b_src, off_m, off_n, g * REG, M, N, K_SEG, stride_am, stride_bn,
                                   BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP, REG, LANES)
                    tl.store(scratch + g * (BM * BN) + offs, val)  # whole tile: the slot is this program's
                tl.debug_barrier()
                _tree_slot_epilogue(scratch, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                                    BM, BN, G, HAS_BIAS, SWAP, CH, False)
                tl.debug_barrier()  # the slot is rewritten by this program's next tile


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

def segment_config(n: int, k_local: int, segments: int, dtype: torch.dtype, m: int | None = None) -> dict:
    """The config of one segment: ``config_for(N, K_local / segments, dtype, M)`` -- the naive per-segment GEMM's."""
    return config_for(n, k_local // segments, dtype, m)


def _wave_fill(units: int, sms: int) -> float:
    """Busy fraction of the SM slots over all waves of ``units`` one-program units."""
    return units / (triton.cdiv(units, sms) * sms)


def plan(m: int, n: int, k_local: int, segments: int, dtype: torch.dtype, cfg: dict | None = None,
         path: str | None = None, reg_segments: int | None = None, sms: int = 132, lanes: int | None = None) -> dict:
    """Schedule of one call (no effect on the bits): the tile config, ``path``, ``REG`` (segments per register
    group) and ``LANES`` (segment chains per K loop)."""
    k_seg = k_local // segments
    cfg = dict(cfg or segment_config(n, k_local, segments, dtype, m))
    bk = cfg["BK"]
    k_steps = max(1, triton.cdiv(k_seg, bk))
    split_steps = min(cfg["SPLIT_STEPS"], k_steps)
    splits = triton.cdiv(k_steps, split_steps)
    bm, bn = cfg["BM"], cfg["BN"]
    num_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # few tiles (serial would leave SMs idle): one program per (tile, group); else one per tile, "serial" or "flat"
    path = path or _FORCE_TREE_PATH or cfg.get("TREE_PATH") or (
        "parallel" if segments > 1 and num_tiles * 2 <= sms else _SERIAL_PATH)
    if path == "flat" and (splits > 1 or segments == 1):
        path = "serial"  # flat needs one chain per segment and more than one segment
    if path not in ("serial", "parallel", "flat"):
        raise ValueError(f"row-parallel GEMM: unknown path {path!r}")
    reg = reg_segments or cfg.get("TREE_REG")
    if reg is None:
        per_acc = max(1, bm * bn // (32 * cfg["W"]))
        reg = segments  # the largest register group whose live partials fit the budget
        while reg > 1 and (reg.bit_length() + (splits > 1)) * per_acc > REG_BUDGET:
            reg //= 2
        if path == "parallel":  # the fewest groups (longest units) whose units fill the SMs' last wave to >= 90 %
            groups = segments // reg
            while groups < segments and _wave_fill(num_tiles * groups, sms) < WAVE_FILL:
                groups *= 2
            reg = segments // groups
    reg = min(int(reg), segments, 2 if path == "flat" else segments)
    if reg not in SEGMENT_COUNTS:
        raise ValueError(f"row-parallel GEMM: REG={reg} must be one of {SEGMENT_COUNTS}")
    if segments // reg == 1:
        path = "serial"
    # two lanes pay off where a segment is a short loop (H200: +5-12 % at K_seg <= 512, neutral at longer ones)
    lanes = int(lanes or _FORCE_LANES or cfg.get("TREE_LANES", 2 if path == "serial" and k_steps <= LANES_MAX_STEPS else 1))
    if lanes not in (1, 2, 4):
        raise ValueError(f"row-parallel GEMM: LANES={lanes} must be 1, 2 or 4")
    if splits > 1 or reg < 2 or path == "flat":
        lanes = 1  # chains sharing a loop need whole-segment chains (no split) inside a register group
    lanes = min(lanes, reg)
    lane_bytes = (cfg["BM"] + cfg["BN"]) * bk * torch.tensor([], dtype=dtype).element_size()  # one stage, one lane
    while lanes > 2 and 2 * lanes * lane_bytes > SMEM_BUDGET:
        lanes //= 2  # two stages of every lane's operand tiles must fit in shared memory (e.g. 128 x 128: 2 lanes)
    if lanes > 1:  # each pipeline stage holds every lane's operand tiles: fewer stages fit in shared memory
        cfg["S"] = max(2, min(cfg["S"], SMEM_BUDGET // (lanes * lane_bytes)))
    # programs per SM: with 2, one program's slot traffic and tree epilogue overlap another's MMAs (the tile must
    # leave room: half the registers and shared memory each)
    progs = int(cfg.get("TREE_PROGS", 1))
    if progs not in (1, 2):
        raise ValueError(f"row-parallel GEMM: TREE_PROGS={progs} must be 1 or 2")
    return {"cfg": cfg, "path": path, "REG": reg, "LANES": lanes, "k_seg": k_seg, "split_steps": split_steps, "splits": splits,
            "num_tiles": num_tiles, "progs": progs}


def segment_tree_gemm(x2d: torch.Tensor, weight: torch.Tensor, segments: int, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32, *, partials: bool = False, cfg: dict | None = None,
                      path: str | None = None, reg_segments: int | None = None,
                      use_tma: bool | None = None, lanes: int | None = None) -> torch.Tensor:
    """``x2d [M, K_local] @ weight[N, K_local].T`` as ``segments`` K segments reduced by the adjacent tree, one
    launch.  ``partials``: the float32 segment partials ``[segments, M, N]`` instead (``linear_segments``).
    Otherwise ``round(tree + bias)`` in ``out_dtype`` (float32 and no bias: the rank's float32 subtree)."""
    m, k = x2d.shape
    n = weight.shape[0]
    if x2d.dtype != weight.dtype:
        raise TypeError(f"row-parallel GEMM: input dtype {x2d.dtype} != weight dtype {weight.dtype}")
    if weight.shape[1] != k:
        raise ValueError(f"row-parallel GEMM: input has {k} features, weight expects {weight.shape[1]}")
    check_segments(k, segments)
    if partials and bias is not None:
        raise ValueError("row-parallel GEMM: the segment partials carry no bias")
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    dev = x2d.device
    if partials:
        out = torch.empty((segments, m, n), dtype=torch.float32, device=dev)
        if m == 0 or n == 0:
            return out
        if k == 0:
            return out.zero_()
    else:
        out, done = gemm_output(m, n, k, bias, out_dtype, dev)
        if done:
            return out
    on_gpu = dev.type == "cuda"
    sms = num_sms(device_index(x2d)) if on_gpu else _INTERPRETER_SMS
    p = plan(m, n, k, segments, weight.dtype, cfg, path, reg_segments, sms, lanes)
    cfg, reg, k_seg = p["cfg"], p["REG"], p["k_seg"]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    swap = bool(cfg.get("SWAP", False))
    num_tiles = p["num_tiles"]
    groups = segments // reg
    if use_tma is None:
        use_tma = on_gpu and os.environ.get("MC_GEMM_NO_TMA", "") != "1" and tma_ok(x2d) and tma_ok(weight)
    use_tma = use_tma and k_seg % bk == 0  # a TMA box must not read into the next segment
    a_src, b_src = tma_sources(x2d, weight, bm, bn, bk, use_tma)
    cnt = out  # unused unless parallel
    ws = out  # unused unless a slot / workspace is needed
    if partials:
        mode, units = 2, num_tiles * segments
    elif p["path"] == "flat":
        mode, units = 3, num_tiles
    elif p["path"] == "parallel":
        mode, units = 1, num_tiles * groups
        ws = torch.empty(num_tiles * groups * bm * bn, dtype=torch.float32, device=dev)
        cnt = _counters(dev, num_tiles)
    else:
        mode, units = 0, num_tiles
    grid = min(sms * p["progs"], units)
    if mode == 3 or (mode == 0 and groups > 1):  # one slot per program
        ws = torch.empty(grid * groups * bm * bn, dtype=torch.float32, device=dev)
    _segment_tree_kernel[(grid,)](
        a_src, b_src, bias if bias is not None else out, out, ws, cnt,
        m, n, k_seg, x2d.stride(0), weight.stride(0), n if partials else out.stride(0), grid,
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg["G"], SPLIT_STEPS=p["split_steps"] if p["splits"] > 1 else 0,
        SPLITS=p["splits"],
        SEGMENTS=segments, REG=1 if partials else reg, MODE=mode, USE_TMA=use_tma, HAS_BIAS=bias is not None and not partials,
        NUM_STAGES=cfg["S"], PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", SWAP=swap,
        CH=min(32, bn if swap else bm), LANES=1 if partials else p["LANES"], num_warps=cfg["W"], num_stages=cfg["S"],
    )
    return out


def linear_segments_naive(x2d: torch.Tensor, weight: torch.Tensor, segments: int, cfg: dict | None = None,
                          use_tma: bool | None = None) -> torch.Tensor:
    """Reference: one :func:`.linear.gemm` per K segment (float32 out), stacked ``[segments, M, N]`` (the
    implementation before issue #18; tests and benchmarks)."""
    seg = weight.shape[1] // segments
    return torch.stack([gemm(x2d[:, s * seg:(s + 1) * seg].contiguous(), weight[:, s * seg:(s + 1) * seg].contiguous(),
                             None, torch.float32, cfg=cfg, use_tma=use_tma) for s in range(segments)])


@register("linear_segments", "cuda")
def _linear_segments_cuda(x2d: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    return segment_tree_gemm(x2d, weight, segments, partials=True)


def gluon_tree_applies(m: int, n: int, k_local: int, segments: int, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the Gluon tree (:mod:`.gluon_segment_tree`, :data:`GLUON_TREE_SCHEDULE`; ``MC_GLUON``, default on) takes
    a call of these sizes (the caller checks the device and the operands' alignment): bf16 operands, M >= GLUON_TREE_MIN_M,
    whole 64-column steps a segment, and no split inside a segment -- then this kernel's segment chain is the tensor
    core's k16 steps in K order from 0, which is what the Gluon kernel's is (module docstrings): the same bits."""
    if not GLUON or dtype != torch.bfloat16 or out_dtype not in (torch.bfloat16, torch.float32):
        return False
    if m < GLUON_TREE_MIN_M or n % 8 or segments not in SEGMENT_COUNTS or k_local % segments:
        return False
    from .gluon_segment_tree import TILE

    k_seg = k_local // segments
    cfg = segment_config(n, k_local, segments, dtype, m)
    k_steps = triton.cdiv(k_seg, cfg["BK"])
    return k_seg > 0 and k_seg % TILE[2] == 0 and k_steps <= cfg["SPLIT_STEPS"]


@register("linear_segment_tree", "cuda")
def _linear_segment_tree_cuda(x2d: torch.Tensor, weight: torch.Tensor, segments: int, bias: torch.Tensor | None,
                              out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x2d.shape
    if segments == 1:  # one segment: the GEMM over all of K -- gemm's own bits (its split and epilogue), at its speed
        return gemm(x2d, weight, bias, out_dtype)
    if (gluon_tree_applies(m, weight.shape[0], k, segments, x2d.dtype, out_dtype) and weight.dtype == x2d.dtype
            and on_hopper(x2d) and tma_ok(x2d) and tma_ok(weight)):
        from .gluon_segment_tree import gluon_segment_tree

        return gluon_segment_tree(x2d, weight, segments, bias, out_dtype, GLUON_TREE_SCHEDULE)
    return segment_tree_gemm(x2d, weight, segments, bias, out_dtype)
