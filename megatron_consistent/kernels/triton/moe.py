"""Mixture-of-experts on CUDA (issue #7): router top-k and grouped expert GEMMs (Triton).

GPU numerics contract (same shape as the CPU contract of :mod:`megatron_consistent.kernels.moe`):

* **router**: logits come from the batch-invariant Triton linear with its float32
  accumulator (``kernels.moe.router_logits``); the route (``moe_select_experts``, and
  ``moe_route`` = it plus the NaN refusal) is one Triton program per token with the CPU
  route's arithmetic: float64 polynomial ``exp`` (one rounding), the fixed ``tree_sum``,
  IEEE divisions, no fused multiply-add, the k best keys with exact ties to the lowest
  expert index (what the CPU's stable sort gives) — bitwise the CPU route;
* **experts** (``moe_expert_outputs``): the (token, slot) pairs are ordered by
  ascending expert (stable: pair order within an expert; a counting sort in two
  launches), and every expert linear
  runs in ONE grouped Triton GEMM launch whose tiles never mix experts.  Each
  output element is computed with exactly the Triton ``linear``'s arithmetic for
  that expert's weight shape (same ``BLOCK_K``, same fixed splits of
  ``linear.config_for(N, K, dtype)``, same in-split tensor-core chain, split
  partials summed in split order, one rounding), so an expert's result for a
  token equals ``linear(x_token, W_e)`` alone — it cannot depend on which other
  tokens share the expert (``tests/test_gpu_moe.py`` checks bitwise); the per-expert counts and the tile table
  are computed on the device (no host read, fixed shapes: capturable in a CUDA graph); the first GEMM reads its
  rows from the tokens through the sorted pairs and the second writes its rows in (token, slot) order (addressing
  only: the bits of an explicit gather and scatter);
  the activation between the two GEMMs is the registered CUDA ``silu_and_mul``
  (or ``relu_squared``), elementwise;
* **block-FP8 experts** (``fp8_moe_expert_outputs``, inference): the same sort and tile table, the tokens'
  activations quantized once per token (:func:`.fp8_linear.quantize_activations`, per row, so gathering after
  quantizing gives the bits of quantizing the gathered rows), then ONE grouped FP8 GEMM launch per projection
  whose every element is :func:`.fp8_linear.fp8_gemm`'s chain for that expert's shape (``fp8_config(N, K)``'s
  split groups, groups in K order, split partials summed in split order from 0, one rounding) — so an expert's
  row equals ``fp8_linear(x_token, W_e)`` alone; tiles of 64 or more rows only (the FP8 ``wgmma`` shapes; the
  bits of FP8 ``mma.sync`` against ``wgmma`` are not established);
* **combine** (``moe_combine``): one Triton kernel, compiled without fused
  multiply-add, per token ``acc = Σ_j float32(w_j) · float32(y_j)`` in top-k slot
  order from 0 (plus the gated shared expert), one rounding — bitwise the CPU
  ``kernels.moe`` combine.

Backward (training): the grouped GEMM's backward runs one matmul per expert in
the input dtype (float32 accumulation), like ``LinearFunction`` on CUDA; it need
not be batch-invariant.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import moe as kmoe
from ..dispatch import register
from ..relu_squared import relu_squared
from ..silu_and_mul import silu_and_mul
from ..fp8 import gate_up_block_rows, per_expert_fp8_outputs, row_block_of_parts
from ._common import TensorDescriptor, next_pow2, tma_ok
from .fp8_linear import GROUP, _serial_fp8_splits, fp8_config, fp8_kernel_applies, quantize_activations
from .linear import _epilogue, _serial_splits, config_for
from .numerics import exp_f32, tree_cols



# ---------------------------------------------------------------------------------------------- router
@triton.jit
def _tree_sum(x, WIDTH: tl.constexpr):
    """:func:`numerics.tree_sum` of a power-of-two vector (:func:`triton.numerics.tree_cols` of it as one row; the
    one-element sum that makes it a scalar adds nothing)."""
    return tl.sum(tree_cols(tl.reshape(x, (1, WIDTH)), 1, WIDTH), axis=0)


@triton.jit
def _select_experts_kernel(Z, BIAS, W_OUT, E_OUT, scaling, stride_z,
                           E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                           SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EP)
    live = cols < E
    z = tl.load(Z + t * stride_z + cols, mask=live, other=0.0)
    if SIGMOID:
        s = tl.math.div_rn(tl.zeros_like(z) + 1.0, 1.0 + exp_f32(-z))
    else:
        zm = tl.where(live, z, -float("inf"))
        e = tl.where(live, exp_f32(z - tl.max(zm, axis=0)), 0.0)  # the tree's zero padding
        s = tl.math.div_rn(e, tl.zeros_like(e) + _tree_sum(e, EP))
    keys = s
    if HAS_BIAS:
        keys = s + tl.load(BIAS + cols, mask=live, other=0.0)
    nan = keys != keys
    slots = tl.arange(0, KP)
    w = tl.zeros((KP,), dtype=tl.float32)
    for j in tl.static_range(K):
        # the stable descending sort's j-th entry: NaN first (PyTorch orders it above every number), then the largest
        # key; among equal keys the lowest expert index
        nan_first = tl.min(tl.where(live & nan, cols, EP), axis=0)
        best = tl.max(tl.where(live & ~nan, keys, -float("inf")), axis=0)
        best_first = tl.min(tl.where(live & ~nan & (keys == best), cols, EP), axis=0)
        pick = tl.where(nan_first < EP, nan_first, best_first)
        tl.store(E_OUT + t * K + j, pick.to(tl.int64))
        w = tl.where(slots == j, tl.sum(tl.where(cols == pick, s, 0.0), axis=0), w)  # s[pick] + zeros: exact
        live = live & (cols != pick)
    if NORM:
        w = tl.math.div_rn(w, tl.zeros_like(w) + _tree_sum(w, KP))
    if SCALE:
        w = w * scaling
    tl.store(W_OUT + t * K + slots, w, mask=slots < K)


@register("moe_select_experts", "cuda")
def select_experts(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
    """:func:`kernels.moe.select_experts` in one Triton launch, one program per token (bitwise the CPU route's ops:
    the same float64 ``exp`` chain, tree sums, IEEE divisions, no fused multiply-add; NaN keys first, then the
    largest, exact ties to the lowest index).  Group-limited selection (``n_group > 1``) runs the torch ops."""
    if n_group > 1:
        return kmoe.select_experts(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling)
    t, e = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    w = torch.empty((t, top_k), dtype=torch.float32, device=z.device)
    experts = torch.empty((t, top_k), dtype=torch.int64, device=z.device)
    if t == 0:
        return w, experts
    b = None if bias is None else bias.to(torch.float32).contiguous()
    _select_experts_kernel[(t,)](
        z, b if b is not None else z, w, experts, float(scaling), z.stride(0),
        E=e, EP=next_pow2(e), K=top_k, KP=next_pow2(top_k), SIGMOID=scoring == "sigmoid", HAS_BIAS=b is not None,
        NORM=bool(norm_topk_prob), SCALE=scaling != 1.0, num_warps=1 if e <= 128 else 4, enable_fp_fusion=False)
    return w, experts


@register("moe_route", "cuda")
def _route_cuda(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
    """The trainer's route: :func:`select_experts`, refusing NaN keys (a NaN key is always selected, so it shows in
    the weights unless it came from the bias alone)."""
    w, experts = select_experts(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling)
    if torch.isnan(w).any() or (bias is not None and torch.isnan(bias).any()):
        raise ValueError("router scores contain NaN")
    return w, experts


# ---------------------------------------------------------------------------------------------- grouped GEMM
@triton.jit(do_not_specialize=["num_n"])
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr,
                         N, K, stride_xm, stride_we, stride_wn, stride_om, num_n,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr, NUM_STAGES: tl.constexpr,
                         PRECISION: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, SLOTS: tl.constexpr):
    """Sorted row r of expert e: ``x[r] @ w[e].T`` into ``out[r]``; ``GATHER``: its operand row is the token of pair
    ``pair[r]`` (``x[pair[r] // SLOTS]``); ``SCATTER``: its result goes to ``out[pair[r]]`` (pair order)."""
    e, r0, r1, off_n, pair = _expert_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr, num_n, BM, BN,
                                          GATHER or SCATTER)
    if e >= 0:
        w_e = w_ptr + e.to(tl.int64) * stride_we
        k_steps = tl.cdiv(K, BK)
        if GATHER:  # a column of row pointers: the linear's loads with a zero row stride
            a_src = x_ptr + (pair // SLOTS)[:, None] * stride_xm
            a_stride = 0
        else:
            a_src = x_ptr
            a_stride = stride_xm
        # the Triton linear's serial path, rows masked to [r0, r1)
        total = _serial_splits(a_src, w_e, r0, off_n, k_steps, r1, N, K, a_stride, stride_wn,
                               BM, BN, BK, SPLIT_STEPS, SPLITS, False, NUM_STAGES, PRECISION)
        _store_expert_rows(total, out_ptr, pair, r0, r1, off_n, N, stride_om, BM, BN, SCATTER)


@triton.jit
def _expert_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr, num_n, BM: tl.constexpr, BN: tl.constexpr,
                 PAIRS: tl.constexpr):
    """This program's (expert or -1, first row, end row, first column, the pair of each row) from the tile table;
    rows [r0, r1) all belong to the expert.  Without ``PAIRS`` the rows stand for themselves."""
    pid = tl.program_id(0)
    mt = pid // num_n
    r0 = tl.load(tile_r0_ptr + mt)
    r1 = tl.load(tile_r1_ptr + mt)
    rows = r0 + tl.arange(0, BM)
    if PAIRS:
        pair = tl.load(pair_ptr + rows, mask=rows < r1, other=0).to(tl.int64)
    else:
        pair = rows.to(tl.int64)
    return tl.load(tile_e_ptr + mt), r0, r1, (pid % num_n) * BN, pair


@triton.jit
def _store_expert_rows(total, out_ptr, pair, r0, r1, off_n, N, stride_om, BM: tl.constexpr, BN: tl.constexpr,
                       SCATTER: tl.constexpr):
    """Rows [r0, r1) of ``total`` into ``out`` (rounded once): at their pairs' rows with ``SCATTER``, else at r0 on."""
    if SCATTER:
        rows = r0 + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        tl.store(out_ptr + pair[:, None] * stride_om + cols[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < r1) & (cols[None, :] < N))
    else:
        _epilogue(total, out_ptr, out_ptr, r0, off_n, r1, N, stride_om, BM, BN, False)


@triton.jit(do_not_specialize=["max_tiles"])
def _tile_table_kernel(COUNTS, TILE_E, TILE_R0, TILE_R1, max_tiles, E: tl.constexpr, EP: tl.constexpr,
                       BM: tl.constexpr, BLOCK: tl.constexpr):
    """Tiles ``[pid * BLOCK, pid * BLOCK + BLOCK)`` of the table: expert e's rows ``[start_e, end_e)`` cut into
    ``ceil(count_e / BM)`` tiles, experts in ascending order; tiles past the last get expert -1."""
    experts = tl.arange(0, EP)
    counts = tl.load(COUNTS + experts, mask=experts < E, other=0).to(tl.int32)
    tiles = (counts + (BM - 1)) // BM
    tiles_end = tl.cumsum(tiles, axis=0)
    rows_end = tl.cumsum(counts, axis=0)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e_of = tl.sum((tiles_end[None, :] <= i[:, None]).to(tl.int32), axis=1)  # experts whose tiles all precede tile i
    mine = experts[None, :] == e_of[:, None]
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), axis=1)
    row_start = tl.sum(tl.where(mine, rows_end - counts, 0), axis=1)
    row_end = tl.sum(tl.where(mine, rows_end, 0), axis=1)
    r0 = row_start + (i - first_tile) * BM
    valid = e_of < E
    keep = i < max_tiles
    tl.store(TILE_E + i, tl.where(valid, e_of, -1), mask=keep)
    tl.store(TILE_R0 + i, tl.where(valid, r0, 0), mask=keep)
    tl.store(TILE_R1 + i, tl.where(valid, tl.minimum(r0 + BM, row_end), 0), mask=keep)


def tile_table(counts: torch.Tensor, bm: int, rows: int):
    """``(bm, expert, first row, end row, length)``: per M tile of ``bm`` rows its expert and rows (int32), over a
    table of length ``cdiv(rows, bm) + E`` (every tiling of ``rows`` rows over E experts fits); one launch, no host
    read."""
    e_count = counts.shape[0]
    max_tiles = triton.cdiv(rows, bm) + e_count
    tile_e, r0, r1 = (torch.empty(max_tiles, dtype=torch.int32, device=counts.device) for _ in range(3))
    block = 32
    _tile_table_kernel[(triton.cdiv(max_tiles, block),)](counts, tile_e, r0, r1, max_tiles, E=e_count,
                                                          EP=next_pow2(e_count), BM=bm, BLOCK=block, num_warps=4)
    return bm, tile_e, r0, r1, max_tiles


# (largest mean rows per expert, BM, warps): row tiles for few rows per expert (decode), only below the config's BM;
# BK, the splits and their order stay the config's, so every row's bits are the same
GROUPED_ROW_TILES = ((16, 16, 4), (32, 32, 4), (64, 64, 4))


def grouped_tiles(cfg: dict, rows: int, experts: int) -> tuple[int, int]:
    """(BM, warps) of the grouped GEMM for ``rows`` rows over ``experts`` experts (a function of the shapes only)."""
    mean = rows / max(experts, 1)
    for max_mean, bm, warps in GROUPED_ROW_TILES:
        if mean <= max_mean and bm < cfg["BM"]:
            return bm, warps
    return cfg["BM"], cfg["W"]


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype | None = None,
                 tiles: tuple | None = None, pair_of_row: torch.Tensor | None = None, gather: bool = False,
                 scatter: bool = False, slots: int = 1) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e].T`` for rows sorted by expert (``counts[e]`` rows each), one launch.

    ``tiles``: a :func:`tile_table` of these counts (the two projections of one MoE layer share it when their BM
    agree; otherwise a table is built).  With ``pair_of_row`` (the (token, slot) pair of each sorted row, ``slots``
    pairs per token): ``gather`` reads row r's operand from ``x[pair_of_row[r] // slots]`` (``x``: the tokens), and
    ``scatter`` writes row r's result to row ``pair_of_row[r]`` (pair order) — the values of a gather before and a
    scatter after, without either copy."""
    rows_in, k = x.shape
    p = pair_of_row.shape[0] if pair_of_row is not None else rows_in
    e_count, n, k2 = w.shape
    if k2 != k or x.dtype != w.dtype or counts.shape != (e_count,):
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, "
                         f"counts {tuple(counts.shape)} disagree")
    if (gather or scatter) and pair_of_row is None:
        raise ValueError("grouped_gemm: gather / scatter need pair_of_row")
    if not gather and rows_in != p:
        raise ValueError(f"grouped_gemm: {rows_in} rows of x for {p} sorted rows without gather")
    if max(p, rows_in) * max(k, n, 1) >= 2 ** 31:
        raise ValueError(f"grouped_gemm: {max(p, rows_in)} rows x {max(k, n)} columns exceed 32-bit row offsets")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if (w.stride(-1) == 1 and w.stride(1) == k) else w.contiguous()
    out = torch.empty((p, n), dtype=out_dtype or x.dtype, device=x.device)
    if p == 0 or n == 0:
        return out
    cfg = config_for(n, k, w.dtype, None, False)
    bn, bk = cfg["BN"], cfg["BK"]
    bm, warps = grouped_tiles(cfg, p, e_count)
    k_steps = triton.cdiv(k, bk)
    split_steps = min(cfg["SPLIT_STEPS"], k_steps)
    splits = triton.cdiv(k_steps, split_steps)
    _, tile_e, r0, r1, max_tiles = tiles if tiles is not None and tiles[0] == bm else tile_table(counts, bm, p)
    num_n = triton.cdiv(n, bn)
    _grouped_gemm_kernel[(max_tiles * num_n,)](
        x, w, out, tile_e, r0, r1, pair_of_row if pair_of_row is not None else tile_e, n, k, x.stride(0), w.stride(0),
        w.stride(1), out.stride(0), num_n, BM=bm, BN=bn, BK=bk, SPLIT_STEPS=split_steps, SPLITS=splits,
        NUM_STAGES=cfg["S"], PRECISION="ieee" if w.dtype == torch.float32 else "tf32", GATHER=bool(gather),
        SCATTER=bool(scatter), SLOTS=int(slots), num_warps=warps, num_stages=cfg["S"],
    )
    return out


class GroupedLinearFunction(torch.autograd.Function):
    """Grouped Triton forward (with its fused gather / scatter); backward one matmul per expert in the input dtype
    (float32 on float32 inputs), the gather's gradient summed back to the tokens."""

    @staticmethod
    def forward(ctx, x, w, counts, tiles, pair_of_row, gather, scatter, slots):
        ctx.save_for_backward(x, w, counts, pair_of_row)
        ctx.layout = (gather, scatter, slots)
        return grouped_gemm(x, w, counts, tiles=tiles, pair_of_row=pair_of_row, gather=gather, scatter=scatter,
                            slots=slots)

    @staticmethod
    def backward(ctx, g):
        x, w, counts, pair_of_row = ctx.saved_tensors
        gather, scatter, slots = ctx.layout
        xs = x[pair_of_row // slots] if gather else x  # operand rows in sorted order
        g = g[pair_of_row] if scatter else g
        low = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
        compute = x.dtype if low else torch.float32
        gx = torch.zeros_like(xs) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        r0 = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                ge = g[r0 : r0 + c].to(compute)
                if gx is not None:
                    gx[r0 : r0 + c] = (ge @ w[e].to(compute)).to(x.dtype)
                if gw is not None:
                    gw[e] = (ge.t() @ xs[r0 : r0 + c].to(compute)).to(w.dtype)
            r0 += c
        if gx is not None and gather:
            gx = torch.zeros_like(x).index_add_(0, pair_of_row // slots, gx)
        return gx, gw, None, None, None, None, None, None


@triton.jit(do_not_specialize=["pairs", "bp"])
def _expert_block_counts_kernel(EXPERTS, BLOCK_COUNTS, pairs, bp, E: tl.constexpr, EP: tl.constexpr,
                                SUB: tl.constexpr):
    """Pairs per expert within pair block ``pid`` (``bp`` pairs, in chunks of ``SUB``)."""
    b = tl.program_id(0)
    experts = tl.arange(0, EP)
    acc = tl.zeros((EP,), dtype=tl.int32)
    for s in tl.range(0, bp, SUB):
        i = b * bp + s + tl.arange(0, SUB)
        ex = tl.load(EXPERTS + i, mask=i < pairs, other=-1).to(tl.int32)
        acc += tl.sum((ex[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(BLOCK_COUNTS + b * EP + experts, acc)


@triton.jit(do_not_specialize=["pairs", "blocks", "bp"])
def _expert_sort_kernel(EXPERTS, BLOCK_COUNTS, PAIR_OF_ROW, COUNTS, pairs, blocks, bp,
                        E: tl.constexpr, EP: tl.constexpr, SUB: tl.constexpr, NBP: tl.constexpr):
    """Counting sort of the pairs by expert, stable: pair i of expert e goes to row ``start_e + (pairs of e before
    i)``; writes the pair of every row (``PAIR_OF_ROW``) and, from program 0, the counts.  A pair of expert -1 is
    counted nowhere and gets no row (the rows past the counted ones are left unwritten)."""
    b = tl.program_id(0)
    experts = tl.arange(0, EP)
    blk = tl.arange(0, NBP)
    bc = tl.load(BLOCK_COUNTS + blk[:, None] * EP + experts[None, :], mask=blk[:, None] < blocks, other=0)
    counts = tl.sum(bc, axis=0)
    base = tl.cumsum(counts, axis=0) - counts + tl.sum(tl.where(blk[:, None] < b, bc, 0), axis=0)
    for s in tl.range(0, bp, SUB):
        i = b * bp + s + tl.arange(0, SUB)
        live = i < pairs
        ex = tl.load(EXPERTS + i, mask=live, other=-1).to(tl.int32)
        onehot = (ex[:, None] == experts[None, :]).to(tl.int32)
        row = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + base[None, :]), axis=1)
        tl.store(PAIR_OF_ROW + row, i.to(tl.int64), mask=live & (ex >= 0))
        base += tl.sum(onehot, axis=0)
    if b == 0:
        tl.store(COUNTS + experts, counts.to(tl.int64), mask=experts < E)


# pair blocks of the counting sort: at most this many (each program reads every block's counts); the block size and
# count are runtime arguments, so one binary serves every token count
MAX_PAIR_BLOCKS = 64


def expert_sort(experts: torch.Tensor, num_experts: int):
    """The (token, slot) pairs of ``experts [T, k]`` (pair ``i`` = token ``i // k``, slot ``i % k``) ordered by
    ascending expert, pair order within an expert (what a stable sort gives, as a counting sort: two launches, no host
    read): ``(the pair of each sorted row [T*k] int64, pairs per expert [E] int64)``.  Pairs of expert -1 (not
    computed) are left out: the first ``counts.sum()`` rows are the others', the rest unwritten."""
    t, k = experts.shape
    pairs = t * k
    flat = experts.reshape(-1).contiguous()
    ep = next_pow2(num_experts)
    sub = max(16, min(128, 16384 // ep))
    bp = max(sub, next_pow2(triton.cdiv(pairs, MAX_PAIR_BLOCKS)))
    blocks = max(1, triton.cdiv(pairs, bp))
    block_counts = torch.empty((blocks, ep), dtype=torch.int32, device=experts.device)
    pair_of_row = torch.empty(pairs, dtype=torch.int64, device=experts.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
    _expert_block_counts_kernel[(blocks,)](flat, block_counts, pairs, bp, E=num_experts, EP=ep, SUB=sub, num_warps=4)
    _expert_sort_kernel[(blocks,)](flat, block_counts, pair_of_row, counts, pairs, blocks, bp,
                                   E=num_experts, EP=ep, SUB=sub, NBP=MAX_PAIR_BLOCKS, num_warps=4)
    return pair_of_row, counts


@register("moe_expert_outputs", "cuda")
def _expert_outputs_cuda(hidden: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         activation: str = "swiglu") -> torch.Tensor:
    """``[T, k, H]``: pairs sorted by expert, grouped GEMM (its operand rows gathered from the tokens) -> activation ->
    grouped GEMM (its result rows scattered back to (token, slot) order).  Pairs of expert -1 get no row, so no tile:
    their output rows are left unwritten (:func:`kernels.moe.expert_outputs`)."""
    if activation not in kmoe.EXPERT_ACTIVATIONS:
        raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(kmoe.EXPERT_ACTIVATIONS)}")
    t, k = experts.shape
    e_count = w_gate_up.shape[0]
    pair_of_row, counts = expert_sort(experts, e_count)
    bm, _ = grouped_tiles(config_for(w_gate_up.shape[1], w_gate_up.shape[2], w_gate_up.dtype, None, False), t * k,
                          e_count)
    tiles = tile_table(counts, bm, t * k)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    h = GroupedLinearFunction.apply(hidden, w_gate_up, counts, tiles, pair_of_row, True, False, k)
    a = silu_and_mul(h) if activation == "swiglu" else relu_squared(h)
    y = GroupedLinearFunction.apply(a, w_down, counts, tiles, pair_of_row, False, True, k)
    return y.reshape(t, k, -1)


# ---------------------------------------------------------------------------------------------- block-FP8 experts
@triton.jit(do_not_specialize=["num_n"])
def _fp8_grouped_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr,
                             N, K, stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                             num_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             SPLIT_GROUPS: tl.constexpr, SPLITS: tl.constexpr, NUM_STAGES: tl.constexpr,
                             GATHER: tl.constexpr, SCATTER: tl.constexpr, SLOTS: tl.constexpr,
                             FLAT: tl.constexpr = False, W_TMA: tl.constexpr = False, SWS: tl.constexpr = False):
    """Sorted row r of expert e: the FP8 GEMM of ``(xq[r], xs[r])`` with ``(wq[e], ws[e])`` into ``out[r]``;
    ``GATHER``: its operand row and scales are those of token ``pair[r] // SLOTS``; ``SCATTER``: its result goes to
    ``out[pair[r]]``; ``W_TMA``: ``w_ptr`` is a TMA descriptor of the stacked weights as ``[E * N, K]``; ``SWS``: one
    weight scale per (tile, group), as in ``fp8_gemm``."""
    e, r0, r1, off_n, pair = _expert_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr, num_n, BM, BN,
                                          GATHER or SCATTER)
    if e >= 0:
        if W_TMA:
            w_e = w_ptr
        else:
            w_e = w_ptr + e.to(tl.int64) * stride_we
        ws_e = ws_ptr + e.to(tl.int64) * stride_wse
        if GATHER:  # columns of row pointers: fp8_gemm's loads with zero row strides
            token = pair // SLOTS
            a_src = x_ptr + token[:, None] * stride_xm
            s_src = xs_ptr + token * stride_xsm
            a_stride = 0
            s_stride = 0
        else:
            a_src = x_ptr
            s_src = xs_ptr
            a_stride = stride_xm
            s_stride = stride_xsm
        # fp8_gemm's serial path, rows masked to [r0, r1)
        total = _serial_fp8_splits(a_src, w_e, s_src, ws_e, r0, off_n, r1, N, K, a_stride, stride_wn, s_stride,
                                   stride_wsn, BM, BN, BK, SPLIT_GROUPS, SPLITS, False, NUM_STAGES, SWS, FLAT,
                                   W_TMA, e * N)
        _store_expert_rows(total, out_ptr, pair, r0, r1, off_n, N, stride_om, BM, BN, SCATTER)


# rows per M tile of the grouped FP8 GEMM: 64 (one FP8 wgmma warp group) below the config's BM at few rows per expert
FP8_GROUPED_SMALL_BM = 64
# "BM:BN:warps" for every grouped FP8 launch instead of the rule's ("" = none): a benchmark knob, scheduling only (an
# element's groups, splits and their order do not depend on the tile; whether a 16-row tile's FP8 mma.sync gives the
# bits of wgmma is what the benchmark checks)
_FP8_GROUPED_TILE = os.environ.get("MC_FP8_GROUPED_TILE", "")
# the splits walked by one pipelined loop, and the weight operand through a TMA descriptor of the stacked experts:
# scheduling and loads only (bits unchanged); both on by default since the H200 measured them faster at every T
# (session 19, bench_gpu_moe.py --fp8-variants); "0" turns one off for a comparison
FP8_GROUPED_FLAT = os.environ.get("MC_FP8_GROUPED_FLAT", "1") == "1"
FP8_GROUPED_W_TMA = os.environ.get("MC_FP8_GROUPED_W_TMA", "1") == "1"


def fp8_grouped_tiles(cfg: dict, rows: int, experts: int) -> tuple[int, int, int]:
    """(BM, BN, warps) of the grouped FP8 GEMM (a function of the shapes only; ``wgmma`` tiles of 64 or more rows)."""
    if rows / max(experts, 1) <= FP8_GROUPED_SMALL_BM and cfg["BM"] > FP8_GROUPED_SMALL_BM:
        bm, bn, warps = FP8_GROUPED_SMALL_BM, cfg["BN"], 4
    else:
        bm, bn, warps = cfg["BM"], cfg["BN"], cfg["W"]
    if _FP8_GROUPED_TILE:
        bm, bn, warps = (int(v) for v in _FP8_GROUPED_TILE.split(":"))
    return bm, bn, warps


def fp8_grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, tiles: tuple,
                     pair_of_row: torch.Tensor, out_dtype: torch.dtype, gather: bool = False, scatter: bool = False,
                     slots: int = 1, w_block_rows: int = 0) -> torch.Tensor:
    """``y[rows of e] = fp8_gemm(xq[rows], xs[rows], wq[e], ws[e])`` for rows sorted by expert, one launch.

    ``xq [rows or tokens, K]`` e4m3 with per-row group scales ``xs [.., ceil(K/128)]``; ``wq [E, N, K]`` e4m3 with
    per-row scales ``ws [E, N, ceil(K/128)]``; ``tiles`` a :func:`tile_table` (its BM that of
    :func:`fp8_grouped_tiles`); ``gather`` / ``scatter`` as in :func:`grouped_gemm`; ``w_block_rows`` as in
    ``fp8_gemm`` (the weight scales constant over aligned blocks of that many rows: one scale per tile)."""
    rows_in, k = xq.shape
    p = pair_of_row.shape[0]
    e_count, n, k2 = wq.shape
    g_all = triton.cdiv(k, GROUP)
    if (k2 != k or xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn or tuple(xs.shape) != (rows_in, g_all)
            or tuple(ws.shape) != (e_count, n, g_all)):
        raise ValueError(f"fp8_grouped_gemm: xq {tuple(xq.shape)} {xq.dtype}, xs {tuple(xs.shape)}, wq {tuple(wq.shape)} "
                         f"{wq.dtype}, ws {tuple(ws.shape)} disagree")
    if not gather and rows_in != p:
        raise ValueError(f"fp8_grouped_gemm: {rows_in} rows for {p} sorted rows without gather")
    if max(p, rows_in) * max(k, n, 1) >= 2 ** 31:
        raise ValueError(f"fp8_grouped_gemm: {max(p, rows_in)} rows x {max(k, n)} columns exceed 32-bit row offsets")
    xq, wq = (t if t.stride(-1) == 1 else t.contiguous() for t in (xq, wq))
    xs, ws = (t.to(torch.float32).contiguous() for t in (xs, ws))
    out = torch.empty((p, n), dtype=out_dtype, device=xq.device)
    if p == 0 or n == 0:
        return out
    cfg = fp8_config(n, k)
    bm, bn, warps = fp8_grouped_tiles(cfg, p, e_count)
    tile_bm, tile_e, r0, r1, max_tiles = tiles
    if tile_bm != bm:
        raise ValueError(f"fp8_grouped_gemm: a tile table of {tile_bm} rows for tiles of {bm}")
    split_groups = min(cfg["SPLIT_GROUPS"], g_all)
    num_n = triton.cdiv(n, bn)
    w_src, w_tma = wq, FP8_GROUPED_W_TMA and wq.is_contiguous() and tma_ok(wq.view(e_count * n, k))
    if w_tma:
        w_src = TensorDescriptor.from_tensor(wq.view(e_count * n, k), [bn, GROUP])
    _fp8_grouped_gemm_kernel[(max_tiles * num_n,)](
        xq, xs, w_src, ws, out, tile_e, r0, r1, pair_of_row, n, k, xq.stride(0), xs.stride(0), wq.stride(0), wq.stride(1),
        ws.stride(0), ws.stride(1), out.stride(0), num_n, BM=bm, BN=bn, BK=GROUP, SPLIT_GROUPS=split_groups,
        SPLITS=triton.cdiv(g_all, split_groups), NUM_STAGES=cfg["S"], GATHER=bool(gather), SCATTER=bool(scatter),
        SLOTS=int(slots), FLAT=FP8_GROUPED_FLAT, W_TMA=w_tma,
        SWS=w_block_rows > 0 and w_block_rows % bn == 0, num_warps=warps, num_stages=cfg["S"],
    )
    return out


@register("fp8_moe_expert_outputs", "cuda")
def _fp8_expert_outputs_cuda(hidden: torch.Tensor, experts: torch.Tensor, fc1_q: torch.Tensor, fc1_rows: torch.Tensor,
                             fc2_q: torch.Tensor, fc2_rows: torch.Tensor, w_fmt, a_fmt) -> torch.Tensor:
    """``[T, k, H]``: pairs sorted by expert, tokens quantized, grouped FP8 GEMM (rows gathered from the tokens) ->
    ``silu_and_mul`` -> quantized -> grouped FP8 GEMM (rows scattered to (token, slot) order).  Formats the FP8 GEMM
    does not serve: the per-expert calls (they read the host)."""
    if not (fp8_kernel_applies(w_fmt, a_fmt, fc1_q) and fp8_kernel_applies(w_fmt, a_fmt, fc2_q)):
        return per_expert_fp8_outputs(hidden, experts, fc1_q, fc1_rows, fc2_q, fc2_rows, w_fmt, a_fmt)
    t, k = experts.shape
    e_count = fc1_q.shape[0]
    pair_of_row, counts = expert_sort(experts, e_count)
    bm = fp8_grouped_tiles(fp8_config(fc1_q.shape[1], fc1_q.shape[2]), t * k, e_count)[0]
    bm2 = fp8_grouped_tiles(fp8_config(fc2_q.shape[1], fc2_q.shape[2]), t * k, e_count)[0]
    tiles = tile_table(counts, bm, t * k)
    tiles2 = tiles if bm2 == bm else tile_table(counts, bm2, t * k)
    xq, xs = quantize_activations(hidden, a_fmt)
    # fc1 = [gate; up], each quantized on its own: its scale blocks restart at row I
    h = fp8_grouped_gemm(xq, xs, fc1_q, fc1_rows, tiles, pair_of_row, hidden.dtype, gather=True, slots=k,
                         w_block_rows=gate_up_block_rows(fc1_q.shape[1], w_fmt.block[0]))
    aq, as_ = quantize_activations(silu_and_mul(h), a_fmt)
    y = fp8_grouped_gemm(aq, as_, fc2_q, fc2_rows, tiles2, pair_of_row, hidden.dtype, scatter=True, slots=k,
                         w_block_rows=row_block_of_parts((fc2_q.shape[1],), w_fmt.block[0]))
    return y.reshape(t, k, -1)


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
