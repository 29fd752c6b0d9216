"""Rotary embedding forward for CUDA (Triton), NeoX and GPT-J styles.

GPU numerics contract: in float32, ``o1 = x1*cos - x2*sin``,
``o2 = x2*cos + x1*sin`` (the compiler may fuse one product into an FMA; the
same binary serves every shape with the same head_dim/rotary_dim/style, so a
token's result does not depend on the batch), one rounding to x's dtype;
dims past ``rotary_dim`` pass through.  ``cos``/``sin`` are the float32 tables
of :mod:`..rotary` (built once on CPU, bit-identical on every device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ._common import next_pow2


@triton.jit(do_not_specialize=["n_prefix", "H"])
def _rope_kernel(X, COS, SIN, Y, n_prefix, H, stride_xp, stride_xh, stride_yp, stride_yh, stride_cp,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, NEOX: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    c = tl.load(COS + p * stride_cp + i, mask=im, other=0.0)
    s = tl.load(SIN + p * stride_cp + i, mask=im, other=0.0)
    if NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    mask = (heads[:, None] < H) & im[None, :]
    xb = X + p * stride_xp + heads[:, None] * stride_xh
    x1 = tl.load(xb + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    yb = Y + p * stride_yp + heads[:, None] * stride_yh
    tl.store(yb + i1[None, :], o1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yb + i2[None, :], o2.to(Y.dtype.element_ty), mask=mask)


@register("rope", "cuda")
def _rope_cuda(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    half = cos.shape[-1]
    rot = 2 * half
    *lead, heads, dim = x.shape
    x3 = x.reshape(-1, heads, dim)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    n_prefix = x3.shape[0]
    cos2 = cos.to(torch.float32).expand(*lead, 1, half).reshape(n_prefix, half).contiguous()
    sin2 = sin.to(torch.float32).expand(*lead, 1, half).reshape(n_prefix, half).contiguous()
    y = torch.empty((n_prefix, heads, dim), dtype=x.dtype, device=x.device)
    if rot < dim:
        y[..., rot:] = x3[..., rot:]
    if n_prefix and heads and half:
        block_heads = min(next_pow2(heads), max(1, 2048 // next_pow2(half)))
        grid = (n_prefix, triton.cdiv(heads, block_heads))
        _rope_kernel[grid](x3, cos2, sin2, y, n_prefix, heads, x3.stride(0), x3.stride(1), y.stride(0), y.stride(1),
                           cos2.stride(0), HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_HEADS=block_heads,
                           NEOX=style == "neox", num_warps=4)
    return y.reshape(x.shape)
