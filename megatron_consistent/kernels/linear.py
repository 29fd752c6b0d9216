"""Batch-invariant linear layer ``y = x @ w.T + b``.

Numerics contract (CPU):

* inputs are cast to float32 (exact for bf16/fp16) and multiplied elementwise;
* the reduction axis K is zero-padded to a multiple of ``K_BLOCK`` (64); each
  block of 64 products is summed by the fixed pairwise tree of
  :func:`numerics.tree_sum`; block sums are accumulated left to right in
  float32 starting from 0;
* the bias (float32) is added last, then the result is rounded once to
  ``out_dtype`` (default: the input's dtype; float32 keeps the accumulator).

A row's result therefore depends on that row and the weights only — never on
how many rows share the call, their order, or the thread count.

Backward: deterministic matmuls for a given shape — float32 on CPU; on CUDA
with bf16/fp16 inputs, tensor-core matmuls in the input dtype (float32
accumulation, one rounding), as Megatron's own backward does.  The backward is
not part of the rollout path and need not be batch-invariant.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import ceil_to, tree_sum

K_BLOCK = 64
_CHUNK_ELEMENTS = 1 << 20  # rows per call are processed in chunks of about this many products


@register("linear", "cpu")
def _linear_cpu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x2d.shape
    n = weight.shape[0]
    kp = ceil_to(k, K_BLOCK)
    nblocks = kp // K_BLOCK
    wf = weight.to(torch.float32)
    xf = x2d.to(torch.float32)
    if kp != k:
        wf = nn.functional.pad(wf, (0, kp - k))
        xf = nn.functional.pad(xf, (0, kp - k))
    wb = wf.reshape(n, nblocks, K_BLOCK).transpose(0, 1).contiguous()  # [blocks, N, KB]
    xb = xf.reshape(m, nblocks, K_BLOCK)
    rows = max(1, _CHUNK_ELEMENTS // max(1, n * K_BLOCK))
    out = torch.empty(m, n, dtype=out_dtype)
    bf = None if bias is None else bias.to(torch.float32)
    for r0 in range(0, m, rows):
        acc = torch.zeros(min(rows, m - r0), n, dtype=torch.float32)
        for j in range(nblocks):
            acc = acc + tree_sum(xb[r0 : r0 + rows, None, j, :] * wb[j][None, :, :])
        if bf is not None:
            acc = acc + bf
        out[r0 : r0 + rows] = acc.to(out_dtype)
    return out


class LinearFunction(torch.autograd.Function):
    """Autograd wrapper: consistent forward, float32-matmul backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        x2d = x.reshape(-1, x.shape[-1])
        y = implementation("linear", x.device)(x2d, weight, bias, out_dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        compute = x.dtype if low else torch.float32
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.to(torch.float32).sum(0).to(ctx.bias_dtype)
        g, x2d = g.to(compute), x.reshape(-1, x.shape[-1]).to(compute)
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(compute)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x2d).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` under the batch-invariant contract; result in ``out_dtype`` (default x.dtype)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {weight.shape[-1]}")
    return LinearFunction.apply(x, weight, bias, out_dtype or x.dtype)


class Linear(nn.Module):
    """Thin module around :func:`linear` (weight ``[out, in]``, optional bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
