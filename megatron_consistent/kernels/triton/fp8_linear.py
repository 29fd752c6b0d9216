"""Block-FP8 linear for CUDA (Triton): FP8 tensor cores, batch-invariant (issue #9).

Same signature as the CPU ``fp8_linear`` (:mod:`megatron_consistent.kernels.fp8`):
``(x2d, w_q [N, K] e4m3, w_row_scales [N, ceil(K/128)] fp32, bias, out_dtype, w_fmt, a_fmt)``.

GPU numerics contract, one output element ``y[m, n]`` (K cut into 128-wide groups
``g = 0 .. G-1``, ``G = ceil(K / 128)``, the activation group = the weight block = ``BLOCK_K``):

1. **activations** are quantized per token and group, dynamically, by
   :func:`quantize_activations`: ``amax`` exact; ``s = amax / 448`` (IEEE float32
   division, ``div_rn``); ``s = 1`` for a zero group; ``q = cast_e4m3(clamp(x / s, ±448))``
   (IEEE division, round-to-nearest-even cast) — the arithmetic of
   :func:`kernels.fp8.quantize`, per row, so batch-invariant.  The Triton kernel is
   checked bitwise against ``kernels.fp8.quantize`` on the GPU; ``pow2`` scales use
   those torch ops directly (also per row);
2. ``p_g = dot(xq[m, g], wq[n, g])``: one FP8 tensor-core MMA chain over the group's
   128 products into a float32 accumulator that starts at 0 (Hopper's FP8 MMA keeps
   fewer accumulator bits internally; the chain is the same for every (m, n) position);
3. ``acc = fma(p_g, xs[m, g] * ws[n, g], acc)`` — the two scales multiplied first
   (one float32 rounding), then one fused multiply-add — groups in increasing order,
   ``acc`` from 0;
4. the groups are cut into *splits* of ``SPLIT_GROUPS`` groups, a function of ``(N, K)``
   only (:func:`fp8_config`); split partials are summed in increasing split order in
   float32 from 0 (one split: taken as is);
5. + bias (float32), one rounding to ``out_dtype``.

Scheduling may depend on M (bitwise neutral): few (M, N) tiles -> one program per
(tile, split) writes its partial to a workspace and a second kernel sums the partials
in split order; otherwise one persistent program walks a tile's splits.  Not bit-equal
to the CPU path (which dequantizes to float32 and uses the blocked float32 ``linear``);
the trainer's FP8 forward (``FP8LinearSTE``) dispatches here too, so trainer and engine
agree on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import implementation, register
from ..fp8 import (E4M3_ACT_1x128, E4M3_MAX, E4M3_WEIGHT_128, TENSOR_CORE_GROUP, QuantFormat, _dequantized_operands,
                   quantize, tensor_core_formats)
from ..numerics import adjacent_tree_sum
from ._common import GLUON, device_index, gemm_output, num_sms, on_hopper, tile_coords, tma_ok, tma_sources
from .linear import _epilogue

GROUP = TENSOR_CORE_GROUP  # activation group = weight block column = BLOCK_K


def _fp8_cfg(bm, bn, warps, stages, progs_per_sm, scalar_wscale=False, flat=False):
    """``scalar_wscale``: when the caller states the weight scales constant over aligned runs of ``w_block_rows`` rows
    and BN divides it, load one weight scale per (tile, group) instead of BN equal ones: the product
    ``xs * ws`` is then BM multiplications instead of BM * BN, with the same float32 values (bits unchanged).
    ``flat``: a tile's splits walked by one pipelined loop (:func:`_serial_fp8_splits`; bits unchanged)."""
    cfg = {"BM": bm, "BN": bn, "BK": GROUP, "W": warps, "S": stages, "G": 8, "P": progs_per_sm}
    if scalar_wscale:
        cfg["SWS"] = True
    if flat:
        cfg["FLAT"] = True
    return cfg


# Tile shapes from the H200 sweep (benchmarks/bench_gpu_fp8.py --sweep, docs/fp8.md); they schedule work only:
# every shape gave the same bits as every other (checked in the sweep and in tests/test_gpu_fp8.py).
FP8_TILE_TABLE: dict[tuple[int, int], dict] = {
    (4096, 4096): _fp8_cfg(128, 64, 4, 4, 3),
    (6144, 4096): _fp8_cfg(128, 64, 4, 4, 3),
}
FP8_DEFAULT_TILE = _fp8_cfg(64, 128, 4, 4, 2)
# M-independent overrides from an H200 run of benchmarks/sweep_gpu_gemm.py (its fp8_tables.py); empty = the above.
try:
    from .gemm_tables import FP8_TILE_OVERRIDES as _FP8_OVERRIDES
except ImportError:  # pragma: no cover
    _FP8_OVERRIDES = {}
FP8_TILE_TABLE.update(_FP8_OVERRIDES)


def fp8_config(n: int, k: int) -> dict:
    """Tile / split config: a function of (N, K) only, never of M.  The split count (the only part that enters the
    arithmetic besides BLOCK_K = 128) fills ~132 SMs with 128-wide N bands, whatever tile shape is used."""
    groups = triton.cdiv(k, GROUP)
    n_bands = triton.cdiv(n, 128)
    splits = max(1, min(8, 132 // max(n_bands, 1), groups // 4))
    return {**FP8_TILE_TABLE.get((n, k), FP8_DEFAULT_TILE), "SPLIT_GROUPS": triton.cdiv(groups, splits)}


# ---------------------------------------------------------------------------------------------- activation quantizer
@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(X, Q, S, M, K, stride_xm, stride_qm, stride_sm,
                      BR: tl.constexpr, BK: tl.constexpr, MAXV: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    cols = g * BK + tl.arange(0, BK)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.math.div_rn(amax, tl.full([BR], MAXV, tl.float32))
    s = tl.where((s == 0.0) | (amax == 0.0), 1.0, s)
    y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], (BR, BK)))
    y = tl.minimum(tl.maximum(y, -MAXV), MAXV)
    tl.store(Q + r64[:, None] * stride_qm + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r64 * stride_sm + g, s, mask=rmask)


_QUANT_BACKEND = os.environ.get("MC_FP8_QUANT", "triton")  # "triton" | "torch" (same bits; see tests)


def quantize_activations(x2d: torch.Tensor, a_fmt: QuantFormat = E4M3_ACT_1x128, backend: str | None = None):
    """``(xq [M, K] e4m3, xs [M, ceil(K/128)] fp32)``: per-token 1x128 dynamic quantization (contract step 1)."""
    backend = backend or _QUANT_BACKEND
    if backend == "torch" or a_fmt.scale_format != "fp32":
        q, s = quantize(x2d, a_fmt)
        return q, s.contiguous()
    m, k = x2d.shape
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    g = triton.cdiv(k, GROUP)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2d.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x2d.device)
    if m and k:
        br = 16
        _act_quant_kernel[(triton.cdiv(m, br), g)](x2d, q, s, m, k, x2d.stride(0), q.stride(0), s.stride(0),
                                                   BR=br, BK=GROUP, MAXV=E4M3_MAX, num_warps=4)
    return q, s


# ---------------------------------------------------------------------------------------------- GEMM kernel
@triton.jit
def _load_group(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g, M, N, K, stride_am, stride_bn, stride_asm, stride_bsn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr, SWS: tl.constexpr = False,
                W_TMA: tl.constexpr = False, b_row0=0):
    """Group ``g``'s operand tiles and scales.  ``USE_TMA``: both operands from TMA descriptors; ``W_TMA``: only the
    weight's, from a descriptor whose row ``b_row0 + n`` is the weight's row ``n`` (a stack of experts' weights)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    k = g * BK
    if USE_TMA:
        a = a_src.load([off_m, k])
        b = b_src.load([off_n, k])
    else:
        kk = k + tl.arange(0, BK)
        a = tl.load(a_src + rm[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if W_TMA:  # rows past the weight's N (the next expert's) only reach columns that are never stored
            b = b_src.load([b_row0 + off_n, k])
        else:
            b = tl.load(b_src + rn[:, None].to(tl.int64) * stride_bn + kk[None, :],
                        mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
    sa = tl.load(as_ptr + rm.to(tl.int64) * stride_asm + g, mask=rm < M, other=0.0)
    if SWS:  # one weight scale for the whole tile (the tile lies inside one weight block of rows)
        sb = tl.load(bs_ptr + off_n.to(tl.int64) * stride_bsn + g)
    else:
        sb = tl.load(bs_ptr + rn.to(tl.int64) * stride_bsn + g, mask=rn < N, other=0.0)
    return a, b, sa, sb


@triton.jit
def _group_term(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g, acc, M, N, K, stride_am, stride_bn, stride_asm,
                stride_bsn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
                SWS: tl.constexpr, W_TMA: tl.constexpr = False, b_row0=0):
    """``fma(dot_g, sa * sb, acc)``: group ``g`` added to ``acc`` (contract steps 2-3)."""
    a, b, sa, sb = _load_group(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g, M, N, K, stride_am,
                               stride_bn, stride_asm, stride_bsn, BM, BN, BK, USE_TMA, SWS, W_TMA, b_row0)
    p = tl.dot(a, b.T)
    if SWS:
        return tl.fma(p, tl.broadcast_to((sa * sb)[:, None], (BM, BN)), acc)
    return tl.fma(p, sa[:, None] * sb[None, :], acc)


@triton.jit
def _split_acc(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g0, n_groups, M, N, K,
               stride_am, stride_bn, stride_asm, stride_bsn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr,
               SWS: tl.constexpr = False, W_TMA: tl.constexpr = False, b_row0=0):
    """float32 ``sum_g fma(dot_g, sa*sb, acc)`` over ``n_groups`` groups from group ``g0``, acc from 0, in K order."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for gi in tl.range(0, n_groups, num_stages=NUM_STAGES):
        acc = _group_term(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g0 + gi, acc, M, N, K, stride_am, stride_bn,
                          stride_asm, stride_bsn, BM, BN, BK, USE_TMA, SWS, W_TMA, b_row0)
    return acc


@triton.jit
def _serial_fp8_splits(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, M, N, K, stride_am, stride_bn, stride_asm, stride_bsn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_GROUPS: tl.constexpr,
                       SPLITS: tl.constexpr, USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, SWS: tl.constexpr,
                       FLAT: tl.constexpr = False, W_TMA: tl.constexpr = False, b_row0=0):
    """One tile's every split in one program (contract step 4): one split taken as is, else the split partials
    summed in split order from 0.  ``FLAT``: the same sums from one software-pipelined loop over all the tile's
    groups -- at a split's last group its partial is added to the total and the partial restarts from 0 -- so the
    loads stream across split boundaries instead of the pipeline draining and refilling at each (scheduling only).
    ``W_TMA`` / ``b_row0``: as :func:`_load_group`."""
    n_groups_all = tl.cdiv(K, BK)
    if SPLITS == 1:
        total = _split_acc(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, 0, n_groups_all, M, N, K,
                           stride_am, stride_bn, stride_asm, stride_bsn, BM, BN, BK, USE_TMA, NUM_STAGES, SWS,
                           W_TMA, b_row0)
    elif FLAT:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for g in tl.range(0, n_groups_all, num_stages=NUM_STAGES):
            acc = _group_term(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g, acc, M, N, K, stride_am, stride_bn,
                              stride_asm, stride_bsn, BM, BN, BK, USE_TMA, SWS, W_TMA, b_row0)
            if ((g + 1) % SPLIT_GROUPS == 0) | (g == n_groups_all - 1):
                total = total + acc
                acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.range(0, SPLITS):
            g0 = s * SPLIT_GROUPS
            acc = _split_acc(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g0, tl.minimum(SPLIT_GROUPS, n_groups_all - g0),
                             M, N, K, stride_am, stride_bn, stride_asm, stride_bsn, BM, BN, BK, USE_TMA, NUM_STAGES, SWS,
                             W_TMA, b_row0)
            total = total + acc
    return total


@triton.jit(do_not_specialize=["M", "num_progs"])
def _fp8_gemm_kernel(a_src, b_src, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr,
                     M, N, K, stride_am, stride_bn, stride_asm, stride_bsn, stride_om, num_progs,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT_GROUPS: tl.constexpr, SPLITS: tl.constexpr, PARALLEL: tl.constexpr,
                     USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
                     SWS: tl.constexpr = False, FLAT: tl.constexpr = False):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    n_groups_all = tl.cdiv(K, BK)
    num_tiles = num_m * num_n
    if PARALLEL:
        # one program per (tile, split): float32 partial to ws[split, m, n]; _reduce_splits sums them in split order
        for unit in tl.range(pid, num_tiles * SPLITS, num_progs):
            tile = unit // SPLITS
            s = unit % SPLITS
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            g0 = s * SPLIT_GROUPS
            n_groups = tl.minimum(SPLIT_GROUPS, n_groups_all - g0)
            acc = _split_acc(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, g0, n_groups, M, N, K,
                             stride_am, stride_bn, stride_asm, stride_bsn, BM, BN, BK, USE_TMA, NUM_STAGES, SWS)
            rm = off_m + tl.arange(0, BM)
            rn = off_n + tl.arange(0, BN)
            base = ws_ptr + s.to(tl.int64) * M * N
            tl.store(base + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        for tile in tl.range(pid, num_tiles, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            total = _serial_fp8_splits(a_src, b_src, as_ptr, bs_ptr, off_m, off_n, M, N, K, stride_am, stride_bn,
                                       stride_asm, stride_bsn, BM, BN, BK, SPLIT_GROUPS, SPLITS, USE_TMA, NUM_STAGES, SWS,
                                       FLAT)
            _epilogue(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)


@triton.jit(do_not_specialize=["MN"])
def _reduce_splits(ws_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = round(((0 + p_0) + p_1) + ... + bias)`` elementwise over the split partials, in split order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        total = total + tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


_FORCE_PATH = os.environ.get("MC_FP8_GEMM_PATH", "")  # "", "serial", "parallel" (numerics-neutral)
GLUON_FP8_MIN_M = 256  # the Gluon GEMM from here (gluon_fp8_schedule: which schedule by the splits)


def gluon_fp8_schedule(n: int, k: int) -> str:
    """The Gluon GEMM's schedule (:data:`.gluon_fp8_gemm.SCHEDULES`) for the (N, K) table's split count: ``ws regs``
    up to two splits (session 23, 8B qkv / gate/up: 0.80-0.97 of ``_scaled_mm`` at M = 256-4096, the best Triton tile
    0.69-0.81), ``ws smem sums`` beyond, where the register split sums spill (session 24, 4096 x 4096, four splits:
    0.77 / 0.80 / 0.91 at M = 256 / 1024 / 4096 against ``ws regs`` 0.35-0.36 and the Triton tile 0.61-0.70; the 8B
    down projection's four splits: the same bits, not yet timed)."""
    return "ws regs" if triton.cdiv(k // GROUP, fp8_config(n, k)["SPLIT_GROUPS"]) <= 2 else "ws smem sums"


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype, *, path: str | None = None, use_tma: bool | None = None,
             split_groups: int | None = None, cfg: dict | None = None, w_block_rows: int = 0) -> torch.Tensor:
    """``y = sum_g fma(dot(xq_g, wq_g), xs_g * ws_g)`` (contract steps 2-5).  ``split_groups`` overrides the
    (N, K) table — for tests only (a split that depends on M breaks batch invariance).  ``w_block_rows``: the row
    scales ``ws`` are constant over aligned runs of that many rows (``kernels.fp8.constant_row_block`` of the
    weight's quantized parts, not the format's block alone; 0 = unknown) — lets a ``SWS`` config load one scale per
    tile."""
    m, k = xq.shape
    n = wq.shape[0]
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_gemm: operands must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}")
    g_all = triton.cdiv(k, GROUP)
    if tuple(xs.shape) != (m, g_all) or tuple(ws.shape) != (n, g_all):
        raise ValueError(f"fp8_gemm: scales {tuple(xs.shape)} / {tuple(ws.shape)} do not match "
                         f"[{m}, {g_all}] / [{n}, {g_all}]")
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    wq = wq if wq.stride(-1) == 1 else wq.contiguous()
    xs = xs.to(torch.float32)
    ws = ws.to(torch.float32)
    out, done = gemm_output(m, n, k, bias, out_dtype, xq.device)
    if done:
        return out
    cfg = {**fp8_config(n, k), **(cfg or {})}
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if bk != GROUP:
        raise ValueError(f"fp8_gemm: BLOCK_K must be the scale group {GROUP}, got {bk}")
    split_groups = min(split_groups or cfg["SPLIT_GROUPS"], g_all)
    splits = triton.cdiv(g_all, split_groups)
    num_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = num_sms(device_index(xq)) if xq.device.type == "cuda" else 4  # CPU: TRITON_INTERPRET=1 tests
    path = path or _FORCE_PATH or ("parallel" if splits > 1 and num_tiles < sms else "serial")
    parallel = path == "parallel" and splits > 1
    if use_tma is None:
        use_tma = xq.device.type == "cuda" and tma_ok(xq) and tma_ok(wq)
    sws = bool(cfg.get("SWS", False)) and w_block_rows > 0 and w_block_rows % bn == 0
    a_src, b_src = tma_sources(xq, wq, bm, bn, bk, use_tma)
    if parallel:
        wsp = torch.empty(splits * m * n, dtype=torch.float32, device=xq.device)
        units = num_tiles * splits
    else:
        wsp = out  # unused
        units = num_tiles
    grid = min(sms * cfg["P"], units)  # P programs per SM: overlap one program's scale epilogue with another's MMAs
    _fp8_gemm_kernel[(grid,)](
        a_src, b_src, xs, ws, bias if bias is not None else out, out, wsp,
        m, n, k, xq.stride(0), wq.stride(0), xs.stride(0), ws.stride(0), out.stride(0), grid,
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg["G"], SPLIT_GROUPS=split_groups, SPLITS=splits, PARALLEL=parallel,
        USE_TMA=use_tma, HAS_BIAS=bias is not None, NUM_STAGES=cfg["S"], SWS=sws, FLAT=bool(cfg.get("FLAT", False)),
        num_warps=cfg["W"],
        num_stages=cfg["S"],
    )
    if parallel:
        block = 1024
        _reduce_splits[(triton.cdiv(m * n, block),)](wsp, bias if bias is not None else out, out, m * n, n,
                                                      SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def gluon_fp8_applies(m: int, n: int, k: int, out_dtype: torch.dtype, w_block_rows: int) -> bool:
    """Whether the Gluon GEMM (:mod:`.gluon_fp8_gemm`, in :func:`gluon_fp8_schedule`'s schedule; ``MC_GLUON``, default
    on) takes a call of these sizes (the caller checks the device and the operands' alignment): M >= GLUON_FP8_MIN_M, whole
    128-column groups, one weight scale per 128-row tile (``w_block_rows``; per-column scales spill there: 0.2 of
    ``_scaled_mm``); the same contract, the same bits (module docstrings)."""
    if not GLUON or m < GLUON_FP8_MIN_M or k % GROUP or n % 8 or out_dtype not in (torch.bfloat16, torch.float32):
        return False
    return w_block_rows > 0 and w_block_rows % 128 == 0


def fp8_kernel_applies(w_fmt: QuantFormat, a_fmt: QuantFormat | None, w_q: torch.Tensor) -> bool:
    """Whether the FP8 GEMM serves these formats and this weight storage (else the dequantized path)."""
    return tensor_core_formats(w_fmt, a_fmt) and w_q.dtype == torch.float8_e4m3fn


@register("fp8_linear", "cuda")
def _fp8_linear_cuda(x2d: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                     a_fmt: QuantFormat | None = E4M3_ACT_1x128, w_block_rows: int = 0) -> torch.Tensor:
    """E4M3 weights with 128-wide blocks and 1x128 E4M3 activations: the FP8 GEMM above.  Any other format the
    quantizer accepts (weight-only ``a_fmt=None``, other group sizes, other codecs): the CPU path's arithmetic —
    float32 dequantized operands (per row) — through the batch-invariant Triton ``linear``.  ``w_block_rows``: the
    caller's statement of the row scales' constant runs (``kernels.fp8.constant_row_block``; 0 = unknown), never the
    format's block alone: a fused weight's parts are quantized one by one."""
    if not fp8_kernel_applies(w_fmt, a_fmt, w_q):
        xd, wd = _dequantized_operands(x2d, w_q, w_row_scales, w_fmt, a_fmt)
        return implementation("linear", x2d.device)(xd, wd, bias, out_dtype)
    xq, xs = quantize_activations(x2d, a_fmt)
    return _quantized_gemm(xq, xs, w_q, w_row_scales, bias, out_dtype, w_block_rows)


def _quantized_gemm(xq, xs, w_q, w_row_scales, bias, out_dtype, w_block_rows):
    """Contract steps 2-5 on quantized activations: the Gluon GEMM where it applies, else :func:`fp8_gemm` (same bits)."""
    m, n, k = xq.shape[0], w_q.shape[0], xq.shape[1]
    if gluon_fp8_applies(m, n, k, out_dtype, w_block_rows) and on_hopper(xq) and tma_ok(xq) and tma_ok(w_q):
        from .gluon_fp8_gemm import gluon_fp8_gemm

        return gluon_fp8_gemm(xq, xs.to(torch.float32), w_q, w_row_scales.to(torch.float32), bias, out_dtype,
                              fp8_config(n, k)["SPLIT_GROUPS"], w_block_rows, gluon_fp8_schedule(n, k))
    return fp8_gemm(xq, xs, w_q, w_row_scales, bias, out_dtype, w_block_rows=w_block_rows)


@register("fp8_linear_segment_tree", "cuda")
def _fp8_linear_segment_tree_cuda(x2d: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, segments: int,
                                  bias: torch.Tensor | None, out_dtype: torch.dtype, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                                  a_fmt: QuantFormat | None = E4M3_ACT_1x128, w_block_rows: int = 0) -> torch.Tensor:
    """The row-parallel FP8 linear (``kernels.fp8`` module doc) by construction: the activations quantized once (per
    token, 128-wide groups from column 0), then per K segment of whole groups one FP8 GEMM (:func:`_quantized_gemm`,
    contract steps 2-4, float32 out, no bias) on the segment's columns and scale groups -- the bits of
    ``fp8_linear`` on that K slice -- the S partials by ``adjacent_tree_sum``, bias, one rounding.  Formats the GEMM
    does not serve, or segments that are not whole groups (tiny models at TP = 1): the dequantized operands through
    the CUDA ``linear_segment_tree`` (the CPU path's arithmetic)."""
    if segments == 1:  # one segment over K: the FP8 linear itself (its bias and rounding in the epilogue), one launch
        return _fp8_linear_cuda(x2d, w_q, w_row_scales, bias, out_dtype, w_fmt, a_fmt, w_block_rows)
    k = w_q.shape[1]
    seg = k // segments
    if not fp8_kernel_applies(w_fmt, a_fmt, w_q) or seg % GROUP:
        xd, wd = _dequantized_operands(x2d, w_q, w_row_scales, w_fmt, a_fmt)
        return implementation("linear_segment_tree", x2d.device)(xd, wd, segments, bias, out_dtype)
    xq, xs = quantize_activations(x2d, a_fmt)
    g = seg // GROUP
    # the operands' K slices as strided views (the GEMMs take a row stride; a slice of whole 128-wide groups keeps
    # TMA's 16-byte alignment): no copy of the weight per call; the small scale slices are made contiguous
    partials = torch.stack([
        _quantized_gemm(xq[:, s * seg:(s + 1) * seg], xs[:, s * g:(s + 1) * g].contiguous(),
                        w_q[:, s * seg:(s + 1) * seg], w_row_scales[:, s * g:(s + 1) * g].contiguous(),
                        None, torch.float32, w_block_rows)
        for s in range(segments)])
    total = adjacent_tree_sum(partials, dim=0)
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(out_dtype)
