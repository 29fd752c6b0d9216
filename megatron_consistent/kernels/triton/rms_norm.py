"""RMSNorm forward for CUDA (Triton): ``ROWS`` rows per program, each row's reduction in a fixed order.

GPU numerics contract: ``ms = tl.sum(float32(h)**2) / H`` with the reduction
tree fixed by ``(ROWS, BLOCK_H, num_warps)``, which depend on ``H`` only (short rows such as a per-head qk-norm:
several rows per program, one row otherwise) — so a row's
result does not depend on the number of rows or its place among them;
``rstd = 1 / sqrt(ms + eps)`` (IEEE sqrt and division);
``y = round((float32(h) * rstd) * float32(w))``.  Returns ``(y, rstd)``.

Fused with the residual add before it (``add_rms_norm``, inference): ``h = round(float32(x) + float32(residual))``
is computed, stored and normalised in one pass — the bits of ``add_residual`` followed by this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ._common import next_pow2


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(H_PTR, R_PTR, W_PTR, Y_PTR, HOUT_PTR, RSTD_PTR, n_rows, H, stride_h, stride_r, stride_y, stride_o,
                     eps, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr):
    """``ADD``: ``h = round(x + residual)`` first (stored to ``HOUT``), no ``rstd``; else ``h = x`` and ``rstd`` stored."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row = rows[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    mask = (row < n_rows) & (cols < H)
    h = tl.load(H_PTR + row * stride_h + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(R_PTR + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(HOUT_PTR.dtype.element_ty)
        tl.store(HOUT_PTR + row * stride_o + cols, h, mask=mask)
    h = h.to(tl.float32)
    ms = tl.sum(h * h, axis=1) / H
    rstd = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    w = tl.load(W_PTR + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = (h * rstd[:, None]) * w
    tl.store(Y_PTR + row * stride_y + cols, y.to(Y_PTR.dtype.element_ty), mask=mask)
    if not ADD:
        tl.store(RSTD_PTR + rows, rstd, mask=rows < n_rows)


def _launch(block_h: int) -> tuple[int, int]:
    """(rows per program, warps) for rows of ``block_h``: short rows (a per-head norm) share a program."""
    if block_h <= 512:
        return 2048 // block_h, 4
    return 1, 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@register("rms_norm", "cuda")
def _rms_norm_cuda(h: torch.Tensor, weight: torch.Tensor, eps: float):
    hidden = h.shape[-1]
    h2 = _rows(h, hidden)
    rows = h2.shape[0]
    y = torch.empty((rows, hidden), dtype=h.dtype, device=h.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows:
        block = next_pow2(hidden)
        per_program, warps = _launch(block)
        _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            h2, h2, weight, y, y, rstd, rows, hidden, h2.stride(0), 0, y.stride(0), 0, float(eps),
            BLOCK_H=block, ROWS=per_program, ADD=False, num_warps=warps)
    return y.reshape(h.shape), rstd.reshape(h.shape[:-1])


@register("add_rms_norm", "cuda")
def _add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    x2, r2 = _rows(x, hidden), _rows(residual, hidden)
    rows = x2.shape[0]
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    h = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows:
        block = next_pow2(hidden)
        per_program, warps = _launch(block)
        _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            x2, r2, weight, y, h, y, rows, hidden, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0), float(eps),
            BLOCK_H=block, ROWS=per_program, ADD=True, num_warps=warps)
    return y.reshape(x.shape), h.reshape(x.shape)
