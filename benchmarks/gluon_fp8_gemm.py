"""A candidate for the block-FP8 GEMM on Hopper, written in Gluon: the per-group scaling overlaps the tensor cores.

Why (docs/fp8.md, docs/benchmarks.md): the committed kernel (``kernels/triton/fp8_linear.py``) is 0.69-0.75 of cuBLAS
block-FP8 ``_scaled_mm`` at M = 4096 (issue #15 asks 0.75), and the reason is structural in ``triton.language`` 3.6:
each group's ``tl.dot`` starts from 0 (the contract), so its ``wgmma`` is waited for right after it is issued and the
``fma`` with the group's scales never overlaps a tensor-core chain.  Here group ``c + 1``'s ``wgmma`` chain is issued
(asynchronously) BEFORE group ``c``'s result is waited for and scaled, so the scaling runs while the tensor cores work
on the next group; one ring of TMA loads runs through all groups, splits and tiles of a persistent program.

Numerics: the contract of ``fp8_linear`` (steps 2-5 of its docstring), so the bits must equal
``fp8_linear.fp8_gemm``: ``p_g`` = the FP8 ``wgmma`` chain over group g's 128 products from nothing
(``use_acc=False``; Hopper's default imprecise FP8 accumulation, as ``tl.dot``), ``acc = fma(p_g, xs * ws, acc)``
with the two scales multiplied first, groups in K order, ``acc`` from 0; the splits of ``SPLIT_GROUPS`` groups (the
(N, K) table's) summed in split order from 0 (one split: taken as is); + bias in float32, one rounding.  ``SWS``: one
weight scale per (tile, group), as the committed kernel's ``SWS`` (the same float32 values).

Status: a candidate, not used by the package.  ``--offline`` compiles it for sm_90a without a GPU (registers, spills,
shared memory); bits and speed: ``python benchmarks/sweep_gpu_gemm.py --only-fp8 --gluon`` on the H200 (bits against
the committed kernel with ``torch.equal``, time against ``_scaled_mm`` in the same run).

    PYTHONPATH=$PWD python benchmarks/gluon_fp8_gemm.py --offline
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gluon_ring import descriptor, issue_loads, operand_ring, release_ring, start_program, store_tile  # noqa: E402

GROUP = 128  # the activation group = the weight block's columns = one K step
TILE = (128, 128)  # BM, BN: 8 warps, two warp groups of 64 rows
STAGES = 4  # 4 x 32 KB of operands, next to the 64 KB float32 tile of the split sums
WARPS = 8


@gluon.jit
def _issue_mma(c, total_steps, bars, a_bufs, b_bufs, p_layout: gl.constexpr, STAGES: gl.constexpr):
    """Group chain of global step ``c``, from nothing, asynchronously (its loads waited for first)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    slot = c % STAGES
    mbarrier.wait(bars.index(slot), (c // STAGES) & 1, pred=c < total_steps)
    p = gl.zeros((BM, BN), gl.float32, p_layout)
    return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), p, use_acc=False, is_async=True)


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
def _fp8_kernel(a_desc, b_desc, out_desc, as_ptr, bs_ptr, bias_ptr, M, N, stride_asm, stride_bsn,
                G_ALL: gl.constexpr, SPLIT_GROUPS: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr,
                SWS: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 32])
    a_bufs, b_bufs, bars = operand_ring(a_desc, b_desc, STAGES)
    # 32-byte vectors XOR-swizzled by row: no bank conflicts for the accumulator's fragments (asserted below)
    sums = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))

    pid, nprog, num_pid_m, num_tiles, total_steps = start_program(a_desc, b_desc, bars, a_bufs, b_bufs, M, N, G_ALL,
                                                                  STAGES, STAGES)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    gl.static_assert(gl.bank_conflicts(gl.zeros((BM, BN), gl.float32, acc_layout).type, sums.type) == 0)
    pending = _issue_mma(0, total_steps, bars, a_bufs, b_bufs, acc_layout, STAGES)  # step 0's chain, in flight
    c = 0
    for tile in range(pid, num_tiles, nprog):
        off_m = (tile % num_pid_m) * BM
        off_n = (tile // num_pid_m) * BN
        for s in gl.static_range(SPLITS):
            acc = gl.zeros((BM, BN), gl.float32, acc_layout)
            for g in range(s * SPLIT_GROUPS, min(G_ALL, (s + 1) * SPLIT_GROUPS)):
                sa, sb = _scale_vectors(as_ptr, bs_ptr, off_m, off_n, g, M, N, stride_asm, stride_bsn, rows, cols,
                                        SWS)
                nxt = _issue_mma(c + 1, total_steps, bars, a_bufs, b_bufs, acc_layout, STAGES)  # the next group's
                p = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))  # this group's chain is done ...
                issue_loads(c + STAGES, total_steps, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m,
                            G_ALL, STAGES)  # ... so its slot takes the load STAGES steps ahead
                acc = _scaled_fma(p, sa, sb, acc, SWS)  # while the tensor cores run the next group
                pending = nxt
                c += 1
            if SPLITS == 1:
                final = acc
            elif s == 0:
                tma.store_wait(pendings=0)  # the previous tile's output has left this memory
                sums.store(acc + 0.0)  # the split partials summed from 0
            elif s == SPLITS - 1:
                final = sums.load(acc_layout) + acc
            else:
                sums.store(sums.load(acc_layout) + acc)
        if SPLITS == 1:
            tma.store_wait(pendings=0)  # (more splits: waited for before split 0 wrote the sums)
        store_tile(final, out_desc, sums._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout),
                   bias_ptr, off_m, off_n, N, HAS_BIAS)
    # the chain issued past the last step (on a slot no load refilled; its result is never read) must end first
    warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
    release_ring(bars, STAGES)


def descriptors(xq, wq, out, tile=TILE):
    """TMA descriptors of ``xq [M, K]`` (BM x 128), ``wq [N, K]`` (BN x 128) and ``out [M, N]`` (BM x BN)."""
    bm, bn = tile
    return descriptor(xq, [bm, GROUP]), descriptor(wq, [bn, GROUP]), descriptor(out, [bm, bn])


def launch_args(xq, xs, wq, ws, bias, out, split_groups: int, sws: bool, tile=TILE, stages=STAGES, warps=WARPS):
    """``(args, constexprs)`` of one launch of the kernel."""
    m, k = xq.shape
    if k % GROUP:
        raise ValueError(f"K = {k}: the candidate takes whole 128-column groups only")
    g_all = k // GROUP
    a_desc, b_desc, out_desc = descriptors(xq, wq, out, tile)
    args = (a_desc, b_desc, out_desc, xs, ws, bias if bias is not None else out, m, wq.shape[0], xs.stride(0),
            ws.stride(0))
    const = {"G_ALL": g_all, "SPLIT_GROUPS": split_groups, "SPLITS": triton.cdiv(g_all, split_groups),
             "STAGES": stages, "SWS": sws, "HAS_BIAS": bias is not None, "num_warps": warps}
    return args, const


def gluon_fp8_gemm(xq, xs, wq, ws, bias, out_dtype, split_groups: int, w_block_rows: int = 0):
    """``fp8_linear.fp8_gemm``'s result (module docstring) on CUDA; ``split_groups``: the (N, K) table's."""
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)
    sws = bool(w_block_rows) and w_block_rows % TILE[1] == 0
    args, const = launch_args(xq, xs, wq, ws, bias, out, split_groups, sws)
    tiles = triton.cdiv(xq.shape[0], TILE[0]) * triton.cdiv(wq.shape[0], TILE[1])
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count
    _fp8_kernel[(min(sms, tiles),)](*args, **{k: v for k, v in const.items() if k != "num_warps"},
                                    num_warps=const["num_warps"])
    return out


def offline_jobs():
    """``(description, kernel, signature, constexprs)`` for the Llama-8B FP8 shapes at M = 4096, bf16 out, the (N, K)
    table's splits, with one weight scale per tile and without."""
    from triton.runtime.jit import mangle_type

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megatron_consistent.kernels.triton.fp8_linear import fp8_config

    jobs = []
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):
        g = k // GROUP
        xq = torch.zeros(4096, k, dtype=torch.float32).to(torch.float8_e4m3fn)
        wq = torch.zeros(n, k, dtype=torch.float32).to(torch.float8_e4m3fn)
        out = torch.zeros(4096, n, dtype=torch.bfloat16)
        for sws in (True, False):
            args, const = launch_args(xq, torch.ones(4096, g), wq, torch.ones(n, g), None, out,
                                      fp8_config(n, k)["SPLIT_GROUPS"], sws)
            names = _fp8_kernel.arg_names
            sig = {name: mangle_type(a, True) if not isinstance(a, int) else "i32" for name, a in zip(names, args)}
            sig.update({name: "constexpr" for name in const})
            jobs.append((f"N={n} K={k} splits={const['SPLITS']} sws={sws}", _fp8_kernel, sig, const))
    return jobs


def main() -> int:
    from offline_compile import gluon_candidate_main

    return gluon_candidate_main(__doc__, offline_jobs, WARPS, "python benchmarks/sweep_gpu_gemm.py --only-fp8 --gluon")


if __name__ == "__main__":
    sys.exit(main())
