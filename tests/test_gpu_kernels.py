"""GPU (Triton) kernels: batch invariance, chunking/decode invariance, determinism, and agreement with CPU.

Skipped without CUDA.  "Bitwise" below means ``torch.equal`` on the raw outputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from _bits import bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels of issue #6)")]

if torch.cuda.is_available():
    from megatron_consistent.kernels.triton import attention as tattn
    from megatron_consistent.kernels.triton import linear as tlin
    from megatron_consistent.kernels.triton import segment_tree as tst

from megatron_consistent.kernels import attention, linear, log_softmax, rms_norm, silu_and_mul
from megatron_consistent.kernels.dispatch import implementation
from megatron_consistent.kernels.numerics import adjacent_tree_sum
from megatron_consistent.kernels.rotary import RopeConfig, apply_rope

CPU = torch.device("cpu")
DEV = torch.device("cuda")




# --------------------------------------------------------------------------------------- GEMM

GEMM_SHAPES = [(4096, 4096), (6144, 4096), (1000, 300), (256, 1024)]


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_batch_invariant(n, k, out_dtype):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2048, k, device=DEV, dtype=torch.bfloat16)
    full = linear(x, w, b, out_dtype=out_dtype)  # serial (many tiles) path
    for sl in [slice(0, 1), slice(5, 6), slice(0, 16), slice(3, 67), slice(100, 356), slice(1000, 2048)]:
        part = linear(x[sl], w, b, out_dtype=out_dtype)
        assert bits_equal(part, full[sl]), f"rows {sl} differ from the full batch"
    # reordering rows permutes results exactly
    perm = torch.randperm(2048, device=DEV)[:300]
    assert bits_equal(linear(x[perm], w, b, out_dtype=out_dtype), full[perm])
    # repeated runs
    assert bits_equal(linear(x, w, b, out_dtype=out_dtype), full)
    ref = x.float() @ w.float().T + b.float()
    err = (full.float() - ref).abs().max().item()
    tol = 1e-3 if out_dtype == torch.float32 else 4e-2 * ref.abs().max().item()
    assert err <= tol, err


def test_gemm_output_past_int32_offsets():
    """An LM-head-sized call (M x N > 2**31 elements): the last rows equal the same rows computed alone.

    With 32-bit row offsets the addresses of rows past 2**31 / N wrap and those rows come out wrong."""
    torch.manual_seed(0)
    m, n, k = 14336, 152064, 64  # 2.18e9 outputs, fp32 logits (8.7 GB)
    assert m * n > 2**31
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    full = linear(x, w, out_dtype=torch.float32)
    for sl in [slice(m - 3, m), slice(m // 2, m // 2 + 2), slice(0, 2)]:
        assert bits_equal(linear(x[sl], w, out_dtype=torch.float32), full[sl]), f"rows {sl}"
    del full


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 300)])
@pytest.mark.parametrize("m", [1, 16, 100, 700])
def test_gemm_schedules_and_loads_bitwise_equal(n, k, m):
    """Split-parallel vs split-serial scheduling and TMA vs pointer loads give the same bits."""
    torch.manual_seed(1)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    outs = []
    for path in ("serial", "parallel"):
        for tma in (True, False):
            if tma and not (tlin.tma_ok(x) and tlin.tma_ok(w)):
                continue
            outs.append(tlin.gemm(x, w, None, torch.float32, path=path, use_tma=tma))
    for o in outs[1:]:
        assert bits_equal(o, outs[0])


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (28672, 4096)])
def test_gemm_tiles_by_m_bitwise_equal_across_classes(n, k):
    """Opt-in table: every M-class tile shape gives the bits of the large-M tile (same BLOCK_K/split)."""
    bk, sps, classes = tlin.TILES_BY_M_TABLE[(n, k, torch.bfloat16)]
    torch.manual_seed(3)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    x = torch.randn(1024, k, device=DEV, dtype=torch.bfloat16)
    full = tlin.gemm(x, w, None, torch.float32, tiles_by_m=True)  # large-M class
    for m in (1, 16, 64, 200, 256):
        assert bits_equal(tlin.gemm(x[:m], w, None, torch.float32, tiles_by_m=True), full[:m]), m
    for _, bm, bn, wp, st in classes:
        cfg = tlin._cfg(bm, bn, bk, sps, wp, st)
        assert bits_equal(tlin.gemm(x[:300], w, None, torch.float32, cfg=cfg), full[:300]), (bm, bn)
        assert bits_equal(tlin.gemm(x[:300], w, None, torch.float32, cfg=cfg, use_tma=False), full[:300]), (bm, bn)


def _rows_identical_across_m(run, x, ms=(1, 7, 16, 64, 300, 2048)):
    """``run(rows) -> y``: the first m rows for every m in ``ms``, a row alone in the middle and a permutation give
    the bits of the full batch (``x`` has >= 2048 rows).  Returns the failing cases (empty = invariant)."""
    full = run(x)
    bad = [m for m in ms if not bits_equal(run(x[:m]), full[:m])]
    if not bits_equal(run(x[1000:1001]), full[1000:1001]):
        bad.append("row1000")
    perm = torch.randperm(x.shape[0], device=x.device, generator=torch.Generator(device=x.device).manual_seed(0))[:300]
    if not bits_equal(run(x[perm]), full[perm]):
        bad.append("perm")
    return bad


# one config for every M: swap-AB (plain and split, serial / split-parallel), spilled serial splits; the tile is the
# same at every M so these check indexing, masks and the split machinery of each path on the GPU
PATH_CFGS = {
    "swap 16x64": dict(bm=16, bn=64, swap=True),
    "swap 16x64 split parallel": dict(bm=16, bn=64, swap=True, splits=2, path="parallel"),
    "swap 32x128 split serial": dict(bm=32, bn=128, swap=True, splits=2, path="serial"),
    "swap 64x128 split spill": dict(bm=64, bn=128, swap=True, splits=3, spill=True),
    "128x256 split spill": dict(bm=128, bn=256, splits=2, spill=True, warps=8, stages=3),
    "64x128 split spill": dict(bm=64, bn=128, splits=4, spill=True),
}


def _path_cfg(k, bm, bn, swap=False, splits=1, spill=False, path="", warps=4, stages=4):
    steps = -(-k // 64)
    return tlin._cfg(bm, bn, 64, -(-steps // splits) if splits > 1 else tlin._NOSPLIT, warps, stages,
                     swap=swap, spill=spill, path=path)


PATH_CASES = ([(name, 4096, 4096) for name in PATH_CFGS] + [(name, 1000, 300) for name in PATH_CFGS]
              + [("swap 64x128 split spill", 4096, 14336), ("128x256 split spill", 4096, 14336)])


@pytest.mark.parametrize("name,n,k", PATH_CASES)
def test_gemm_new_paths_row_alone_equals_batch(name, n, k):
    cfg = _path_cfg(k, **PATH_CFGS[name])
    torch.manual_seed(5)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2048, k, device=DEV, dtype=torch.bfloat16)
    for od in (torch.float32, torch.bfloat16):
        bad = _rows_identical_across_m(lambda xx: tlin.gemm(xx, w, b, od, cfg=cfg), x)
        assert not bad, (name, od, bad)
    y = tlin.gemm(x[:300], w, b, torch.float32, cfg=cfg)
    ref = x[:300].float() @ w.float().T + b.float()
    assert (y - ref).abs().max().item() <= 1e-3 * max(1.0, k / 1024)
    # pointer loads and the other split schedule: same bits
    assert bits_equal(tlin.gemm(x[:300], w, b, torch.float32, cfg=cfg, use_tma=False), y)
    if cfg["SPLIT_STEPS"] < tlin._NOSPLIT:
        for path in ("serial", "parallel"):
            assert bits_equal(tlin.gemm(x[:300], w, b, torch.float32, cfg={**cfg, "PATH": path}), y), path


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 300)])
def test_gemm_spill_equals_register_splits(n, k):
    """SPILL (partials through an L2 slot) performs the same additions as the register split sum: same bits."""
    torch.manual_seed(6)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(700, k, device=DEV, dtype=torch.bfloat16)
    for splits in (2, 3):
        ref = tlin.gemm(x, w, None, torch.float32, cfg=_path_cfg(k, 128, 128, splits=splits, path="serial", warps=8))
        for bm, bn, wp in ((128, 128, 8), (64, 128, 4), (128, 256, 8)):
            cfg = _path_cfg(k, bm, bn, splits=splits, spill=True, path="serial", warps=wp, stages=3)
            assert bits_equal(tlin.gemm(x, w, None, torch.float32, cfg=cfg), ref), (splits, bm, bn)


def test_gemm_m_dependent_split_is_caught():
    """A split that depends on M (more splits for small M, the naive decode choice) breaks the row invariance, and
    the checker used for the M-class table and the swap-AB / spill paths sees it."""
    n, k = 4096, 4096
    torch.manual_seed(7)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    x = torch.randn(2048, k, device=DEV, dtype=torch.bfloat16)

    def broken_split(xx):
        return tlin.gemm(xx, w, None, torch.float32, cfg=_path_cfg(k, 64, 128, splits=4 if xx.shape[0] <= 64 else 1))

    assert _rows_identical_across_m(broken_split, x)
    # the same tiles with the split / BLOCK_K fixed pass
    assert not _rows_identical_across_m(
        lambda xx: tlin.gemm(xx, w, None, torch.float32, cfg=_path_cfg(k, 64, 128, splits=4)), x)


M_CLASS_ENTRIES = sorted(tlin.M_CLASS_TABLE) if torch.cuda.is_available() else []


@pytest.mark.skipif(not M_CLASS_ENTRIES, reason="M-class table empty (benchmarks/sweep_gpu_gemm.py fills it)")
@pytest.mark.parametrize("key", M_CLASS_ENTRIES, ids=lambda key: f"{key[0]}x{key[1]}")
def test_gemm_m_class_table_rows_identical_across_classes(key):
    """Every M-class entry: a row's bits are the same whichever class computed it (M = 1 .. 2048, fp32 and bf16 out,
    with bias), and each class's tile forced at 300 rows gives the same bits too."""
    n, k, dtype = key
    entry = tlin.M_CLASS_TABLE[key]
    torch.manual_seed(8)
    w = (torch.randn(n, k, device=DEV) * 0.05).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype)
    x = torch.randn(2048, k, device=DEV).to(dtype)
    for od in (torch.float32, torch.bfloat16):
        bad = _rows_identical_across_m(lambda xx: linear(xx, w, b, out_dtype=od), x,
                                       ms=(1, 2, 7, 16, 17, 63, 64, 65, 255, 256, 300, 1024, 2048))
        assert not bad, (key, od, bad)
    full = tlin.gemm(x, w, b, torch.float32)
    for max_m, _ in entry["classes"]:
        cfg = tlin.m_class_config(entry, max_m)
        assert bits_equal(tlin.gemm(x[:300], w, b, torch.float32, cfg=cfg), full[:300]), (key, max_m, cfg)


def test_gemm_vs_cpu_contract():
    torch.manual_seed(2)
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    w = torch.randn(512, 1024, dtype=torch.bfloat16) * 0.05
    b = torch.randn(512, dtype=torch.bfloat16)
    cpu = linear(x, w, b, out_dtype=torch.float32)
    gpu = linear(x.to(DEV), w.to(DEV), b.to(DEV), out_dtype=torch.float32).cpu()
    scale = (x.float().abs() @ w.float().abs().T).max().item()
    assert (cpu - gpu).abs().max().item() <= 1e-5 * scale + 1e-6


# --------------------------------------------------------------------------------------- row-parallel tree (#18)

# (N, K): Llama-3-8B o_proj / down, Llama-3.2-1B o_proj / down, an odd N with 2 splits inside a segment, tiny K (K = 64: 8-column segments, zero-
# padded inside the segment; pointer loads) and a K whose segment is not a multiple of BLOCK_K (200 / 8 = 25)
SEG_SHAPES = [(4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192), (1000, 8192), (96, 64), (136, 200)]
SEG_SCHEDULES = [("serial", None, 1), ("serial", 1, 1), ("serial", 2, 1), ("parallel", 1, 1), ("parallel", 2, 1),
                 ("flat", 1, 1), ("flat", 2, 1), ("serial", 2, 2), ("serial", 4, 2), ("parallel", 2, 2),
                 ("serial", 4, 4), ("serial", 8, 4), ("parallel", 4, 4)]


def _left_fold(parts):
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _seg_operands(n, k, rows=2048, seed=11):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, torch.bfloat16)
    b = torch.randn(n, generator=g).to(DEV, torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(DEV, torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("n,k", SEG_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("segments", [1, 2, 4, 8])
def test_segment_tree_equals_naive_loop(n, k, segments):
    """One launch = the per-segment GEMM loop (one ``gemm`` per K segment, float32) + adjacent_tree_sum, bit for bit,
    on every schedule and at M = 1 .. 1024 (each M class); the rank holds K * segments / 8 columns (TP = 8 / segments);
    partials mode (the CUDA ``linear_segments``) = the stacked loop."""
    kl = k * segments // 8
    x, w, _ = _seg_operands(n, k, rows=1024)
    x, w = x[:, :kl].contiguous(), w[:, :kl].contiguous()
    for m in (1, 16, 64, 300, 1024):
        naive = tst.linear_segments_naive(x[:m], w, segments)
        ref = adjacent_tree_sum(naive, dim=0)
        assert bits_equal(tst.segment_tree_gemm(x[:m], w, segments, partials=True), naive), m
        assert bits_equal(implementation("linear_segments", DEV)(x[:m], w, segments), naive), m
        for path, reg, lanes in SEG_SCHEDULES if m == 300 and segments in (2, 8) else [(None, None, None)]:
            y = tst.segment_tree_gemm(x[:m], w, segments, path=path, reg_segments=reg, lanes=lanes)
            assert bits_equal(y, ref), (m, path, reg, lanes)
        if m == 300:
            assert bits_equal(tst.segment_tree_gemm(x[:m], w, segments, use_tma=False), ref), "pointer loads"
            if segments == 8:  # the merge order matters: a left fold of the same partials is caught
                assert not bits_equal(_left_fold(list(naive)), ref)
            err = (ref.double() - x[:m].double() @ w.double().T).abs().max().item()
            assert err <= 1e-3 * max(1.0, kl / 1024), err


@pytest.mark.parametrize("n,k", SEG_SHAPES[:4] + SEG_SHAPES[-2:], ids=lambda v: str(v))
def test_segment_tree_batch_invariant_and_fused(n, k):
    """A row alone = the row in the batch (first m rows, row 1000 alone, a permutation) for the float32 subtree and
    the fused bf16 output; fused ``round(tree + bias)`` = the unfused torch path; the registered ops and the
    trainer's ``kernels.row_parallel_linear`` give the same bits."""
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels import row_parallel_linear as trainer_row_parallel

    x, w, b = _seg_operands(n, k)
    for od, bias in ((torch.float32, None), (torch.bfloat16, b), (torch.float32, b)):
        bad = _rows_identical_across_m(lambda xx: tst.segment_tree_gemm(xx, w, 8, bias, od), x,
                                       ms=(1, 2, 7, 16, 17, 63, 64, 65, 255, 256, 300, 1024, 2048))
        assert not bad, (od, bias is not None, bad)
    tree = adjacent_tree_sum(tst.linear_segments_naive(x[:300], w, 8), dim=0)
    assert bits_equal(tst.segment_tree_gemm(x[:300], w, 8), tree)
    unfused = (tree + b.to(torch.float32)).to(torch.bfloat16)
    for path in ("serial", "parallel", "flat"):
        assert bits_equal(tst.segment_tree_gemm(x[:300], w, 8, b, torch.bfloat16, path=path), unfused), path
    assert bits_equal(torch.ops.megatron_consistent.row_parallel_linear(x[:300], w, 8, b), unfused)
    for m in (1, 300, 2048):  # S = 1 runs the GEMM itself (every M class, the Gluon tree's M included): the tree's bits
        one = (tst.segment_tree_gemm(x[:m], w, 1) + b.to(torch.float32)).to(torch.bfloat16)
        assert bits_equal(torch.ops.megatron_consistent.row_parallel_linear(x[:m], w, 1, b), one), m
    assert bits_equal(inference_ops.linear_segment_tree(x[:300], w, 8), tree)
    with torch.no_grad():
        assert bits_equal(trainer_row_parallel(x[:300], w, 8, b), unfused)


@pytest.mark.parametrize("n,k", SEG_SHAPES, ids=lambda v: str(v))
def test_segment_tree_tensor_parallel_split_equals_tp1(n, k):
    """TP = t: each rank's one-launch subtree over its K slice (8 / t segments), the t float32 values reduced by
    adjacent_tree_sum = the TP = 1 tree (and + bias, rounded = the TP = 1 fused output); a left fold is caught."""
    x, w, b = _seg_operands(n, k, rows=300)
    for m in (1, 64, 300):
        tp1 = tst.segment_tree_gemm(x[:m], w, 8)
        tp1_fused = tst.segment_tree_gemm(x[:m], w, 8, b, torch.bfloat16)
        for t in (1, 2, 4, 8):
            kl = k // t
            ranks = [tst.segment_tree_gemm(x[:m, r * kl:(r + 1) * kl].contiguous(), w[:, r * kl:(r + 1) * kl].contiguous(),
                                           8 // t) for r in range(t)]
            top = adjacent_tree_sum(torch.stack(ranks), dim=0)
            assert bits_equal(top, tp1), (m, t)
            assert bits_equal((top + b.to(torch.float32)).to(torch.bfloat16), tp1_fused), (m, t)
            if t == 8 and m == 300:
                assert not bits_equal(_left_fold(ranks), tp1)


def test_tile_counters_outlive_a_captured_graph_when_they_grow():
    """The parallel path's tile counters grow with a larger call; a CUDA graph captured before the growth keeps
    replaying into the buffer it was captured with (kept alive): the replay gives the eager bits, and memory
    allocated after the growth is not written by it (a freed buffer would be handed to the sentinel)."""
    x, w, _ = _seg_operands(256, 512, rows=64)

    def small():
        return tst.segment_tree_gemm(x, w, 8, path="parallel")

    ref = small()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        small()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small()
    captured = tlin._counters(DEV, 1)
    numel = captured.numel()
    rows = 16 * math.ceil((numel + 1) / 8)  # 16 x 32 tiles over N = 256: more tiles than the captured buffer holds
    xb = torch.randn(rows, 512, device=DEV, dtype=torch.bfloat16)
    tst.segment_tree_gemm(xb, w, 8, cfg=tlin._cfg(16, 32, 64, 1 << 20, 4, 2), path="parallel", reg_segments=4)
    assert tlin._counters(DEV, 1).numel() > numel, "the counters did not grow"
    del captured
    sentinel = torch.full((numel,), 7, dtype=torch.int32, device=DEV)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(out, ref)
    assert bool((sentinel == 7).all()), "the replay wrote into memory allocated after the growth"


# --------------------------------------------------------------------------------------- attention

def _qkv(b, t, hq, hkv, d, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(b, t, hkv, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(b, t, hkv, d, generator=g).to(DEV, torch.bfloat16)
    return q, k, v


def _attn(q, k, v, pos, klen, block_m=0):
    return tattn.attention_fwd(q, k, v, pos, klen, q.shape[-1] ** -0.5, block_m=block_m)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_attention_tile_size_invariant(hq, hkv):
    """A row's bits do not depend on the query tile (16 / 64 / 128 rows; mma vs wgmma)."""
    b, t, d = 2, 333, 128
    q, k, v = _qkv(b, t, hq, hkv, d)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    klen = torch.tensor([t, t - 40], device=DEV)
    ref_o, ref_l = _attn(q, k, v, pos, klen, block_m=128)
    for bm in (16, 64):
        o, lse = _attn(q, k, v, pos, klen, block_m=bm)
        assert bits_equal(o, ref_o), f"BLOCK_M={bm} output differs"
        assert bits_equal(lse, ref_l), f"BLOCK_M={bm} lse differs"


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_attention_prefill_chunked_decode_bitwise(hq, hkv):
    b, t, d = 2, 300, 128
    q, k, v = _qkv(b, t, hq, hkv, d, seed=3)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    klen = torch.full((b,), t, device=DEV)
    full_o, full_l = _attn(q, k, v, pos, klen)
    # repeated run
    o2, l2 = _attn(q, k, v, pos, klen)
    assert bits_equal(o2, full_o) and bits_equal(l2, full_l)
    # chunked prefill: keys up to the chunk end, cache longer than needed (k_lengths mask the rest)
    for bounds in ([0, 100, 237, 300], [0, 1, 64, 65, 299, 300], [0, 150, 300]):
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            o, lse = _attn(q[:, c0:c1], k, v, pos[:, c0:c1], torch.full((b,), c1, device=DEV))
            assert bits_equal(o, full_o[:, c0:c1]), f"chunk {c0}:{c1}"
            assert bits_equal(lse, full_l[:, :, c0:c1]), f"chunk {c0}:{c1} lse"
            # same chunk with the cache cut exactly at the chunk end
            o, lse = _attn(q[:, c0:c1], k[:, :c1], v[:, :c1], pos[:, c0:c1], torch.full((b,), c1, device=DEV))
            assert bits_equal(o, full_o[:, c0:c1])
    # decode steps (one query, batch of requests with different lengths)
    for tpos in (0, 63, 64, 65, 128, 199, 299):
        o, lse = _attn(q[:, tpos:tpos + 1], k, v, pos[:, tpos:tpos + 1], torch.full((b,), tpos + 1, device=DEV))
        assert bits_equal(o, full_o[:, tpos:tpos + 1]), f"decode at {tpos}"
        assert bits_equal(lse, full_l[:, :, tpos:tpos + 1])
    # a mixed decode batch: request 0 at position 50, request 1 at position 280, vs each alone
    qd = torch.stack([q[0, 50], q[1, 280]])[:, None]
    pd = torch.tensor([[50], [280]], device=DEV)
    o, _ = _attn(qd, k, v, pd, pd[:, 0] + 1)
    assert bits_equal(o[0, 0], full_o[0, 50]) and bits_equal(o[1, 0], full_o[1, 280])


def test_attention_batch_and_padding_invariant():
    b, t, hq, hkv, d = 3, 200, 8, 2, 128
    q, k, v = _qkv(b, t, hq, hkv, d, seed=4)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    lens = [200, 150, 77]
    for i, n in enumerate(lens):
        pos[i, n:] = -1
    klen = torch.tensor(lens, device=DEV)
    o, lse = _attn(q, k, v, pos, klen)
    for i, n in enumerate(lens):
        oi, li = _attn(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], pos[i:i + 1, :n], klen[i:i + 1])
        assert bits_equal(oi[0], o[i, :n]) and bits_equal(li[0], lse[i, :, :n])
        assert torch.all(o[i, n:] == 0) and torch.all(torch.isinf(lse[i, :, n:]))


@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
def test_attention_partitions_split_and_row_alone_bitwise(hq, hkv):
    """Fixed 512-key partitions: rows either side of partition (512, 1024, 2048) and block (64)
    boundaries give the same bits on the split path, the in-program path, alone (own Tk, decode)
    and inside a prefill batch, for every query tile size."""
    b, t, d = 2, 2100, 128
    q, k, v = _qkv(b, t, hq, hkv, d, seed=6)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    klen = torch.tensor([t, 1500], device=DEV)
    full_o, full_l = _attn(q, k, v, pos, klen)
    for split in (False, True):
        for bm in (16, 64, 128):
            o, lse = tattn.attention_fwd(q, k, v, pos, klen, d ** -0.5, block_m=bm, split=split)
            assert bits_equal(o, full_o) and bits_equal(lse, full_l), f"split={split} BLOCK_M={bm}"
    assert tattn.PART_KEYS == 512
    for p in (63, 64, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2099):
        for split in (False, True):
            o, lse = tattn.attention_fwd(q[:1, p:p + 1], k[:1, :p + 1], v[:1, :p + 1], pos[:1, p:p + 1],
                                         torch.tensor([p + 1], device=DEV), d ** -0.5, split=split)
            assert bits_equal(o[0, 0], full_o[0, p]) and bits_equal(lse[0, :, 0], full_l[0, :, p]), f"decode {p}"
    # a chunk straddling two partitions, cache cut at the chunk end
    o, _ = _attn(q[:, 500:1030], k[:, :1030], v[:, :1030], pos[:, 500:1030], torch.full((b,), 1030, device=DEV))
    assert bits_equal(o[0], full_o[0, 500:1030])


def test_attention_head_dim_256_every_path_fits():
    """Head dim 256 (tiles of at most 64 rows, merge loop at most 2 stages: shared memory): prefill on both paths and
    every tile, rows alone either side of a partition boundary, give the same bits; a 128-row tile is refused."""
    b, t, hq, hkv, d = 1, 1100, 8, 2, 256
    q, k, v = _qkv(b, t, hq, hkv, d, seed=7)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    klen = torch.tensor([t], device=DEV)
    full_o, full_l = _attn(q, k, v, pos, klen)
    for split in (False, True):
        for bm in (0, 16, 64):
            o, lse = tattn.attention_fwd(q, k, v, pos, klen, d ** -0.5, block_m=bm, split=split)
            assert bits_equal(o, full_o) and bits_equal(lse, full_l), f"split={split} BLOCK_M={bm}"
        for p in (511, 512, 1099):
            o, lse = tattn.attention_fwd(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], pos[:, p:p + 1],
                                         torch.tensor([p + 1], device=DEV), d ** -0.5, split=split)
            assert bits_equal(o[0, 0], full_o[0, p]) and bits_equal(lse[0, :, 0], full_l[0, :, p]), f"decode {p}"
    with pytest.raises(ValueError, match="does not fit in shared memory"):
        tattn.attention_fwd(q, k, v, pos, klen, d ** -0.5, block_m=128)


def test_attention_vs_cpu_contract():
    b, t, hq, hkv, d = 1, 96, 4, 2, 64
    q, k, v = _qkv(b, t, hq, hkv, d, seed=5)
    pos = torch.arange(t).expand(b, t).contiguous()
    klen = torch.full((b,), t)
    cpu_o = attention(q.cpu(), k.cpu(), v.cpu(), pos, klen)
    gpu_o = attention(q, k, v, pos.to(DEV), klen.to(DEV)).cpu()
    assert (cpu_o.float() - gpu_o.float()).abs().max().item() <= 2e-2
    _, gpu_l = _attn(q, k, v, pos.to(DEV), klen.to(DEV))
    _, cpu_l = implementation("attention", CPU)(q.cpu(), k.cpu(), v.cpu(), pos, klen, d ** -0.5)
    assert (cpu_l - gpu_l.cpu()).abs().max().item() <= 1e-2


# --------------------------------------------------------------------------------------- small ops

@pytest.mark.parametrize("hidden", [4096, 128, 96, 512])  # 128 / 96: a per-head qk-norm, several rows per program
def test_rms_norm_invariant_and_vs_cpu(hidden):
    torch.manual_seed(6)
    h = torch.randn(513, hidden, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(hidden, device=DEV, dtype=torch.bfloat16)
    y, r = implementation("rms_norm", DEV)(h, w, 1e-6)
    for sl in (slice(0, 1), slice(7, 8), slice(100, 400), slice(509, 513)):
        ys, rs = implementation("rms_norm", DEV)(h[sl], w, 1e-6)
        assert bits_equal(ys, y[sl]) and bits_equal(rs, r[sl])
    yc, rc = implementation("rms_norm", CPU)(h[:16].cpu(), w.cpu(), 1e-6)
    assert (yc.float() - y[:16].float().cpu()).abs().max().item() <= 0.05
    assert ((rc - r[:16].cpu()).abs() / rc).max().item() <= 1e-5
    # fused residual form through the public API
    x = torch.randn_like(h)
    out, res = rms_norm(x, w, 1e-6, residual=h)
    out1, res1 = rms_norm(x[3:4], w, 1e-6, residual=h[3:4])
    assert bits_equal(out1, out[3:4]) and bits_equal(res1, res[3:4])


def test_silu_and_mul_invariant_and_vs_cpu():
    torch.manual_seed(7)
    x = torch.randn(300, 2 * 14336, device=DEV, dtype=torch.bfloat16) * 3
    y = silu_and_mul(x)
    assert bits_equal(silu_and_mul(x[17:18]), y[17:18])
    yc = silu_and_mul(x[:8].cpu())
    assert (yc.float() - y[:8].float().cpu()).abs().max().item() <= 0.02 * y[:8].float().abs().max().item()


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_invariant_and_vs_cpu(style):
    torch.manual_seed(8)
    cfg = RopeConfig(rotary_dim=64, max_positions=4096, style=style)
    x = torch.randn(2, 300, 8, 128, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (2, 300), device=DEV)
    y = apply_rope(x, pos, cfg)
    y1 = apply_rope(x[1:2, 100:101], pos[1:2, 100:101], cfg)
    assert bits_equal(y1, y[1:2, 100:101])
    yc = apply_rope(x.cpu(), pos.cpu(), cfg)
    assert (yc.float() - y.float().cpu()).abs().max().item() <= 0.05
    assert torch.equal(y[..., 64:], x[..., 64:])


def test_log_softmax_invariant_and_vs_cpu():
    torch.manual_seed(9)
    z = torch.randn(9, 128256, device=DEV) * 4
    z[3, :1000] = -math.inf
    lp = log_softmax(z)
    assert bits_equal(log_softmax(z[3:4]), lp[3:4])
    assert bits_equal(log_softmax(z[5:9]), lp[5:9])
    lc = log_softmax(z[:4].cpu())
    fin = torch.isfinite(lc)
    assert torch.equal(fin, torch.isfinite(lp[:4].cpu()))
    assert (lc[fin] - lp[:4].cpu()[fin]).abs().max().item() <= 1e-4


def test_log_softmax_vocab_parallel_tree():
    """The 8-segment vocabulary tree on the GPU at Llama-3's V = 128256 (issue #18): TP = 1, 2, 4, 8 (per-shard
    subtree, top of the tree over the gathered float32 values) give the TP = 1 bits of ``s`` and of the log-probs,
    with -inf entries and a wholly -inf segment; V not divisible by 8 is the -inf padding; broken variants (an
    all-reduce-order top, a shard summed as one segment, another in-segment order) change ``s``."""
    from _vocab_parallel import left_to_right, same, tp1, vocab_parallel

    from megatron_consistent.kernels.triton import log_softmax as tls

    torch.manual_seed(11)
    z = torch.randn(9, 128256, device=DEV) * 4
    z[2, :20000] = -math.inf  # segment 0 and part of segment 1: a segment sum of +0
    z[4, 1::3] = -math.inf
    full = tp1(z)
    for t in (1, 2, 4, 8):
        assert same(vocab_parallel(z, t), full), f"TP={t}"
        assert same(vocab_parallel(z[4:7], t), (full[0][4:7], full[1][4:7])), f"TP={t}, rows 4:7"
    for broken in (vocab_parallel(z, 8, top=left_to_right), vocab_parallel(z, 2, shard_segments=1)):
        assert not torch.equal(broken[0], full[0])
    old = tls.MAX_BLOCK
    try:
        tls.MAX_BLOCK = 1024  # 16 sequential blocks per 16032-entry segment instead of 4
        assert not torch.equal(tp1(z)[0], full[0])
    finally:
        tls.MAX_BLOCK = old
    v = 128256 - 3
    pad = torch.cat([z[:, :v], torch.full((9, 3), -math.inf, device=DEV)], dim=-1)
    assert bits_equal(log_softmax(z[:, :v]), log_softmax(pad)[:, :v])


def test_logits_logprobs_end_to_end_batch_invariant():
    """lm head (float32 logits) -> log-softmax: a token's logprob is the same alone or in a batch."""
    from megatron_consistent.kernels import token_logprobs

    torch.manual_seed(10)
    hidden = torch.randn(64, 1024, device=DEV, dtype=torch.bfloat16)
    head = torch.randn(32000, 1024, device=DEV, dtype=torch.bfloat16) * 0.02
    tok = torch.randint(0, 32000, (64,), device=DEV)
    lp = token_logprobs(hidden, head, tok)
    for i in (0, 31, 63):
        assert bits_equal(token_logprobs(hidden[i:i + 1], head, tok[i:i + 1]), lp[i:i + 1])
