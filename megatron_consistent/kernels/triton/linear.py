"""Batch-invariant persistent GEMM ``y = x @ w.T + b`` for CUDA (Triton).

GPU numerics contract (one output element ``y[m, n]``):

* the K axis is cut into ``BLOCK_K`` steps and the steps into fixed *splits* of
  ``SPLIT_STEPS`` steps each; ``BLOCK_K`` and the split are looked up from a
  table keyed by ``(N, K, dtype)`` — never by M.  The tile shape is too, except
  in the M-class table (``gemm_tables.py``, filled from an H200 sweep that
  checked the bits; empty by default), where only the tile / schedule follows M;
* inside a split the tensor cores accumulate the steps in increasing K order
  into a float32 accumulator that starts at 0 (``tl.dot`` chaining);
* the split partials are summed in increasing split order in float32 starting
  from 0 (``((0 + p0) + p1) + ...``; with one split the accumulator is taken
  as is);
* the bias (float32) is added last, then one rounding to ``out_dtype``.

How the work is *scheduled* may depend on M, because it does not change a
single bit: when the (M, N) tiles are too few to fill the GPU, each split of a
tile runs in its own program, writes its float32 partial to a workspace, and
the last program to finish the tile (an atomic counter) sums the partials in
split order; otherwise one program walks all splits of a tile and keeps the
running sum in registers.  Both paths execute the same per-element arithmetic.
Programs are persistent (grid = number of SMs at most) and walk tiles in a
grouped order for L2 reuse.  Two more schedules, selected per config:
*swap-AB* (``SWAP``) computes the transposed tile ``w_tile @ x_tile.T`` so the
weight rows fill the MMA's M side when M is small (each element: the same
products, the same K order); *spill* (``SPILL``) lets one program walk the
splits of a big tile by writing each split's partial to a per-program float32
slot (L2) and summing the slot in split order, instead of holding a second
register accumulator.  Whether a swapped tile, or a tile small enough to use
``mma.sync`` instead of ``wgmma``, really gives the bits of the others is a
hardware question: benchmarks/sweep_gpu_gemm.py checks it per candidate and
tests/test_gpu_kernels.py checks every adopted table entry.

The atomic counters live in one buffer per device that each tile resets to 0
when it finishes, so two GEMMs must not run concurrently on different streams
of one device with the split-parallel path (CUDA graphs on one stream are fine).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import register
from ._common import device_index, gemm_output, num_sms, tile_coords, tma_ok, tma_sources


# ----------------------------------------------------------------------------------------------
# Config table: (N, K, dtype) -> tile / split config.  Never keyed by M.
# BM, BN, BK: tile; SPLIT_STEPS: BLOCK_K steps per split; W: num_warps; S: num_stages; G: GROUP_M
# ----------------------------------------------------------------------------------------------

def _cfg(bm, bn, bk, split_steps, warps, stages, group=8, swap=False, spill=False, path=""):
    """BM x BN output tile (BM rows of x, BN rows of w), BLOCK_K, split.  ``swap``: swap-AB (the MMA computes the
    ``[BN, BM]`` tile of ``y.T = w @ x.T``, so the weight rows fill the MMA's M side; for skinny M).  ``spill``:
    serial splits write each split's partial to a per-program float32 slot in global memory (L2) and sum them
    there in split order, instead of holding a second register accumulator (lets 128x256 tiles use a split).
    ``path``: "" (auto) / "serial" / "parallel".  None of
    the three changes the arithmetic of an element; ``BK`` and ``SPLIT_STEPS`` are the numerics."""
    cfg = {"BM": bm, "BN": bn, "BK": bk, "SPLIT_STEPS": split_steps, "W": warps, "S": stages, "G": group}
    if swap:
        cfg["SWAP"] = True
    if spill:
        cfg["SPILL"] = True
    if path:
        cfg["PATH"] = path
    return cfg


_BF16 = torch.bfloat16
_NOSPLIT = 1 << 20

# Default table (the rule): ONE tile config per (N, K, dtype), whatever M is.
# Picked from the offline sweep on an H200 (benchmarks/results/, docs/benchmarks.md).
CONFIG_TABLE: dict[tuple[int, int, torch.dtype], dict] = {
    (4096, 4096, _BF16): _cfg(128, 128, 128, 16, 8, 3),  # 2 splits of 2048
    (6144, 4096, _BF16): _cfg(128, 128, 64, 32, 8, 4),  # 2 splits of 2048
    (28672, 4096, _BF16): _cfg(128, 256, 64, _NOSPLIT, 8, 3),  # 224 N tiles: no split needed
    (14336, 4096, _BF16): _cfg(128, 256, 64, _NOSPLIT, 8, 3),
    (4096, 14336, _BF16): _cfg(128, 128, 64, 56, 8, 4),  # 4 splits of 3584
    # row-parallel K segments (issue #18): the segment's own (N, K / 8) config; the 8 segments already give the
    # parallelism a split would, so no split inside a segment (Llama-3-8B o_proj / down, Llama-3.2-1B o_proj / down)
    (4096, 512, _BF16): _cfg(128, 128, 64, _NOSPLIT, 8, 4),
    (4096, 1792, _BF16): _cfg(128, 128, 64, _NOSPLIT, 8, 4),
    (2048, 256, _BF16): _cfg(128, 128, 64, _NOSPLIT, 8, 4),
    (2048, 1024, _BF16): _cfg(128, 128, 64, _NOSPLIT, 8, 4),
}

# Opt-in table (MC_GEMM_TILES_BY_M=1): the numerics (BLOCK_K, split) are still fixed per
# (N, K, dtype), but the tile *shape* is picked by an M class.  A tile shape does not
# enter a single element's arithmetic (each element is the same chain of 16-wide tensor
# core steps), which tests/test_gpu_kernels.py checks bitwise across all classes; this
# departs from the literal rule and is therefore off by default.
# entry: (BK, SPLIT_STEPS, [(max_M, BM, BN, warps, stages), ...] with max_M None = the rest)
TILES_BY_M_TABLE: dict[tuple[int, int, torch.dtype], tuple] = {
    (4096, 4096, _BF16): (64, _NOSPLIT, [(64, 64, 64, 4, 8), (256, 64, 128, 4, 6), (None, 128, 256, 8, 3)]),
    (6144, 4096, _BF16): (64, _NOSPLIT, [(16, 64, 128, 4, 6), (64, 64, 64, 4, 8), (256, 64, 128, 4, 6),
                                         (None, 128, 256, 8, 3)]),
    (28672, 4096, _BF16): (64, _NOSPLIT, [(64, 64, 128, 4, 6), (None, 128, 256, 8, 3)]),
}
TILES_BY_M = os.environ.get("MC_GEMM_TILES_BY_M", "") == "1"

# M-class table (issue #15): written by benchmarks/sweep_gpu_gemm.py into gemm_tables.py from an H200 run, only
# with configs whose rows were bit-identical across all M classes in that run.  Empty = today's behaviour.
# MC_GEMM_M_CLASSES=0 switches it off (back to CONFIG_TABLE).
try:
    from .gemm_tables import GEMM_M_CLASS_TABLE as _M_CLASS_TABLE
except ImportError:  # pragma: no cover
    _M_CLASS_TABLE = {}
M_CLASS_TABLE: dict[tuple[int, int, torch.dtype], dict] = dict(_M_CLASS_TABLE)
M_CLASSES = os.environ.get("MC_GEMM_M_CLASSES", "1") != "0"


def m_class_config(entry: dict, m: int | None) -> dict:
    """The tile config of an M-class table entry ``{"BK", "SPLIT_STEPS", "classes": [(max_m, tile), ...]}`` for M;
    ``tile`` = ``{"BM", "BN", "W", "S"[, "G", "SWAP", "SPILL", "PATH"]}``; max_m None = the rest.  BK and the split
    come from the entry, never from the class."""
    for max_m, tile in entry["classes"]:
        if max_m is None or (m is not None and m <= max_m):
            return {"G": 8, **tile, "BK": entry["BK"], "SPLIT_STEPS": entry["SPLIT_STEPS"]}
    raise ValueError("M-class table entry without a final (None, tile) class")


def default_config(n: int, k: int, dtype: torch.dtype) -> dict:
    """Config for shapes not in the table: a function of (N, K, dtype) only."""
    bk = 64 if dtype in (torch.bfloat16, torch.float16) else 32
    bm, bn = 128, 128
    k_steps = triton.cdiv(k, bk)
    n_tiles = triton.cdiv(n, bn)
    # splits so that one 128-row tile band fills about 128 SMs; a function of (N, K) only
    splits = max(1, min(8, 128 // max(n_tiles, 1), k_steps // 8 if k_steps >= 16 else 1))
    split_steps = triton.cdiv(k_steps, splits)
    return _cfg(bm, bn, bk, split_steps, 8, 4 if dtype != torch.float32 else 3)


def config_for(n: int, k: int, dtype: torch.dtype, m: int | None = None, tiles_by_m: bool | None = None) -> dict:
    # the M-class table serves the dense GEMM (tiles_by_m None); an explicit tiles_by_m=False (the MoE grouped GEMM,
    # one config for every M) keeps CONFIG_TABLE
    if M_CLASSES and tiles_by_m is None and (n, k, dtype) in M_CLASS_TABLE:
        return m_class_config(M_CLASS_TABLE[(n, k, dtype)], m)
    tiles_by_m = TILES_BY_M if tiles_by_m is None else tiles_by_m
    if tiles_by_m and (n, k, dtype) in TILES_BY_M_TABLE:
        bk, sps, classes = TILES_BY_M_TABLE[(n, k, dtype)]
        for max_m, bm, bn, w, st in classes:
            if max_m is None or (m is not None and m <= max_m):
                return _cfg(bm, bn, bk, sps, w, st)
    cfg = CONFIG_TABLE.get((n, k, dtype))
    return dict(cfg) if cfg is not None else default_config(n, k, dtype)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k_base, k, M, N, K, stride_am, stride_bn, acc,
            USE_TMA: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """One BLOCK_K step at column ``k`` of the K slice from ``k_base``: ``acc + a . b`` on the tensor cores
    (``rm`` / ``rn``: the tile's x / w rows; pointer loads read columns past ``K`` as 0)."""
    if USE_TMA:
        a = a_src.load([off_m, k_base + k])
        b = b_src.load([off_n, k_base + k])
    else:
        kk = k + rk
        a = tl.load(a_src + rm[:, None].to(tl.int64) * stride_am + (k_base + kk)[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_src + rn[:, None].to(tl.int64) * stride_bn + (k_base + kk)[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
    if SWAP:
        acc = tl.dot(b, a.T, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _split_acc(a_src, b_src, off_m, off_n, k_step0, n_steps, M, N, K, stride_am, stride_bn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
               NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr = False, k_base=0):
    """float32 sum over ``n_steps`` BLOCK_K steps starting at step ``k_step0``, from 0, in K order.

    ``k_base``: the K slice ``[k_base, k_base + K)`` of the operands is the reduction axis (a row-parallel segment,
    ``segment_tree.py``); columns past ``K`` inside it are zeros (pointer loads; TMA only when ``K`` is a multiple
    of ``BK``, so a box never reads the next slice).

    ``[BM, BN]`` (x rows, w rows); with ``SWAP`` the transposed tile ``[BN, BM]`` = ``w_tile @ x_tile.T`` — each
    element the same products summed in the same K order, only the operands' roles in the MMA swapped."""
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    rk = tl.arange(0, BK)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    for ki in tl.range(0, n_steps, num_stages=NUM_STAGES):
        acc = _k_step(a_src, b_src, off_m, off_n, rm, rn, rk, k_base, (k_step0 + ki) * BK, M, N, K, stride_am,
                      stride_bn, acc, USE_TMA, PRECISION, SWAP)
    return acc


@triton.jit
def _tile_offsets(R0: tl.constexpr, R1: tl.constexpr):
    """Row-major offsets of an ``[R0, R1]`` block (a tile-shaped float32 workspace slot)."""
    return tl.arange(0, R0)[:, None] * R1 + tl.arange(0, R1)[None, :]


@triton.jit
def _serial_splits(a_src, b_src, off_m, off_n, k_steps, M, N, K, stride_am, stride_bn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_STEPS: tl.constexpr,
                   SPLITS: tl.constexpr, USE_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr,
                   SWAP: tl.constexpr = False, k_base=0):
    """One tile's float32 total, all splits in one program: the split partials summed in split order from 0
    (one split: taken as is); ``k_base``: as :func:`_split_acc`."""
    if SPLITS == 1:
        total = _split_acc(a_src, b_src, off_m, off_n, 0, k_steps, M, N, K, stride_am, stride_bn,
                           BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP, k_base)
    else:
        if SWAP:
            total = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.range(0, SPLITS):
            k0 = s * SPLIT_STEPS
            n_steps = tl.minimum(SPLIT_STEPS, k_steps - k0)
            acc = _split_acc(a_src, b_src, off_m, off_n, k0, n_steps, M, N, K, stride_am, stride_bn,
                             BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP, k_base)
            total = total + acc
    return total


@triton.jit
def _epilogue(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
              BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Bias add and the one rounding; row offsets in int64 (an LM head's M x N passes 2**31)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        total = total + bias[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`_epilogue` for a swap-AB tile ``total [BN, BM]`` (element ``[i, j]`` = ``y[off_m + j, off_n + i]``)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        total = total + bias[:, None]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_slot_epilogue(slot, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                          BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SWAP: tl.constexpr, CH: tl.constexpr):
    """``((0 + p0) + p1) + ...`` over the split partials in ``slot`` (``[SPLITS, tile]`` float32), then bias and the
    rounding, ``CH`` tile rows at a time (few registers)."""
    if SWAP:
        R0: tl.constexpr = BN
        R1: tl.constexpr = BM
    else:
        R0: tl.constexpr = BM
        R1: tl.constexpr = BN
    offs = _tile_offsets(CH, R1)
    for c in tl.static_range(R0 // CH):
        total = tl.zeros((CH, R1), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total = total + tl.load(slot + s * (BM * BN) + c * (CH * R1) + offs)
        if SWAP:
            _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n + c * CH, M, N, stride_om, BM, CH, HAS_BIAS)
        else:
            _epilogue(total, bias_ptr, out_ptr, off_m + c * CH, off_n, M, N, stride_om, CH, BN, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "num_progs"])
def _gemm_kernel(a_src, b_src, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                 M, N, K, stride_am, stride_bn, stride_om, num_progs,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT_STEPS: tl.constexpr, SPLITS: tl.constexpr, PARALLEL: tl.constexpr,
                 USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
                 PRECISION: tl.constexpr, SWAP: tl.constexpr = False, SPILL: tl.constexpr = False,
                 SPILL_ROWS: tl.constexpr = 32):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    num_tiles = num_m * num_n
    if PARALLEL:
        # one program per (tile, split); the last one of a tile sums the partials in split order
        if SWAP:
            offs = _tile_offsets(BN, BM)
        else:
            offs = _tile_offsets(BM, BN)
        for unit in tl.range(pid, num_tiles * SPLITS, num_progs):
            tile = unit // SPLITS
            s = unit % SPLITS
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            k0 = s * SPLIT_STEPS
            n_steps = tl.minimum(SPLIT_STEPS, k_steps - k0)
            acc = _split_acc(a_src, b_src, off_m, off_n, k0, n_steps, M, N, K, stride_am, stride_bn,
                             BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP)
            ws_tile = ws_ptr + tile.to(tl.int64) * (SPLITS * BM * BN)
            if SWAP:
                pmask = (off_m + tl.arange(0, BM)[None, :]) < M
            else:
                pmask = (off_m + tl.arange(0, BM)[:, None]) < M
            tl.store(ws_tile + s * (BM * BN) + offs, acc, mask=pmask)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLITS - 1:
                total = tl.zeros_like(acc)
                for s2 in tl.static_range(SPLITS):
                    part = tl.load(ws_tile + s2 * (BM * BN) + offs, mask=pmask, other=0.0, cache_modifier=".cg")
                    total = total + part
                if SWAP:
                    _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)
                else:
                    _epilogue(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        scratch = ws_ptr + pid.to(tl.int64) * (SPLITS * BM * BN)  # SPILL only: this program's slot
        if SWAP:
            offs = _tile_offsets(BN, BM)
        else:
            offs = _tile_offsets(BM, BN)
        for tile in tl.range(pid, num_tiles, num_progs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            if SPILL and SPLITS > 1:
                # each split's partial goes to this program's slot (no second register accumulator), then the
                # partials are summed in split order and written out in row chunks
                for s in tl.range(0, SPLITS):
                    k0 = s * SPLIT_STEPS
                    n_steps = tl.minimum(SPLIT_STEPS, k_steps - k0)
                    acc = _split_acc(a_src, b_src, off_m, off_n, k0, n_steps, M, N, K, stride_am, stride_bn,
                                     BM, BN, BK, USE_TMA, NUM_STAGES, PRECISION, SWAP)
                    tl.store(scratch + s * (BM * BN) + offs, acc)
                tl.debug_barrier()
                _reduce_slot_epilogue(scratch, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om,
                                      BM, BN, SPLITS, HAS_BIAS, SWAP, SPILL_ROWS)
                tl.debug_barrier()  # the slot is rewritten by this program's next tile
            else:
                total = _serial_splits(a_src, b_src, off_m, off_n, k_steps, M, N, K, stride_am, stride_bn,
                                       BM, BN, BK, SPLIT_STEPS, SPLITS, USE_TMA, NUM_STAGES, PRECISION, SWAP)
                if SWAP:
                    _epilogue_t(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)
                else:
                    _epilogue(total, bias_ptr, out_ptr, off_m, off_n, M, N, stride_om, BM, BN, HAS_BIAS)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

# Per device: the tile counters of the parallel paths (each tile's last program resets its counter to 0).  A larger
# call gets a larger buffer, and the smaller ones stay alive: a CUDA graph captured with an earlier buffer keeps
# replaying into it, so it must never be freed and handed to another tensor.
_COUNTERS: dict[int, list[torch.Tensor]] = {}


_INTERPRETER_SMS = 4  # grid cap for CPU tensors (TRITON_INTERPRET=1 tests of the indexing / split logic)


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    if dev.type != "cuda":
        return torch.zeros(max(n, 16), dtype=torch.int32, device=dev)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    bufs = _COUNTERS.setdefault(idx, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=dev))
    return bufs[-1]


# scheduling knobs (numerics-neutral); overridable for experiments
_FORCE_PATH = os.environ.get("MC_GEMM_PATH", "")  # "", "serial", "parallel"
_FORCE_NO_TMA = os.environ.get("MC_GEMM_NO_TMA", "") == "1"


def gemm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
         cfg: dict | None = None, path: str | None = None, use_tma: bool | None = None,
         tiles_by_m: bool | None = None) -> torch.Tensor:
    m, k = x2d.shape
    n = weight.shape[0]
    if x2d.dtype != weight.dtype:
        raise TypeError(f"linear: input dtype {x2d.dtype} != weight dtype {weight.dtype}")
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out, done = gemm_output(m, n, k, bias, out_dtype, x2d.device)
    if done:
        return out
    cfg = cfg or config_for(n, k, weight.dtype, m, tiles_by_m)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    swap, spill = bool(cfg.get("SWAP", False)), bool(cfg.get("SPILL", False))
    k_steps = triton.cdiv(k, bk)
    split_steps = min(cfg["SPLIT_STEPS"], k_steps)
    splits = triton.cdiv(k_steps, split_steps)
    num_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    on_gpu = x2d.device.type == "cuda"
    sms = num_sms(device_index(x2d)) if on_gpu else _INTERPRETER_SMS
    path = path or _FORCE_PATH or cfg.get("PATH") or ("parallel" if splits > 1 and num_tiles * 3 <= sms else "serial")
    parallel = path == "parallel" and splits > 1
    if use_tma is None:
        use_tma = on_gpu and not _FORCE_NO_TMA and tma_ok(x2d) and tma_ok(weight)
    a_src, b_src = tma_sources(x2d, weight, bm, bn, bk, use_tma)
    if parallel:
        ws = torch.empty(num_tiles * splits * bm * bn, dtype=torch.float32, device=x2d.device)
        cnt = _counters(x2d.device, num_tiles)
        units = num_tiles * splits
    else:
        units = num_tiles
        cnt = out  # unused
        # SPILL: one tile-sized float32 slot per program for the running split sum
        ws = (torch.empty(min(sms, units) * splits * bm * bn, dtype=torch.float32, device=x2d.device)
              if spill and splits > 1 else out)
    grid = min(sms, units)
    _gemm_kernel[(grid,)](
        a_src, b_src, bias if bias is not None else out, out, ws, cnt,
        m, n, k, x2d.stride(0), weight.stride(0), out.stride(0), grid,
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg["G"], SPLIT_STEPS=split_steps, SPLITS=splits,
        PARALLEL=parallel, USE_TMA=use_tma, HAS_BIAS=bias is not None, NUM_STAGES=cfg["S"],
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", SWAP=swap, SPILL=spill and splits > 1,
        SPILL_ROWS=min(32, bn if swap else bm),
        num_warps=cfg["W"], num_stages=cfg["S"],
    )
    return out


@register("linear", "cuda")
def _linear_cuda(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return gemm(x2d, weight, bias, out_dtype)


