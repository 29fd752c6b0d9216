"""SiLU-and-mul forward for CUDA (Triton): elementwise, so batch- and position-invariant.

GPU numerics contract: ``g, u = float32(x[..., :I]), float32(x[..., I:])``;
``y = round((g / (1 + exp(-g))) * u)`` with Triton's ``exp`` (ex2-based,
deterministic); each element depends on its own two inputs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register

_BLOCK = 1024


@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_kernel(X, Y, n_rows, I, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g))) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@register("silu_and_mul", "cuda")
def _silu_and_mul_cuda(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, _BLOCK))](x2, y, rows, inter, x2.stride(0), y.stride(0),
                                                                 BLOCK=_BLOCK, num_warps=4)
    return y.reshape(*x.shape[:-1], inter)
