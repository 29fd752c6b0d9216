"""What the Gluon kernels (``gluon_segment_tree.py``, ``gluon_fp8_gemm.py``) share: TMA descriptors, a
warp-specialised persistent program's ring of operand loads, and the output tile's store.

A persistent program takes the output tiles ``pid, pid + nprog, ...`` (placed M fastest or in grouped bands,
:func:`tile_origin`) and walks ``STEPS`` K steps of each; its global step ``c`` is tile ``c // STEPS``, K step
``c % STEPS``, and its operands go to ring slot ``c % STAGES``.  A producer partition (one warp) runs the ring: it
refills slot ``c % STAGES`` with step ``c``'s operands once every consumer partition has released the step that slot
held before (``empty``: one arrival a consumer), and the loads complete the slot's ``ready`` barrier.  The consumers
(warp groups) wait for ``ready``, run their tensor-core chains, and release.  Nothing else synchronises them: a
consumer's segment / group boundary (a drained chain, a combine) runs while another's ``wgmma`` chain keeps the
tensor cores busy.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv}


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of the 2-D tensor ``t`` in blocks of ``block``, in the default swizzled shared layout."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype]))


@gluon.jit
def tile_origin(tile, num_pid_m, num_pid_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """``(first row, first column)`` of output tile ``tile``: M fastest (``GROUP_M`` 0: consecutive tiles share a
    weight tile), or in bands of ``GROUP_M`` M tiles walked column by column (the committed kernels' grouped order:
    an activation tile is reused across a band's columns while it is in L2)."""
    if GROUP_M == 0:
        return (tile % num_pid_m) * BM, (tile // num_pid_m) * BN
    band = GROUP_M * num_pid_n
    first_m = (tile // band) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return (first_m + (tile % band) % rows) * BM, ((tile % band) // rows) * BN


@gluon.jit
def issue_loads(c, a_desc, b_desc, bars, a_bufs, b_bufs, pid, nprog, num_pid_m, num_pid_n, STEPS: gl.constexpr,
                STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA loads of the program's global step ``c`` (x rows of its tile, w rows of its tile, the step's K columns)
    into ring slot ``c % STAGES``, completing that slot's mbarrier in ``bars``."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    off_m, off_n = tile_origin(pid + (c // STEPS) * nprog, num_pid_m, num_pid_n, BM, BN, GROUP_M)
    k = (c % STEPS) * BK
    slot = c % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
    tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(slot))


@gluon.jit
def operand_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """``STAGES`` slots of x and w tiles in shared memory and their ``ready`` mbarriers (initialised)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return a_bufs, b_bufs, bars


@gluon.jit
def store_tile(value, out_desc, out_smem, bias_ptr, off_m, off_n, N, HAS_BIAS: gl.constexpr):
    """The float32 tile ``value`` (+ bias, float32), rounded once to the output dtype, through ``out_smem`` and a TMA
    store to ``[off_m, off_n]`` (rows and columns past the output are clipped by the TMA unit)."""
    if HAS_BIAS:
        cols = off_n + gl.arange(0, value.shape[1], layout=gl.SliceLayout(0, value.type.layout))
        value = value + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    out_smem.store(value.to(out_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)


@gluon.jit
def program_work(BM: gl.constexpr, BN: gl.constexpr, M, N, STEPS: gl.constexpr):
    """The persistent program's work: ``(pid, nprog, num_pid_m, num_pid_n, total steps)``; its tiles are
    ``range(pid, num_pid_m * num_pid_n, nprog)`` (placed by :func:`tile_origin`)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    return pid, nprog, num_pid_m, num_pid_n, gl.cdiv(num_pid_m * num_pid_n - pid, nprog) * STEPS


@gluon.jit
def release_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``STAGES`` mbarriers a slot is released on, each completing once all ``CONSUMERS`` partitions arrived."""
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return empty


@gluon.jit
def ring_producer(a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, STEPS: gl.constexpr, STAGES: gl.constexpr,
                  GROUP_M: gl.constexpr):
    """The producer partition: every step of the program (:func:`program_work`), in order, into the ring."""
    pid, nprog, num_pid_m, num_pid_n, total = program_work(a_desc.block_type.shape[0], b_desc.block_type.shape[0],
                                                           M, N, STEPS)
    for c in range(total):
        # a fresh barrier is in phase 0, so the first pass over the ring waits for nothing (parity 1)
        mbarrier.wait(empty.index(c % STAGES), ((c // STAGES) & 1) ^ 1)
        issue_loads(c, a_desc, b_desc, ready, a_bufs, b_bufs, pid, nprog, num_pid_m, num_pid_n, STEPS, STAGES, GROUP_M)


@gluon.jit
def release_slot(c, empty, STAGES: gl.constexpr):
    """A consumer is done with step ``c``'s operands (its chain reading them has completed)."""
    mbarrier.arrive(empty.index(c % STAGES), count=1)
