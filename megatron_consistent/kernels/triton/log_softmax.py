"""float32 log-softmax over the vocabulary for CUDA (Triton).

GPU numerics contract: one program per row; the vocabulary is visited in fixed
blocks of ``BLOCK_V`` (4096, or the next power of two of V if smaller) in
increasing order.  Each lane keeps an online ``(max, sum)`` pair:
``s = s * exp2((m - m') * log2e) + exp2((z - m') * log2e)``; lanes are then
combined by ``M = max(m)``, ``S = tl.sum(s * exp2((m - M) * log2e))`` with a
tree fixed by ``BLOCK_V`` and ``num_warps`` — both functions of V alone, so
a row's result never depends on the other rows.  ``out = (z - M) - log(S)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ._common import next_pow2

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["n_rows"])
def _log_softmax_kernel(Z, OUT, n_rows, V, stride_z, stride_o, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    zr = Z + row * stride_z
    m = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z = tl.load(zr + c, mask=c < V, other=float("-inf"))
        m_new = tl.maximum(m, z)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.math.exp2((m - m_ref) * 1.4426950408889634) + tl.math.exp2((z - m_ref) * 1.4426950408889634)
        m = m_new
    big = tl.max(m, axis=0)
    big_ref = tl.where(big == float("-inf"), 0.0, big)
    total = tl.sum(s * tl.math.exp2((tl.where(m == float("-inf"), big_ref, m) - big_ref) * 1.4426950408889634)
                   * (m != float("-inf")).to(tl.float32), axis=0)
    lg = tl.log(total)
    orow = OUT + row * stride_o
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z = tl.load(zr + c, mask=c < V, other=0.0)
        tl.store(orow + c, (z - big) - lg, mask=c < V)


@register("log_softmax", "cuda")
def _log_softmax_cuda(z: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[-1]
    z2 = z.reshape(-1, vocab).to(torch.float32)
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    rows = z2.shape[0]
    out = torch.empty((rows, vocab), dtype=torch.float32, device=z.device)
    if rows and vocab:
        block = min(4096, next_pow2(vocab))
        _log_softmax_kernel[(rows,)](z2, out, rows, vocab, z2.stride(0), out.stride(0), BLOCK_V=block,
                                     num_warps=8 if block >= 2048 else 4)
    return out.reshape(z.shape)
