"""The block-FP8 GEMM on Hopper written in Gluon (on Hopper by default; ``MC_GLUON=0`` off): warp-specialised, so the per-group scaling and the
split sums overlap the tensor cores.

Why (docs/fp8.md, docs/benchmarks.md): the committed kernel (``kernels/triton/fp8_linear.py``) is 0.69-0.75 of cuBLAS
block-FP8 ``_scaled_mm`` at M = 4096 (issue #15 asks 0.75), and the reason is structural in ``triton.language`` 3.6:
each group's ``tl.dot`` starts from 0 (the contract), so its ``wgmma`` is waited for right after it is issued and the
``fma`` with the group's scales never overlaps a tensor-core chain.  Here a producer warp runs one ring of TMA loads
through all groups, splits and tiles of a persistent program, and two consumer warp groups take a tile's upper and
lower 64 rows, each releasing a slot once its chain on it is done, with nothing else synchronising them: one group's
scaling and split sums run while the other's ``wgmma`` chain runs.

Numerics: the contract of ``fp8_linear`` (steps 2-5 of its docstring), so the bits must equal
``fp8_linear.fp8_gemm``: ``p_g`` = the FP8 ``wgmma`` chain over group g's 128 products from nothing
(``use_acc=False``; Hopper's default imprecise FP8 accumulation, as ``tl.dot``), ``acc = fma(p_g, xs * ws, acc)``
with the two scales multiplied first, groups in K order, ``acc`` from 0; the splits of ``SPLIT_GROUPS`` groups (the
(N, K) table's) summed in split order from 0 (one split: taken as is); + bias in float32, one rounding.  ``SWS``: one
weight scale per (tile, group), as the committed kernel's ``SWS`` (the same float32 values).

Schedules (:data:`SCHEDULES`): ``ws`` -- each consumer issues group ``c + 1``'s chain before it waits for group
``c``'s and scales it, the split sums in shared memory (session 22: 0.66-0.78 of ``_scaled_mm`` at M = 4096, ahead of
the best ``tl`` tile where the reduction has one or two splits, behind at four; session 20's single-warp-group
pipelined kernel, 0.55-0.74, was removed as slower everywhere); ``ws regs`` -- without the chain issued ahead, the
split sums in registers (session 23: 0.80-0.97 at M = 256-4096 on the 8B qkv / gate/up, one or two splits; 0.35-0.38
at four, where the offline compile spills 432 bytes); ``ws grouped`` -- ``ws`` in the committed kernels' grouped
tile order (session 23: no better than ``ws``); ``ws smem sums`` -- without the chain ahead, the split sums in shared
memory (session 24: 0.77 / 0.80 / 0.91 at M = 256 / 1024 / 4096 on 4096 x 4096, four splits).  Same arithmetic, same
bits.

Use: unless ``MC_GLUON=0`` the registered ``fp8_linear`` op (``fp8_linear._fp8_linear_cuda``) runs ``ws regs`` on a
Hopper GPU where ``fp8_linear.gluon_fp8_applies`` says (M >= 256, one weight scale per 128-row tile), ``ws smem sums``
instead where the (N, K) table has more than two splits (``fp8_linear.gluon_fp8_schedule``); default since session 31
(``check`` zero at b8 and d8, rollout b8 1.045x the committed kernel, the same tokens). Bits and speed: ``python
benchmarks/sweep_gpu_gemm.py --only-fp8 --gluon`` on the H200 (``torch.equal`` against the committed kernel, time
against ``_scaled_mm`` in the same run); the edges: ``tests/test_gpu_gluon_candidates.py``; sm_90a compile without a
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

GROUP = 128  # the activation group = the weight block's columns = one K step
TILE = (128, 128)  # BM, BN: two warp groups of 64 rows
# registers a thread of the warp-specialised kernel's consumer warp groups (three 64 x 128 float32 tiles live: the
# scaled sum, the finished chain, the next chain) and of its producer warp
WS_CONSUMER_REGS: gl.constexpr = gl.constexpr(240)
WS_PRODUCER_REGS: gl.constexpr = gl.constexpr(24)


@gluon.jit
def _issue_mma(c, total_steps, bars, a_bufs, b_bufs, p_layout: gl.constexpr, STAGES: gl.constexpr, ROW0: gl.constexpr,
               ROWS: gl.constexpr):
    """Group chain of global step ``c`` for the tile's rows ``ROW0 .. ROW0 + ROWS`` (a consumer's half), from nothing,
    asynchronously (its loads waited for first; past the program's last step nothing is waited for)."""
    BN: gl.constexpr = b_bufs.type.shape[1]
    slot = c % STAGES
    mbarrier.wait(bars.index(slot), (c // STAGES) & 1, pred=c < total_steps)
    p = gl.zeros((ROWS, BN), gl.float32, p_layout)
    return warpgroup_mma(a_bufs.index(slot).slice(ROW0, ROWS), b_bufs.index(slot).permute((1, 0)), p, use_acc=False,
                         is_async=True)


@gluon.jit
def _scale_vectors(as_ptr, bs_ptr, off_m, off_n, g, M, N, stride_asm, stride_bsn, rows, cols, SWS: gl.constexpr):
    """Group ``g``'s activation scales of the tile's rows and weight scales of its columns (``SWS``: the tile's one)."""
    sa = gl.load(as_ptr + (off_m + rows).to(gl.int64) * stride_asm + g, mask=off_m + rows < M, other=0.0)
    if SWS:
        sb = gl.load(bs_ptr + off_n.to(gl.int64) * stride_bsn + g)
    else:
        sb = gl.load(bs_ptr + (off_n + cols).to(gl.int64) * stride_bsn + g, mask=off_n + cols < N, other=0.0)
    return sa, sb


@gluon.jit
def _scaled_fma(p, sa, sb, acc, SWS: gl.constexpr):
    """``fma(p, sa * sb, acc)``: the two scales multiplied first (one rounding), then one fused multiply-add."""
    if SWS:
        scale, p = gl.broadcast(gl.expand_dims(sa * sb, 1), p)
    else:
        scale, p = gl.broadcast(gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0), p)
    return gl.fma(p, scale, acc)


@gluon.jit
def _ws_consumer(a_bufs, b_bufs, ready, empty, smem, out_desc, as_ptr, bs_ptr, bias_ptr, M, N, stride_asm, stride_bsn,
                 WG: gl.constexpr, G_ALL: gl.constexpr, SPLIT_GROUPS: gl.constexpr, SPLITS: gl.constexpr,
                 STAGES: gl.constexpr, SWS: gl.constexpr, HAS_BIAS: gl.constexpr, LOOKAHEAD: gl.constexpr,
                 SUMS_IN_SMEM: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer ``WG`` (one warp group) of the warp-specialised kernel: rows ``WG * BM / 2 ..`` of every tile of the
    program, the arithmetic of :func:`_fp8_kernel`; it releases a slot once its chain on it is done, and stores its
    half tile itself through ``smem.index(WG)``.  ``LOOKAHEAD``: group ``c + 1``'s chain is issued before group
    ``c``'s is scaled (three float32 tiles live); else each chain is waited for right away -- the other consumer's
    chain keeps the tensor cores busy meanwhile.  ``SUMS_IN_SMEM``: the split sums in ``smem`` (float32, also the
    output's staging); else in registers (``smem`` only stages the output)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    ROWS: gl.constexpr = BM // 2
    BN: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    own = smem.index(WG)
    pid, nprog, num_pid_m, num_pid_n, total_steps = program_work(BM, BN, M, N, G_ALL)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    if LOOKAHEAD:
        pending = _issue_mma(0, total_steps, ready, a_bufs, b_bufs, acc_layout, STAGES, WG * ROWS, ROWS)
    c = 0
    for tile in range(pid, num_pid_m * num_pid_n, nprog):
        off_m, off_n = tile_origin(tile, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        off_m += WG * ROWS
        for s in gl.static_range(SPLITS):
            acc = gl.zeros((ROWS, BN), gl.float32, acc_layout)
            for g in range(s * SPLIT_GROUPS, min(G_ALL, (s + 1) * SPLIT_GROUPS)):
                sa, sb = _scale_vectors(as_ptr, bs_ptr, off_m, off_n, g, M, N, stride_asm, stride_bsn, rows, cols,
                                        SWS)
                if LOOKAHEAD:
                    nxt = _issue_mma(c + 1, total_steps, ready, a_bufs, b_bufs, acc_layout, STAGES, WG * ROWS, ROWS)
                    p = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
                    pending = nxt
                else:
                    p = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_mma(
                        c, total_steps, ready, a_bufs, b_bufs, acc_layout, STAGES, WG * ROWS, ROWS),))
                release_slot(c, empty, STAGES)
                acc = _scaled_fma(p, sa, sb, acc, SWS)
                c += 1
            if SPLITS == 1:
                final = acc
            elif not SUMS_IN_SMEM:  # the split partials summed in split order from 0, in registers
                if s == 0:
                    sums = acc + 0.0
                elif s == SPLITS - 1:
                    final = sums + acc
                else:
                    sums = sums + acc
            elif s == 0:
                tma.store_wait(pendings=0)
                own.store(acc + 0.0)
            elif s == SPLITS - 1:
                final = own.load(acc_layout) + acc
            else:
                own.store(own.load(acc_layout) + acc)
        if SUMS_IN_SMEM:
            if SPLITS == 1:
                tma.store_wait(pendings=0)
            staging = own._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        else:
            tma.store_wait(pendings=0)
            staging = own
        store_tile(final, out_desc, staging, bias_ptr, off_m, off_n, N, HAS_BIAS)
    if LOOKAHEAD:
        warpgroup_mma_wait(num_outstanding=0, deps=(pending,))  # the chain issued past the last step (never read)
    tma.store_wait(pendings=0)


@gluon.jit
def _fp8_ws_kernel(a_desc, b_desc, out_desc, as_ptr, bs_ptr, bias_ptr, M, N, stride_asm, stride_bsn,
                   G_ALL: gl.constexpr, SPLIT_GROUPS: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr,
                   SWS: gl.constexpr, HAS_BIAS: gl.constexpr, LOOKAHEAD: gl.constexpr, SUMS_IN_SMEM: gl.constexpr,
                   GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised: a producer warp runs the ring (``gluon_ring.ring_producer``), two consumer warp groups
    (:func:`_ws_consumer`; the first is the default partition) take the upper and lower 64 rows of each tile with no
    synchronisation between them but the ring's, so one's group scaling runs while the other's ``wgmma`` runs."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs, b_bufs, ready = operand_ring(a_desc, b_desc, STAGES)
    empty = release_barriers(STAGES, 2)
    if SUMS_IN_SMEM:  # a consumer's float32 split sums, also its output staging
        smem = gl.allocate_shared_memory(gl.float32, [2, BM // 2, BN], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    else:  # a consumer's output staging
        smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    gl.warp_specialize([(_ws_consumer, (a_bufs, b_bufs, ready, empty, smem, out_desc, as_ptr, bs_ptr, bias_ptr, M, N,
                                        stride_asm, stride_bsn, 0, G_ALL, SPLIT_GROUPS, SPLITS, STAGES, SWS, HAS_BIAS,
                                        LOOKAHEAD, SUMS_IN_SMEM, GROUP_M)),
                        (_ws_consumer, (a_bufs, b_bufs, ready, empty, smem, out_desc, as_ptr, bs_ptr, bias_ptr, M, N,
                                        stride_asm, stride_bsn, 1, G_ALL, SPLIT_GROUPS, SPLITS, STAGES, SWS, HAS_BIAS,
                                        LOOKAHEAD, SUMS_IN_SMEM, GROUP_M)),
                        (ring_producer, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, G_ALL, STAGES, GROUP_M))],
                       [4, 1], [WS_CONSUMER_REGS, WS_PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# name -> (stages by output element size, extra constexprs) of the warp-specialised kernel (4 warps launched, + 4 + 1
# in the partitions; output blocks of 64 rows): "ws": the next group's chain issued ahead, a 5 x 32 KB ring and one
# 32 KB float32 tile of split sums a consumer, tiles M fastest; "ws grouped": the same in the committed kernels'
# grouped tile order (bands of 8 M tiles; session 22's "ws" lost at K = 14336, where the activations stream from HBM
# once per weight column); "ws regs": without the chain ahead, the split sums in registers, so only the output is
# staged and the ring takes 6 stages (5 for a float32 output); "ws smem sums": without the chain ahead, the split sums
# in shared memory (for four splits, where the register sums of "ws regs" spill; 5 stages beside the 64 KB of sums)
SCHEDULES = {"ws": ({2: 5, 4: 5}, {"LOOKAHEAD": True, "SUMS_IN_SMEM": True, "GROUP_M": 0}),
             "ws grouped": ({2: 5, 4: 5}, {"LOOKAHEAD": True, "SUMS_IN_SMEM": True, "GROUP_M": 8}),
             "ws regs": ({2: 6, 4: 5}, {"LOOKAHEAD": False, "SUMS_IN_SMEM": False, "GROUP_M": 0}),
             "ws smem sums": ({2: 5, 4: 5}, {"LOOKAHEAD": False, "SUMS_IN_SMEM": True, "GROUP_M": 0})}
WARPS = 4
OUT_ROWS = TILE[0] // 2


def descriptors(xq, wq, out, tile=TILE):
    """TMA descriptors of ``xq [M, K]`` (BM x 128), ``wq [N, K]`` (BN x 128) and ``out [M, N]`` (BM / 2 x BN)."""
    bm, bn = tile
    return descriptor(xq, [bm, GROUP]), descriptor(wq, [bn, GROUP]), descriptor(out, [OUT_ROWS, bn])


def launch_args(xq, xs, wq, ws, bias, out, split_groups: int, sws: bool, schedule: str = "ws"):
    """``(args, constexprs)`` of one launch of :func:`_fp8_ws_kernel` by ``schedule``."""
    stages, extra = SCHEDULES[schedule]
    m, k = xq.shape
    if k % GROUP:
        raise ValueError(f"K = {k}: the Gluon FP8 GEMM takes whole 128-column groups only")
    g_all = k // GROUP
    a_desc, b_desc, out_desc = descriptors(xq, wq, out)
    args = (a_desc, b_desc, out_desc, xs, ws, bias if bias is not None else out, m, wq.shape[0], xs.stride(0),
            ws.stride(0))
    const = {"G_ALL": g_all, "SPLIT_GROUPS": split_groups, "SPLITS": triton.cdiv(g_all, split_groups),
             "STAGES": stages[out.element_size()], "SWS": sws, "HAS_BIAS": bias is not None, "num_warps": WARPS,
             **extra}
    return args, const


def gluon_fp8_gemm(xq, xs, wq, ws, bias, out_dtype, split_groups: int, w_block_rows: int = 0, schedule: str = "ws"):
    """``fp8_linear.fp8_gemm``'s result (module docstring) on CUDA by one of :data:`SCHEDULES`; ``split_groups``: the
    (N, K) table's."""
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)
    sws = bool(w_block_rows) and w_block_rows % TILE[1] == 0
    args, const = launch_args(xq, xs, wq, ws, bias, out, split_groups, sws, schedule)
    tiles = triton.cdiv(xq.shape[0], TILE[0]) * triton.cdiv(wq.shape[0], TILE[1])
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count
    _fp8_ws_kernel[(min(sms, tiles),)](*args, **{k: v for k, v in const.items() if k != "num_warps"},
                                       num_warps=WARPS)
    return out

