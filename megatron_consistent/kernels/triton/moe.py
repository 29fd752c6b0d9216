"""Mixture-of-experts on CUDA (issue #7): router top-k and grouped expert GEMMs (Triton).

GPU numerics contract (same shape as the CPU contract of :mod:`megatron_consistent.kernels.moe`):

* **router**: logits come from the batch-invariant Triton linear with its float32
  accumulator (``kernels.moe.router_logits``); ``moe_route`` on CUDA runs the CPU
  route's torch ops on the device — all per row with a fixed order: float64
  polynomial ``exp`` (one rounding), fixed-tree ``tree_sum``, a **stable** sort so
  exact ties keep the lowest expert index, float32 weights;
* **experts** (``moe_expert_outputs``): the (token, slot) pairs are ordered by
  ascending expert (stable: pair order within an expert), and every expert linear
  runs in ONE grouped Triton GEMM launch whose tiles never mix experts.  Each
  output element is computed with exactly the Triton ``linear``'s arithmetic for
  that expert's weight shape (same ``BLOCK_K``, same fixed splits of
  ``linear.config_for(N, K, dtype)``, same in-split tensor-core chain, split
  partials summed in split order, one rounding), so an expert's result for a
  token equals ``linear(x_token, W_e)`` alone — it cannot depend on which other
  tokens share the expert (``tests/test_gpu_moe.py`` checks bitwise); the per-expert counts and the tile table
  are computed on the device (no host read, fixed shapes: capturable in a CUDA graph);
  the activation between the two GEMMs is the registered CUDA ``silu_and_mul``
  (or ``relu_squared``), elementwise;
* **combine** (``moe_combine``): one Triton kernel, compiled without fused
  multiply-add, per token ``acc = Σ_j float32(w_j) · float32(y_j)`` in top-k slot
  order from 0 (plus the gated shared expert), one rounding — bitwise the CPU
  ``kernels.moe`` combine.

Backward (training): the grouped GEMM's backward runs one matmul per expert in
the input dtype (float32 accumulation), like ``LinearFunction`` on CUDA; it need
not be batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import moe as kmoe
from ..dispatch import register
from ..relu_squared import relu_squared
from ..silu_and_mul import silu_and_mul
from .linear import _epilogue, _serial_splits, config_for



# ---------------------------------------------------------------------------------------------- router
@register("moe_route", "cuda")
def _route_cuda(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
    """The CPU route's per-row torch ops, on the device (contract above)."""
    return kmoe._route_cpu(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling)


# ---------------------------------------------------------------------------------------------- grouped GEMM
@triton.jit(do_not_specialize=["num_n"])
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                         N, K, stride_xm, stride_we, stride_wn, stride_om, num_n,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr, NUM_STAGES: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    mt = pid // num_n
    nt = pid % num_n
    e = tl.load(tile_e_ptr + mt)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + mt)
        r1 = tl.load(tile_r1_ptr + mt)  # rows [r0, r1) all belong to expert e
        off_n = nt * BN
        w_e = w_ptr + e.to(tl.int64) * stride_we
        k_steps = tl.cdiv(K, BK)
        # the Triton linear's serial path, rows masked to [r0, r1)
        total = _serial_splits(x_ptr, w_e, r0, off_n, k_steps, r1, N, K, stride_xm, stride_wn,
                               BM, BN, BK, SPLIT_STEPS, SPLITS, False, NUM_STAGES, PRECISION)
        _epilogue(total, out_ptr, out_ptr, r0, off_n, r1, N, stride_om, BM, BN, False)


def _tile_table(counts: torch.Tensor, bm: int, rows: int):
    """Per M-tile (expert, first row, end row); tiles past the last are expert -1.  No host sync."""
    e_count = counts.shape[0]
    max_tiles = triton.cdiv(rows, bm) + e_count
    tiles = (counts + (bm - 1)) // bm
    cum_tiles = torch.cumsum(tiles, 0)
    first_tile = cum_tiles - tiles
    row_end = torch.cumsum(counts, 0)
    row_start = row_end - counts
    i = torch.arange(max_tiles, device=counts.device)
    e_of = torch.searchsorted(cum_tiles, i, right=True)
    valid = e_of < e_count
    ec = e_of.clamp(max=e_count - 1)
    r0 = row_start[ec] + (i - first_tile[ec]) * bm
    r1 = torch.minimum(r0 + bm, row_end[ec])
    tile_e = torch.where(valid, ec, torch.full_like(ec, -1))
    return tile_e.to(torch.int32), r0.to(torch.int32), r1.to(torch.int32), max_tiles


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e].T`` for rows sorted by expert (``counts[e]`` rows each), one launch."""
    p, k = x.shape
    e_count, n, k2 = w.shape
    if k2 != k or x.dtype != w.dtype or counts.shape != (e_count,):
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, "
                         f"counts {tuple(counts.shape)} disagree")
    if p * max(k, 1) >= 2 ** 31:
        raise ValueError(f"grouped_gemm: {p} rows x {k} columns exceed 32-bit row offsets")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if (w.stride(-1) == 1 and w.stride(1) == k) else w.contiguous()
    out = torch.empty((p, n), dtype=out_dtype or x.dtype, device=x.device)
    if p == 0 or n == 0:
        return out
    cfg = config_for(n, k, w.dtype, None, False)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    k_steps = triton.cdiv(k, bk)
    split_steps = min(cfg["SPLIT_STEPS"], k_steps)
    splits = triton.cdiv(k_steps, split_steps)
    tile_e, r0, r1, max_tiles = _tile_table(counts, bm, p)
    num_n = triton.cdiv(n, bn)
    _grouped_gemm_kernel[(max_tiles * num_n,)](
        x, w, out, tile_e, r0, r1, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0), num_n,
        BM=bm, BN=bn, BK=bk, SPLIT_STEPS=split_steps, SPLITS=splits, NUM_STAGES=cfg["S"],
        PRECISION="ieee" if w.dtype == torch.float32 else "tf32", num_warps=cfg["W"], num_stages=cfg["S"],
    )
    return out


class GroupedLinearFunction(torch.autograd.Function):
    """Grouped Triton forward; backward one matmul per expert in the input dtype (float32 on float32 inputs)."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w, counts)
        return grouped_gemm(x, w, counts)

    @staticmethod
    def backward(ctx, g):
        x, w, counts = ctx.saved_tensors
        low = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
        compute = x.dtype if low else torch.float32
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        r0 = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                ge = g[r0 : r0 + c].to(compute)
                if gx is not None:
                    gx[r0 : r0 + c] = (ge @ w[e].to(compute)).to(x.dtype)
                if gw is not None:
                    gw[e] = (ge.t() @ x[r0 : r0 + c].to(compute)).to(w.dtype)
            r0 += c
        return gx, gw, None


def expert_counts(by_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert ``[E]`` int64 from the ascending expert ids: the boundaries of each expert's run, found by
    ``searchsorted`` (no host read, unlike ``bincount``, whose output length needs the largest id on the host)."""
    bounds = torch.searchsorted(by_expert, torch.arange(num_experts + 1, device=by_expert.device, dtype=by_expert.dtype))
    return bounds[1:] - bounds[:-1]


@register("moe_expert_outputs", "cuda")
def _expert_outputs_cuda(hidden: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         activation: str = "swiglu") -> torch.Tensor:
    """``[T, k, H]``: pairs sorted by expert, grouped GEMM -> activation -> grouped GEMM, back to (token, slot)."""
    if activation not in kmoe.EXPERT_ACTIVATIONS:
        raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(kmoe.EXPERT_ACTIVATIONS)}")
    t, k = experts.shape
    flat = experts.reshape(-1)
    by_expert, order = torch.sort(flat, stable=True)  # ascending expert, pair order within an expert
    counts = expert_counts(by_expert, w_gate_up.shape[0])
    h = GroupedLinearFunction.apply(hidden[order // k], w_gate_up, counts)
    a = silu_and_mul(h) if activation == "swiglu" else relu_squared(h)
    y = GroupedLinearFunction.apply(a, w_down, counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse].reshape(t, k, -1)


# ---------------------------------------------------------------------------------------------- combine
@triton.jit(do_not_specialize=["H"])
def _combine_kernel(Y, W, S, G, OUT, H, stride_yt, stride_yk, stride_wt, stride_st, stride_gt, stride_ot,
                    K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(W + t * stride_wt + j)
        yj = tl.load(Y + t * stride_yt + j * stride_yk + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + wj * yj  # launched with enable_fp_fusion=False: a product and a sum, two roundings
    if HAS_SHARED:
        sv = tl.load(S + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            sv = tl.load(G + t * stride_gt) * sv
        acc = acc + sv
    tl.store(OUT + t * stride_ot + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@register("moe_combine", "cuda")
def _combine_cuda(y: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """``round(sum_j w_j * float32(y_j) [+ g * float32(y_shared)])``, slot order, float32 — bitwise the torch ops of
    the CPU combine (every element its own chain of IEEE products and sums)."""
    t, k, h = y.shape
    y = y if y.stride(-1) == 1 else y.contiguous()
    w = w.to(torch.float32)
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    g = gate.to(torch.float32) if gate is not None else None
    block = 1024
    _combine_kernel[(t, triton.cdiv(h, block))](
        y, w, shared if shared is not None else y, g if g is not None else w, out, h,
        y.stride(0), y.stride(1), w.stride(0), shared.stride(0) if shared is not None else 0,
        g.stride(0) if g is not None else 0, out.stride(0),
        K=k, HAS_SHARED=shared is not None, HAS_GATE=g is not None, BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out
