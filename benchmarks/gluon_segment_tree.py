"""A candidate for the row-parallel K-segment tree at large M, written in Gluon (Triton 3.6's explicit-layout dialect).

Why (docs/benchmarks.md, "Row-parallel K-segment tree"): at M >= 1024 the committed tree kernel
(``kernels/triton/segment_tree.py``) runs at 0.53-0.87 of cuBLAS where the pre-tree GEMM runs at 0.9-1.0, and ten
sessions of schedules in ``triton.language`` did not close it: each segment restarts the software pipeline (its loads
drain and refill) and the partials of the tree cost registers.  Gluon exposes what ``tl`` hides: here ONE ring of TMA
loads runs through all segments and all tiles of a persistent program (a load is issued ``STAGES - 1`` steps ahead,
across segment and tile boundaries), the tensor-core chain of a segment runs asynchronously (one ``wgmma`` in flight
while the next step's load is issued), and the tree's partials sit in two float32 tiles of shared memory and, for the
last segment but one, in registers, so a segment boundary costs one wait and one combine, not a pipeline restart.

Numerics (the tree kernel's contract, so the bits must equal ``segment_tree.segment_tree_gemm``): segment ``s`` is the
``wgmma`` chain over its ``K_seg`` columns in K order, from nothing (``use_acc=False`` on its first step) -- the tensor
core's own k16 steps in K order, independent of BM / BN / BK; the segment partials are summed as
``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` in float32 (fewer segments: the same tree's left part); then
``+ bias`` in float32 and one rounding to the output dtype (float32 output: the subtree, for a tensor-parallel rank).

Status: a candidate, not used by the package.  Compiled for sm_90a without a GPU (``--offline``: registers, spills,
shared memory); its bits and speed are measured by ``bench_gpu_row_parallel.py --gluon`` on the H200 (bits against the
committed tree, ``torch.equal``; time against cuBLAS and the pre-tree GEMM in the same run).

    PYTHONPATH=$PWD python benchmarks/gluon_segment_tree.py --offline
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

WARPS = 8  # two warp groups of 64 rows


@gluon.jit
def _chain(acc, g, ks0, total, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m,
           SEG_STEPS: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr):
    """K steps ``ks0 .. SEG_STEPS - 1`` of a segment's chain on ``acc`` (step 0 from nothing), one ``wgmma`` in flight:
    each step waits for its loads, and once the step before it has finished, issues the loads ``STAGES - 1`` steps
    ahead into that step's slot.  Returns the chain (its last ``wgmma`` may still run) and the next global step."""
    for ks in range(ks0, SEG_STEPS):
        slot = g % STAGES
        mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=ks > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        issue_loads(g + STAGES - 1, total, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m, STEPS, STAGES)
        g += 1
    return acc, g


@gluon.jit
def _tree_kernel(a_desc, b_desc, out_desc, bias_ptr, M, N,
                 SEGMENTS: gl.constexpr, SEG_STEPS: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                 num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STEPS: gl.constexpr = SEGMENTS * SEG_STEPS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    # 32-byte vectors XOR-swizzled by row: the accumulator's fragments (a quad of lanes = 32 bytes of one row, eight
    # rows a warp) reach the tile without bank conflicts (asserted below; unswizzled: 3 excess accesses a wavefront)
    level_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    a_bufs, b_bufs, bars = operand_ring(a_desc, b_desc, STAGES)
    levels = gl.allocate_shared_memory(gl.float32, [2, BM, BN], level_layout)  # the tree's partials A and B

    pid, nprog, num_pid_m, num_tiles, total = start_program(a_desc, b_desc, bars, a_bufs, b_bufs, M, N, STEPS, STAGES,
                                                            STAGES - 1)

    acc = gl.zeros((BM, BN), gl.float32, acc_layout)
    gl.static_assert(gl.bank_conflicts(acc.type, levels.index(0).type) == 0)
    g = 0
    for tile in range(pid, num_tiles, nprog):
        off_m = (tile % num_pid_m) * BM
        off_n = (tile // num_pid_m) * BN
        held = acc  # segment 6's partial while segment 7 runs (a name until then: nothing is kept)
        for seg in gl.static_range(SEGMENTS):
            acc, g = _chain(acc, g, 0, total, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m, SEG_STEPS,
                            STEPS, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # the tree of neighbours with two float32 tiles of shared memory (A, B) and one of registers:
            # s0 -> A; A + s1 -> B; s2 -> A; B + (A + s3) -> B; s4 -> A; A + s5 -> A; s6 -> registers;
            # B + (A + (s6 + s7)) -- ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), at most two tiles in
            # registers at a time (fewer segments: the tree's left part, ending at segment SEGMENTS - 1)
            if seg == SEGMENTS - 1:
                if seg == 0:
                    total_tile = acc
                elif seg == 1:
                    total_tile = levels.index(0).load(acc_layout) + acc
                elif seg == 3:
                    total_tile = levels.index(1).load(acc_layout) + (levels.index(0).load(acc_layout) + acc)
                else:
                    total_tile = levels.index(1).load(acc_layout) + (levels.index(0).load(acc_layout) + (held + acc))
            elif seg == 0:
                tma.store_wait(pendings=0)  # the previous tile's output has left A's memory
                levels.index(0).store(acc)
            elif seg == 1:
                levels.index(1).store(levels.index(0).load(acc_layout) + acc)
            elif seg == 3:
                levels.index(1).store(levels.index(1).load(acc_layout) + (levels.index(0).load(acc_layout) + acc))
            elif seg == 5:
                levels.index(0).store(levels.index(0).load(acc_layout) + acc)
            elif seg == 6:
                held = acc
            else:  # segments 2 and 4
                levels.index(0).store(acc)
        # the output through A's memory (free until the next tile's first segment) and a TMA store
        if SEGMENTS == 1:
            tma.store_wait(pendings=0)  # (more segments: waited for before segment 0 wrote A)
        store_tile(total_tile, out_desc, levels.index(0)._reinterpret(out_desc.dtype, out_desc.block_type.shape,
                                                                      out_desc.layout), bias_ptr, off_m, off_n, N, HAS_BIAS)
    release_ring(bars, STAGES)


@gluon.jit
def _register_tree_kernel(a_desc, b_desc, out_desc, bias_ptr, M, N,
                          SEGMENTS: gl.constexpr, SEG_STEPS: gl.constexpr, STAGES: gl.constexpr,
                          HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    """The tree with its partials in registers (128 x 64 tiles: 32 registers a float32 tile; the first quad's value
    in shared memory while segments 4-7 run), and each segment boundary hidden: the next segment's first ``wgmma`` is
    issued (into a fresh accumulator) before the previous segment's chain is waited for and added to the tree; a deep
    operand ring (7 x 24 KB)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STEPS: gl.constexpr = SEGMENTS * SEG_STEPS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    a_bufs, b_bufs, bars = operand_ring(a_desc, b_desc, STAGES)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    # the first quad's value waits out segments 4-7 in shared memory (in registers it made the 8-segment tree spill)
    top_smem = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))

    pid, nprog, num_pid_m, num_tiles, total = start_program(a_desc, b_desc, bars, a_bufs, b_bufs, M, N, STEPS, STAGES,
                                                            STAGES - 1)
    acc = gl.zeros((BM, BN), gl.float32, acc_layout)
    gl.static_assert(gl.bank_conflicts(acc.type, top_smem.type) == 0)
    g = 0
    for tile in range(pid, num_tiles, nprog):
        off_m = (tile % num_pid_m) * BM
        off_n = (tile // num_pid_m) * BN
        for seg in gl.static_range(SEGMENTS):
            slot = g % STAGES
            mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
            fresh = gl.zeros((BM, BN), gl.float32, acc_layout)  # registers of its own: the previous chain is still live
            new = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), fresh, use_acc=False,
                                is_async=True)
            if seg == 0:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(new,))
            else:  # the previous segment's chain is done (the new one runs on): onto the tree while the tensor cores work
                prev, acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, new))
                if (seg - 1) % 2 == 0:  # level 0: one segment
                    low = prev
                elif (seg - 1) % 4 == 1:  # level 1: a pair
                    mid = low + prev
                else:  # level 2: the first quad (segment 3)
                    top_smem.store(mid + (low + prev))
            issue_loads(g + STAGES - 1, total, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m, STEPS,
                        STAGES)
            g += 1
            acc, g = _chain(acc, g, 1, total, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m, SEG_STEPS,
                            STEPS, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if SEGMENTS == 1:
            total_tile = acc
        elif SEGMENTS == 2:
            total_tile = low + acc
        elif SEGMENTS == 4:
            total_tile = mid + (low + acc)
        else:
            total_tile = top_smem.load(acc_layout) + (mid + (low + acc))
        tma.store_wait(pendings=0)  # the previous tile's output has left the staging tile
        store_tile(total_tile, out_desc, out_smem, bias_ptr, off_m, off_n, N, HAS_BIAS)
    release_ring(bars, STAGES)


# name -> (kernel, (BM, BN, BK), stages).  "smem": the partials in shared memory, 128 x 128 tiles (a float32 tile is 64
# registers a thread), a 3 x 32 KB operand ring next to the two 64 KB partial tiles; "regs": in registers (but the first
# quad), 128 x 64 tiles, a 7 x 24 KB ring, the segment boundaries hidden behind the next segment's first wgmma
SCHEDULES = {"smem": (_tree_kernel, (128, 128, 64), 3), "regs": (_register_tree_kernel, (128, 64, 64), 7)}


def descriptors(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile):
    """TMA descriptors of ``x [M, K]`` (blocks BM x BK), ``w [N, K]`` (BN x BK) and ``out [M, N]`` (BM x BN)."""
    bm, bn, bk = tile
    return descriptor(x, [bm, bk]), descriptor(w, [bn, bk]), descriptor(out, [bm, bn])


def gluon_segment_tree(x: torch.Tensor, w: torch.Tensor, segments: int, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, schedule: str = "smem") -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` as the K-segment tree (module docstring), on CUDA, by one of :data:`SCHEDULES`: one
    persistent program an SM."""
    kernel, (bm, bn, bk), stages = SCHEDULES[schedule]
    m, k = x.shape
    n = w.shape[0]
    if k % segments or (k // segments) % bk:
        raise ValueError(f"K = {k} in {segments} segments of whole {bk}-column steps: not possible")
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    a_desc, b_desc, out_desc = descriptors(x, w, out, (bm, bn, bk))
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    kernel[(min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)](
        a_desc, b_desc, out_desc, bias if bias is not None else out, m, n,
        SEGMENTS=segments, SEG_STEPS=k // segments // bk, STAGES=stages, HAS_BIAS=bias is not None, num_warps=WARPS)
    return out


def offline_jobs():
    """``(description, kernel, signature, constexprs)`` of the launches the row-parallel benchmark's shapes make
    (o_proj and down of the 1B and 8B Llama) by each schedule: bf16 out at TP = 1 (8 segments), the float32 subtrees
    of TP = 2, 4, 8 (4, 2, 1 segments)."""
    from triton.runtime.jit import mangle_type

    jobs = []
    for schedule, (kernel, tile, stages) in SCHEDULES.items():
        for n, k in ((4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192)):
            for segments, out_dtype in ((8, torch.bfloat16), (4, torch.float32), (2, torch.float32), (1, torch.float32)):
                k_local = k * segments // 8
                x = torch.zeros(4096, k_local, dtype=torch.bfloat16)
                w = torch.zeros(n, k_local, dtype=torch.bfloat16)
                out = torch.zeros(4096, n, dtype=out_dtype)
                a_desc, b_desc, out_desc = descriptors(x, w, out, tile)
                sig = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "out_desc": mangle_type(out_desc),
                       "bias_ptr": mangle_type(out), "M": "i32", "N": "i32"}
                const = {"SEGMENTS": segments, "SEG_STEPS": k_local // segments // tile[2], "STAGES": stages,
                         "HAS_BIAS": segments == 8 and n == 2048, "num_warps": WARPS}  # a bias: the 1B shapes
                sig.update({name: "constexpr" for name in const})
                jobs.append((f"{schedule} N={n} K={k} segments={segments} out={str(out_dtype).split('.')[-1]}"
                             + (" bias" if const["HAS_BIAS"] else ""), kernel, sig, const))
    return jobs


def main() -> int:
    from offline_compile import gluon_candidate_main

    return gluon_candidate_main(__doc__, offline_jobs, WARPS, "python benchmarks/bench_gpu_row_parallel.py --gluon")


if __name__ == "__main__":
    sys.exit(main())
