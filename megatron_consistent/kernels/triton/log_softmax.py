"""float32 log-softmax over the vocabulary for CUDA (Triton): the 8-segment tree of ``kernels/logprobs.py``.

Registers, for ``cuda``, the two ops that :func:`kernels.logprobs.log_softmax` (TP = 1) and
``layers/tensor_parallel.vocab_parallel_logprobs`` (TP = t) compose: ``sum_exp_subtree`` and
``log_softmax_normalise``.  The global max ``m`` comes from the caller (``amax``, all-reduce MAX at TP > 1:
exact in any order).

GPU numerics contract (one row; ``z`` and ``m`` float32):

* ``e = exp2((z - m) * log2(e))`` (``tl.math.exp2``: ``ex2.approx.ftz.f32`` on sm_90; the subtraction comes
  before the scale and the product feeds ``ex2``, so no FMA can form);
* ``sum_exp_subtree(z, m, S)``: the row's n entries are cut into ``S`` equal contiguous segments of
  ``c = ceil(n / S)`` entries (entries beyond n, and a segment wholly beyond n, contribute ``+0``: the ``-inf``
  padding of the CPU contract).  One program per (row, segment) reduces its segment in a fixed order that depends
  on ``c`` alone: ``BLOCK = min(4096, next_pow2(c))`` lanes; lane i sums entries ``i, i + BLOCK, i + 2 BLOCK, ...``
  of the segment in increasing order from ``+0``; the BLOCK lane sums are added by the explicit pairwise tree of
  :func:`numerics.tree_sum` (lane i with lane ``i + n/2``, level by level -- a reshape to ``[2, n/2]`` and a sum of
  two, so neither the thread layout nor ``num_warps`` enters the bits).  The S segment values are combined by
  ``numerics.adjacent_tree_sum`` (``((s0 + s1) + (s2 + s3)) + ...``, IEEE float32 adds);
* ``log_softmax_normalise(z, m, s) = (z - m) - log(s)`` elementwise: two IEEE subtractions; ``log`` is ``tl.log``
  (libdevice ``__nv_logf``, whose last operation is an explicitly rounded ``fma.rn``, so nothing contracts with it).

With the vocabulary cut into ``VOCAB_SEGMENTS`` = 8 segments, a tensor-parallel shard of ``V / t`` entries holds
the aligned segments ``r 8/t ... (r+1) 8/t - 1`` with the same ``c = V / 8``, so its ``sum_exp_subtree(.., 8/t)``
is that subtree of the TP = 1 tree, bit for bit, and the adjacent tree over the t all-gathered float32 values is
the TP = 1 ``s``.  Nothing depends on the batch, the row's position or the TP degree.  The bits are the GPU's
(``ex2.approx``, ``tl.log``), not the CPU contract's float64 polynomials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ..numerics import adjacent_tree_sum
from ._common import next_pow2

MAX_BLOCK = 4096  # lanes of a segment program; a segment of c entries uses min(MAX_BLOCK, next_pow2(c))
NORMALISE_BLOCK = 4096  # entries per program of the elementwise normalisation (no reduction: bits do not depend on it)


@triton.jit
def _lane_tree(x, LEVELS: tl.constexpr):
    """Sum of the ``2**LEVELS`` lanes of ``x`` by the pairwise tree: lane i with lane i + n/2, level by level."""
    for _ in tl.static_range(LEVELS - 1):
        x = tl.sum(tl.reshape(x, (2, x.shape[0] // 2)), axis=0)  # one IEEE add per pair: order-free
    return tl.sum(x, axis=0)  # the last pair (or the one lane)


@triton.jit(do_not_specialize=["n_rows"])
def _segment_sums_kernel(Z, M, OUT, n_rows, n_cols, seg_len, stride_z, BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    """``OUT[seg, row]`` = sum of ``exp(z - m)`` over segment ``seg`` of row ``row`` (grid: rows x segments)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    m = tl.load(M + row)
    zr = Z + row * stride_z
    start = seg * seg_len
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, seg_len, BLOCK):
        i = off + lanes
        col = start + i
        ok = (i < seg_len) & (col < n_cols)
        z = tl.load(zr + col, mask=ok, other=float("-inf"))
        acc += tl.where(ok, tl.math.exp2((z - m) * 1.4426950408889634), 0.0)
    tl.store(OUT + seg.to(tl.int64) * n_rows + row, _lane_tree(acc, LEVELS))


@triton.jit(do_not_specialize=["n_rows"])
def _normalise_kernel(Z, M, S, OUT, n_rows, n_cols, stride_z, stride_o, BLOCK: tl.constexpr):
    """``OUT[row] = (z - m) - log(s)`` over one block of a row (grid: rows x column blocks)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < n_cols
    z = tl.load(Z + row * stride_z + col, mask=ok, other=0.0)
    lg = tl.log(tl.load(S + row))
    tl.store(OUT + row * stride_o + col, (z - tl.load(M + row)) - lg, mask=ok)


def _rows(z: torch.Tensor, m: torch.Tensor):
    """``z`` as float32 ``[rows, n]`` with unit column stride, ``m`` as contiguous float32 ``[rows]``."""
    z2 = z.reshape(-1, z.shape[-1]).to(torch.float32)
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    return z2, m.reshape(-1).to(torch.float32).contiguous()


def segment_block(seg_len: int) -> int:
    """Lanes of the program that reduces a segment of ``seg_len`` entries (a function of the length alone)."""
    return min(MAX_BLOCK, next_pow2(seg_len))


@register("sum_exp_subtree", "cuda")
def sum_exp_subtree(z: torch.Tensor, m: torch.Tensor, segments: int) -> torch.Tensor:
    """float32 ``[...]``: the adjacent tree over the ``segments`` segment sums of ``exp(z - m)`` (``m``: ``[..., 1]``)."""
    z2, m2 = _rows(z, m)
    rows, n = z2.shape
    seg_len = -(-n // segments)
    launch = rows > 0 and seg_len > 0
    sums = (torch.empty if launch else torch.zeros)((segments, rows), dtype=torch.float32, device=z.device)
    if launch:
        block = segment_block(seg_len)
        _segment_sums_kernel[(rows, segments)](z2, m2, sums, rows, n, seg_len, z2.stride(0), BLOCK=block,
                                               LEVELS=block.bit_length() - 1, num_warps=8 if block >= 2048 else 4)
    return adjacent_tree_sum(sums, dim=0).reshape(z.shape[:-1])


@register("log_softmax_normalise", "cuda")
def log_softmax_normalise(z: torch.Tensor, m: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """float32 ``(z - m) - log(total)`` (``m``: ``[..., 1]``, ``total``: ``[...]``)."""
    z2, m2 = _rows(z, m)
    rows, n = z2.shape
    s2 = total.reshape(-1).to(torch.float32).contiguous()
    out = torch.empty((rows, n), dtype=torch.float32, device=z.device)
    if rows and n:
        block = min(NORMALISE_BLOCK, next_pow2(n))
        _normalise_kernel[(rows, triton.cdiv(n, block))](z2, m2, s2, out, rows, n, z2.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out.reshape(z.shape)
