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

Row-parallel linears (``o_proj`` / ``linear_proj``, ``down`` / ``linear_fc2``,
the Mamba ``out_proj``) use :func:`row_parallel_linear`, whose K reduction is a
fixed tree that any tensor-parallel degree dividing its segment count can split
without changing a bit:

* K is cut into S equal contiguous segments (K must be divisible by S).  S is a
  property of the model, ``ArchConfig.row_parallel_segments`` (HF config key
  ``consistent_row_parallel_segments``, default 8; one of
  :data:`SEGMENT_COUNTS`): the largest TP degree its trainer or engine will use.
  The caller passes it (``segments``); this module has no default;
* each segment is the linear above over its K slice, kept in float32
  (:func:`linear_segments`; no bias, no rounding);
* the S float32 partials are summed by :func:`numerics.adjacent_tree_sum`
  (S = 8: ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``; S = 1: the
  one segment as is), the bias (float32) is added, then one rounding to
  ``out_dtype``.

At TP = t (t divides S) rank r holds K columns ``[r K/t, (r+1) K/t)``, i.e.
segments ``r S/t ... (r+1) S/t - 1``: it computes their subtree
(:func:`linear_segments` then ``adjacent_tree_sum``), the t float32 subtree
values are all-gathered in rank order and reduced by ``adjacent_tree_sum`` —
the top of the same tree.  Every t dividing S gives identical bits; a different
S gives a different tree, hence in general different bits.  A smaller S means
longer segments and caps the tensor-parallel degree at S (S = 1: TP = 1 only);
on the GPU it is not faster with today's schedules, tuned for S = 8
(docs/parallel.md, session 35).

Backward: deterministic matmuls for a given shape — float32 on CPU; on CUDA
with bf16/fp16 inputs, tensor-core matmuls in the input dtype (float32
accumulation, one rounding), as Megatron's own backward does.  The backward is
not part of the rollout path and need not be batch-invariant.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import adjacent_tree_sum, ceil_to, tree_sum

K_BLOCK = 64
SEGMENT_COUNTS = (1, 2, 4, 8)  # the row-parallel tree's segment counts S (and the per-rank S / t)
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


@register("linear_segments", "cpu")
def _linear_segments_cpu(x2d: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    seg = weight.shape[1] // segments
    return torch.stack([_linear_cpu(x2d[:, s * seg:(s + 1) * seg], weight[:, s * seg:(s + 1) * seg], None, torch.float32)
                        for s in range(segments)])


@register("linear_segment_tree", "cpu")
def _linear_segment_tree_cpu(x2d: torch.Tensor, weight: torch.Tensor, segments: int, bias: torch.Tensor | None,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """A rank's K-segment subtree, fused: ``round(adjacent_tree_sum(linear_segments) + bias)`` in ``out_dtype``
    (float32 and no bias: the float32 subtree).  CUDA registers a one-launch kernel with the same definition."""
    total = adjacent_tree_sum(_linear_segments_cpu(x2d, weight, segments), dim=0)
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(out_dtype)


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


class LinearSegmentsFunction(torch.autograd.Function):
    """Autograd wrapper of the per-segment float32 partials; backward: each segment's matmuls (as LinearFunction)."""

    @staticmethod
    def forward(ctx, x, weight, segments):
        ctx.save_for_backward(x, weight)
        ctx.segments = segments
        y = implementation("linear_segments", x.device)(x.reshape(-1, x.shape[-1]), weight, segments)
        return y.reshape(segments, *x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        s_count, seg = ctx.segments, weight.shape[1] // ctx.segments
        low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        compute = x.dtype if low else torch.float32
        g = grad_out.reshape(s_count, -1, grad_out.shape[-1]).to(compute)
        x2d = x.reshape(-1, x.shape[-1]).to(compute)
        w = weight.to(compute)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([g[s] @ w[:, s * seg:(s + 1) * seg] for s in range(s_count)], dim=1).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.cat([g[s].t() @ x2d[:, s * seg:(s + 1) * seg] for s in range(s_count)], dim=1).to(weight.dtype)
        return grad_x, grad_w, None


def check_segments(k: int, segments: int) -> None:
    """Refuse a K that the row-parallel contract cannot cut into ``segments`` equal segments (every device)."""
    if segments not in SEGMENT_COUNTS or k % segments:
        raise ValueError(f"row-parallel linear: K={k} cannot be cut into {segments} equal segments "
                         f"(segments must be one of {SEGMENT_COUNTS} and divide K)")


def linear_segments(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """float32 partials ``[segments, ..., N]``: segment ``s`` is ``linear`` over K slice ``s`` of ``segments`` equal slices."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_segments: input has {x.shape[-1]} features, weight expects {weight.shape[-1]}")
    check_segments(weight.shape[-1], segments)
    return LinearSegmentsFunction.apply(x, weight, segments)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, segments: int, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tree of ``segments`` K segments (the model's S) on one rank (TP = 1):
    ``round(adjacent_tree_sum(linear_segments(x, weight, segments)) + bias)``."""
    total = adjacent_tree_sum(linear_segments(x, weight, segments), dim=0)
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(out_dtype or x.dtype)


class Linear(nn.Module):
    """Thin module around :func:`linear` (weight ``[out, in]``, optional bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
