"""The row-parallel K-segment tree at large M written in Gluon (on Hopper by default; ``MC_GLUON=0`` off) (Triton 3.6's explicit-layout dialect),
warp-specialised.

Why (docs/benchmarks.md, "Row-parallel K-segment tree"): at M >= 1024 the committed tree kernel
(``kernels/triton/segment_tree.py``) runs at 0.53-0.87 of cuBLAS where the pre-tree GEMM runs at 0.9-1.0, and ten
sessions of schedules in ``triton.language`` did not close it: each segment restarts the software pipeline (its loads
drain and refill) and the partials of the tree cost registers.  Here a producer warp runs ONE ring of TMA loads
through all segments and all tiles of a persistent program, and two consumer warp groups take a tile's upper and lower
64 rows; each issues a segment's first ``wgmma`` (into fresh registers) before it waits for the previous segment's
chain and puts it on the tree, and the two meet only at the ring's slots, so one group's tile end (drain, tree top,
store) runs while the other's chain keeps the tensor cores busy.

Numerics (the tree kernel's contract, so the bits must equal ``segment_tree.segment_tree_gemm``): segment ``s`` is the
``wgmma`` chain over its ``K_seg`` columns in K order, from nothing (``use_acc=False`` on its first step) -- the tensor
core's own k16 steps in K order, independent of BM / BN / BK; the segment partials are summed as
``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` in float32 (fewer segments: the same tree's left part); then
``+ bias`` in float32 and one rounding to the output dtype (float32 output: the subtree, for a tensor-parallel rank).

Schedules (:data:`SCHEDULES`): ``ws`` -- the tree's pair and first quad in shared memory, a 3-stage ring (session 22:
0.70 of cuBLAS on the 8B o_proj at M = 1024 / 4096, +4 % over the committed tree, but 0.70-0.74 on down, -11-13 %;
session 20's single-issuer schedules ``smem`` / ``regs``, 0.50-0.61, were removed as slower everywhere); ``ws deep``
-- the first quad's tile in a float32 slot in global memory, so a 5-stage ring (session 23: 0.82 / 0.79 of cuBLAS on
the 8B o_proj at M = 1024 / 4096, 0.90 / 0.83 on down, ahead of the committed tree's 0.69 / 0.68 and 0.83 / 0.83);
``ws grouped`` -- ``ws`` in the committed kernels' grouped tile order (session 23: no better than ``ws``).

Use: unless ``MC_GLUON=0`` the registered ``linear_segment_tree`` op (``segment_tree._linear_segment_tree_cuda``) runs
``ws deep`` on a Hopper GPU where ``segment_tree.gluon_tree_applies`` says (bf16, M >= 1024, no split inside a
segment); default since session 31 (``check`` zero at b, b8, d, d8 with it).  Bits and speed:
``bench_gpu_row_parallel.py --gluon`` on the H200 (``torch.equal`` against the committed tree; time against cuBLAS
and the pre-tree GEMM in the same run); the edges: ``tests/test_gpu_gluon_candidates.py``; sm_90a compile without a
GPU: ``benchmarks/offline_compile_gluon.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_ring import (descriptor, operand_ring, program_work, release_barriers, release_slot,
                        ring_producer, store_tile, tile_origin)

# registers a thread of the warp-specialised schedule's consumer warp groups (three 64 x 128 float32 tiles live: the
# running chain, the next segment's first step, the tree's lowest level) and of its producer warp
WS_CONSUMER_REGS: gl.constexpr = gl.constexpr(240)
WS_PRODUCER_REGS: gl.constexpr = gl.constexpr(24)


@gluon.jit
def _ws_tree_push(v, low, mid, top, seg: gl.constexpr, TOP_IN_GLOBAL: gl.constexpr):
    """Segment ``seg``'s finished chain ``v`` onto one consumer's tree (module docstring), unless it is the last one:
    the lowest level in registers (``low``, returned), the pair's in shared memory (``mid``), the first quad's in
    shared memory or, ``TOP_IN_GLOBAL``, in the program's float32 slot in global memory (``top``: a tile of
    pointers).  The output is staged in ``mid`` (``TOP_IN_GLOBAL``) or ``top``, so the previous tile's store must have
    left it before it is written.  A level is loaded only once the sum it is added to is formed (fewer live tiles:
    the next segment's chain runs meanwhile)."""
    if seg % 2 == 0:
        low = v
    elif seg % 4 == 1:
        if TOP_IN_GLOBAL:
            tma.store_wait(pendings=0)
        mid.store(low + v)
    else:  # segment 3 of 8: the first quad
        pair = low + v
        quad = mid.load(v.type.layout) + pair
        if TOP_IN_GLOBAL:
            gl.store(top, quad)
        else:
            tma.store_wait(pendings=0)
            top.store(quad)
    return low


@gluon.jit
def _ws_tree_total(v, low, mid, top, SEGMENTS: gl.constexpr, TOP_IN_GLOBAL: gl.constexpr):
    """The tree's value, ``v`` the last segment's chain (:func:`_ws_tree_push` took the others)."""
    if SEGMENTS == 1:
        total = v
    else:
        total = low + v
        if SEGMENTS >= 4:
            total = mid.load(v.type.layout) + total
        if SEGMENTS == 8:
            total = (gl.load(top) if TOP_IN_GLOBAL else top.load(v.type.layout)) + total
    return total


@gluon.jit
def _ws_tree_consumer(a_bufs, b_bufs, ready, empty, levels, out_desc, bias_ptr, top_ptr, M, N, WG: gl.constexpr,
                      SEGMENTS: gl.constexpr, SEG_STEPS: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                      TOP_IN_GLOBAL: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer ``WG`` (one warp group): rows ``WG * BM / 2 ..`` of every tile of the program.  A segment's first
    ``wgmma`` is issued (into fresh registers) before the previous segment's chain is waited for and put on the tree,
    so inside a tile its tensor-core work never waits for a boundary; the other consumer's chain covers its tile end
    (drain, tree top, store).  ``levels``: its pair's tile, and without ``TOP_IN_GLOBAL`` its first quad's."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    ROWS: gl.constexpr = BM // 2
    BN: gl.constexpr = b_bufs.type.shape[1]
    STEPS: gl.constexpr = SEGMENTS * SEG_STEPS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid, nprog, num_pid_m, num_pid_n, total_steps = program_work(BM, BN, M, N, STEPS)
    if TOP_IN_GLOBAL:
        mid = levels.index(WG)
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        top = (top_ptr + (pid * 2 + WG).to(gl.int64) * (ROWS * BN) + gl.expand_dims(rows, 1) * BN
               + gl.expand_dims(cols, 0))
        staging = mid
    else:
        mid = levels.index(2 * WG)
        top = levels.index(2 * WG + 1)
        staging = top
    acc = gl.zeros((ROWS, BN), gl.float32, acc_layout)
    gl.static_assert(gl.bank_conflicts(acc.type, mid.type) == 0)
    low = acc
    c = 0
    for tile in range(pid, num_pid_m * num_pid_n, nprog):
        off_m, off_n = tile_origin(tile, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        off_m += WG * ROWS
        for seg in gl.static_range(SEGMENTS):
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            new = warpgroup_mma(a_bufs.index(slot).slice(WG * ROWS, ROWS), b_bufs.index(slot).permute((1, 0)),
                                gl.zeros((ROWS, BN), gl.float32, acc_layout), use_acc=False, is_async=True)
            if seg == 0:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(new,))  # (nothing to wait for: it runs on)
            else:  # the previous segment's chain is done, the new one runs on
                prev, acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, new))
                release_slot(c - 1, empty, STAGES)
                low = _ws_tree_push(prev, low, mid, top, seg - 1, TOP_IN_GLOBAL)
            c += 1
            for ks in range(1, SEG_STEPS):
                slot = c % STAGES
                mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot).slice(WG * ROWS, ROWS), b_bufs.index(slot).permute((1, 0)),
                                    acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                release_slot(c - 1, empty, STAGES)
                c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        release_slot(c - 1, empty, STAGES)
        total_tile = _ws_tree_total(acc, low, mid, top, SEGMENTS, TOP_IN_GLOBAL)
        if SEGMENTS < (4 if TOP_IN_GLOBAL else 8):  # (else waited for before the staging tile was written)
            tma.store_wait(pendings=0)
        store_tile(total_tile, out_desc, staging._reinterpret(out_desc.dtype, out_desc.block_type.shape,
                                                              out_desc.layout), bias_ptr, off_m, off_n, N, HAS_BIAS)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_tree_kernel(a_desc, b_desc, out_desc, bias_ptr, top_ptr, M, N,
                    SEGMENTS: gl.constexpr, SEG_STEPS: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                    TOP_IN_GLOBAL: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised: a producer warp runs the ring (``gluon_ring.ring_producer``) and two consumer warp groups
    (:func:`_ws_tree_consumer`; the first is the default partition) take the upper and lower 64 rows of each tile,
    synchronised only through the ring.  ``TOP_IN_GLOBAL``: the first quad's tiles go to ``top_ptr`` (a float32 slot
    of two 64 x BN tiles a program), which leaves shared memory for a deeper ring."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs, b_bufs, ready = operand_ring(a_desc, b_desc, STAGES)
    empty = release_barriers(STAGES, 2)
    # a consumer's pair and (in shared memory) first quad; the last of them also stages the output
    levels = gl.allocate_shared_memory(gl.float32, [2 if TOP_IN_GLOBAL else 4, BM // 2, BN],
                                       gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    gl.warp_specialize([(_ws_tree_consumer, (a_bufs, b_bufs, ready, empty, levels, out_desc, bias_ptr, top_ptr, M, N,
                                             0, SEGMENTS, SEG_STEPS, STAGES, HAS_BIAS, TOP_IN_GLOBAL, GROUP_M)),
                        (_ws_tree_consumer, (a_bufs, b_bufs, ready, empty, levels, out_desc, bias_ptr, top_ptr, M, N,
                                             1, SEGMENTS, SEG_STEPS, STAGES, HAS_BIAS, TOP_IN_GLOBAL, GROUP_M)),
                        (ring_producer, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, SEGMENTS * SEG_STEPS,
                                         STAGES, GROUP_M))],
                       [4, 1], [WS_CONSUMER_REGS, WS_PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# name -> (stages, extra constexprs) of the warp-specialised kernel (4 warps launched, + 4 + 1 in the partitions;
# 128 x 128 x 64 steps in two 64-row halves, boundaries hidden in each half): "ws": a 3 x 32 KB ring next to four 32 KB
# float32 tiles (a consumer's pair and first quad), tiles M fastest; "ws deep": the first quad in a float32 slot in
# global memory (written and read once a tile), so a 5 x 32 KB ring (session 22: "ws" lost on the long segments of
# the 8B down projection, where prefetch depth counts more than boundaries); "ws grouped": "ws" in the committed
# kernels' grouped tile order (bands of 8 M tiles, an activation tile reused across a band's columns).  (Without
# hiding the boundaries the pair could stay in registers, but the offline compile spills 112-512 bytes there.)
SCHEDULES = {"ws": (3, {"TOP_IN_GLOBAL": False, "GROUP_M": 0}), "ws deep": (5, {"TOP_IN_GLOBAL": True, "GROUP_M": 0}),
             "ws grouped": (3, {"TOP_IN_GLOBAL": False, "GROUP_M": 8})}
TILE = (128, 128, 64)  # BM, BN, BK
WARPS = 4
OUT_ROWS = TILE[0] // 2


def descriptors(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    """TMA descriptors of ``x [M, K]`` (blocks BM x BK), ``w [N, K]`` (BN x BK) and ``out [M, N]`` (BM / 2 x BN)."""
    bm, bn, bk = TILE
    return descriptor(x, [bm, bk]), descriptor(w, [bn, bk]), descriptor(out, [OUT_ROWS, bn])


def gluon_segment_tree(x: torch.Tensor, w: torch.Tensor, segments: int, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, schedule: str = "ws") -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` as the K-segment tree (module docstring), on CUDA, by one of :data:`SCHEDULES`: one
    persistent program an SM."""
    stages, extra = SCHEDULES[schedule]
    bm, bn, bk = TILE
    m, k = x.shape
    n = w.shape[0]
    if k % segments or (k // segments) % bk:
        raise ValueError(f"K = {k} in {segments} segments of whole {bk}-column steps: not possible")
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    grid = min(torch.cuda.get_device_properties(x.device).multi_processor_count, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    # the first quad's slots in global memory (or, in shared memory, a placeholder)
    top = torch.empty(grid * bm * bn, dtype=torch.float32, device=x.device) if extra["TOP_IN_GLOBAL"] else out
    _ws_tree_kernel[(grid,)](*descriptors(x, w, out), bias if bias is not None else out, top, m, n,
                             SEGMENTS=segments, SEG_STEPS=k // segments // bk, STAGES=stages,
                             HAS_BIAS=bias is not None, num_warps=WARPS, **extra)
    return out

