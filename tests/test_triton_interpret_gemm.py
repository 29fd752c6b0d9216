"""The GEMM kernels' indexing, masks and split machinery on CPU tensors in Triton's interpreter (issue #15).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``); the
interpreter evaluates ``tl.dot`` with numpy, so this proves the index / mask / split-order logic of every path
(swap-AB, split-parallel, spilled splits, one weight scale per tile) -- not the GPU's bits, which
tests/test_gpu_kernels.py and tests/test_gpu_fp8.py check on the device.  The row-parallel K-segment tree (issue #18)
is checked the same way: one launch = the per-segment GEMM loop + ``adjacent_tree_sum`` on every schedule, a TP split
of the segments = TP 1, the merge order matters.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
triton = pytest.importorskip("triton")
import triton.language as tl

from megatron_consistent.kernels import fp8
from megatron_consistent.kernels.numerics import adjacent_tree_sum
from megatron_consistent.kernels.triton import fp8_linear as tf8
from megatron_consistent.kernels.triton import linear as tlin
from megatron_consistent.kernels.triton import segment_tree as tst

NOSPLIT = tlin._NOSPLIT
c = tlin._cfg
# (name, cfg, path): small tiles so the interpreter stays fast; SPLIT_STEPS 3 of BLOCK_K 16 over K = 100 -> 3 splits
CFGS = [
    ("plain", c(16, 16, 16, NOSPLIT, 4, 2), None),
    ("swap", c(16, 32, 16, NOSPLIT, 4, 2, swap=True), None),
    ("split serial", c(16, 16, 16, 3, 4, 2), "serial"),
    ("split parallel", c(16, 16, 16, 3, 4, 2), "parallel"),
    ("split spill", c(64, 16, 16, 3, 4, 2, spill=True), "serial"),
    ("swap split serial", c(16, 32, 16, 3, 4, 2, swap=True), "serial"),
    ("swap split parallel", c(16, 16, 16, 3, 4, 2, swap=True), "parallel"),
    ("swap split spill", c(16, 64, 16, 3, 4, 2, swap=True, spill=True), "serial"),
]


@pytest.mark.parametrize("n,k", [(40, 100), (64, 80)])
def test_gemm_paths_rows_and_split_groups(n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.1
    b = torch.randn(n)
    x = torch.randn(33, k)
    ref = x.double() @ w.double().T + b.double()
    outs = {}
    for name, cfg, path in CFGS:
        full = tlin.gemm(x, w, b, torch.float32, cfg=cfg, path=path)
        assert (full.double() - ref).abs().max().item() < 1e-4, name
        for m in (1, 7, 20):
            assert torch.equal(tlin.gemm(x[:m], w, b, torch.float32, cfg=cfg, path=path), full[:m]), (name, m)
        outs[name] = full
    # same numerics (BLOCK_K, split) -> same bits, whatever the tile / schedule (numpy dot: exact per element order)
    for name, _, _ in CFGS:
        group = "split serial" if "split" in name else "plain"
        assert torch.equal(outs[name], outs[group]), name


def test_gemm_m_dependent_split_caught_in_interpreter():
    torch.manual_seed(1)
    w = torch.randn(48, 160) * 0.1
    x = torch.randn(40, 160)
    full = tlin.gemm(x, w, None, torch.float32, cfg=c(16, 16, 16, NOSPLIT, 4, 2))
    one = tlin.gemm(x[:1], w, None, torch.float32, cfg=c(16, 16, 16, 2, 4, 2))  # split for M = 1 only
    assert not torch.equal(one, full[:1])


def _fp8_operands(n, k, m, seed):
    """``(wq, row scales, xq, xs)``: a random ``[n, k]`` weight in 128 x 128 blocks, ``m`` activation rows."""
    torch.manual_seed(seed)
    wq, s = fp8.quantize(torch.randn(n, k) * 0.05, fp8.E4M3_WEIGHT_128)
    xq, xs = fp8.quantize(torch.randn(m, k), fp8.E4M3_ACT_1x128)
    return wq, fp8.weight_row_scales(s, n), xq, xs.contiguous()


def test_fp8_scalar_weight_scale_in_interpreter():
    wq, rows, xq, xs = _fp8_operands(256, 384, 40, seed=2)
    ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=tf8._fp8_cfg(16, 32, 4, 2, 1))
    for cfg in (tf8._fp8_cfg(16, 32, 4, 2, 1, True), tf8._fp8_cfg(32, 128, 4, 2, 1, True)):
        for path in ("serial", "parallel"):
            for m in (1, 7, 40):
                y = tf8.fp8_gemm(xq[:m], xs[:m], wq, rows, None, torch.float32, cfg=cfg, path=path, w_block_rows=128)
                assert torch.equal(y, ref[:m]), (cfg, path, m)


@pytest.mark.parametrize("split_groups", [2, 5])
def test_fp8_flat_split_walk_in_interpreter(split_groups):
    """The flat walk (one pipelined loop over a tile's groups, a split's partial added to the total at its last
    group) == the split-by-split loops, bit for bit, with uneven splits (9 groups as 5 + 4, or 2+2+2+2+1) and a ragged
    N edge; the splits do change the float32 result (one split differs), so a walk that ignored them is caught."""
    wq, rows, xq, xs = _fp8_operands(72, 1152, 9, seed=3)
    split = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=tf8._fp8_cfg(16, 32, 4, 2, 1),
                         split_groups=split_groups, path="serial")
    assert not torch.equal(split, tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=tf8._fp8_cfg(16, 32, 4, 2, 1),
                                               split_groups=9, path="serial"))
    for m in (1, 9):
        flat = tf8.fp8_gemm(xq[:m], xs[:m], wq, rows, None, torch.float32, cfg=tf8._fp8_cfg(16, 32, 4, 2, 1, flat=True),
                            split_groups=split_groups, path="serial")
        assert torch.equal(flat, split[:m]), m


# ------------------------------------------------------------------ row-parallel K-segment tree (issue #18)

# (name, cfg): BLOCK_K 16; "split": SPLIT_STEPS 1 -> a segment of 2+ steps has 2+ splits (their partials summed in
# split order inside the segment)
SEG_CFGS = [
    ("plain", c(16, 16, 16, NOSPLIT, 4, 2)),
    ("swap", c(16, 32, 16, NOSPLIT, 4, 2, swap=True)),
    ("split", c(16, 16, 16, 1, 4, 2)),
    ("two programs per SM", {**c(16, 16, 16, NOSPLIT, 4, 2), "TREE_PROGS": 2}),
]
# (path, reg_segments, lanes): every schedule of the kernel
SEG_SCHEDULES = [("serial", None, 1), ("serial", 1, 1), ("serial", 2, 1), ("parallel", 1, 1), ("parallel", 2, 1),
                 ("flat", 1, 1), ("flat", 2, 1), ("serial", 2, 2), ("serial", 4, 1), ("serial", 4, 2), ("parallel", 2, 2),
                 ("serial", 4, 4), ("serial", 8, 4), ("parallel", 4, 4)]


def _left_fold(parts):
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty), mask=offs < n)


def _backend_round(y32, dtype):
    """float32 -> dtype rounded the way this backend's kernels round (the interpreter truncates to bf16; the GPU
    rounds to nearest even, as torch does)."""
    out = torch.empty(y32.shape, dtype=dtype)
    _cast_kernel[(1,)](y32.contiguous().view(-1), out.view(-1), y32.numel(), BLOCK=triton.next_power_of_2(y32.numel()))
    return out


@pytest.mark.parametrize("name,cfg", SEG_CFGS, ids=[s[0] for s in SEG_CFGS])
@pytest.mark.parametrize("segments,k", [(1, 40), (2, 72), (4, 64), (8, 64), (8, 200)])
def test_segment_tree_equals_naive_loop(name, cfg, segments, k):
    """One launch = the per-segment GEMM loop + adjacent_tree_sum, bit for bit, on every schedule; K_seg not a
    multiple of BLOCK_K (K = 64 over 8 segments: 8 columns, zero-padded inside the segment); a row alone = the row
    in the batch; the partials mode = the stacked loop."""
    torch.manual_seed(10 + segments)
    n = 40
    w = torch.randn(n, k) * 0.1
    x = torch.randn(21, k)
    naive = tst.linear_segments_naive(x, w, segments, cfg=cfg)
    ref = adjacent_tree_sum(naive, dim=0)
    assert (ref.double() - x.double() @ w.double().T).abs().max().item() < 1e-4
    assert torch.equal(tst.segment_tree_gemm(x, w, segments, partials=True, cfg=cfg), naive)
    for path, reg, lanes in SEG_SCHEDULES:
        full = tst.segment_tree_gemm(x, w, segments, cfg=cfg, path=path, reg_segments=reg, lanes=lanes)
        assert torch.equal(full, ref), (name, path, reg, lanes)
    for m in (1, 6):
        for path, reg, lanes in (("serial", None, 1), ("parallel", 1, 1), ("flat", 1, 1), ("serial", 2, 2),
                                 ("serial", 4, 2), ("serial", 8, 4)):
            rows = tst.segment_tree_gemm(x[m:2 * m], w, segments, cfg=cfg, path=path, reg_segments=reg, lanes=lanes)
            assert torch.equal(rows, ref[m:2 * m]), (name, path, reg, lanes, m)
    if segments == 8:  # the merge order is checked: a left fold of the same partials gives other bits
        assert not torch.equal(_left_fold(list(naive)), ref)


def test_segment_tree_fused_bias_and_rounding_equal_unfused():
    """TP = 1 fused output ``round(tree + bias)`` = the unfused float32 tree, plus bias, rounded (fp32 and bf16)."""
    torch.manual_seed(20)
    n, k = 48, 128
    w = torch.randn(n, k) * 0.1
    b = torch.randn(n)
    x = torch.randn(19, k)
    cfg = SEG_CFGS[0][1]
    tree = tst.segment_tree_gemm(x, w, 8, cfg=cfg)
    assert torch.equal(tree, adjacent_tree_sum(tst.linear_segments_naive(x, w, 8, cfg=cfg), dim=0))
    for path, reg in (("serial", None), ("parallel", 1), ("flat", 2)):
        y32 = tst.segment_tree_gemm(x, w, 8, b, torch.float32, cfg=cfg, path=path, reg_segments=reg)
        assert torch.equal(y32, tree + b), path
        y16 = tst.segment_tree_gemm(x, w, 8, b, torch.bfloat16, cfg=cfg, path=path, reg_segments=reg)
        assert torch.equal(y16.view(torch.int16), _backend_round(tree + b, torch.bfloat16).view(torch.int16)), path


@pytest.mark.parametrize("k", [64, 256])
def test_segment_tree_tensor_parallel_split_equals_tp1(k):
    """TP = t: rank r holds K columns [r K/t, (r+1) K/t) = segments r 8/t ..; its subtree (one launch, 8/t segments),
    the t float32 values reduced by adjacent_tree_sum = the TP = 1 tree, bit for bit, for t = 1, 2, 4, 8 -- and a
    left fold of the rank values (the wrong merge) is caught."""
    torch.manual_seed(30)
    n = 40
    w = torch.randn(n, k) * 0.1
    b = torch.randn(n)
    x = torch.randn(17, k)
    cfg = SEG_CFGS[0][1]
    tp1 = tst.segment_tree_gemm(x, w, 8, cfg=cfg)
    tp1_fused = tst.segment_tree_gemm(x, w, 8, b, torch.float32, cfg=cfg)
    for t in (1, 2, 4, 8):
        kl = k // t
        ranks = [tst.segment_tree_gemm(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl], 8 // t, cfg=cfg)
                 for r in range(t)]
        top = adjacent_tree_sum(torch.stack(ranks), dim=0)
        assert torch.equal(top, tp1), t
        assert torch.equal(top + b, tp1_fused), t
        if t == 8:
            assert not torch.equal(_left_fold(ranks), tp1)


def test_segment_tree_m_class_table_rows_identical():
    """With an M-class entry for the segment shape (N, K / 8) -- a different tile per M class, BLOCK_K and split fixed
    -- each call picks the class of its M (as the naive per-segment GEMMs do) and a row's bits do not depend on M."""
    torch.manual_seed(40)
    n, k = 40, 256
    entry = {"BK": 16, "SPLIT_STEPS": NOSPLIT,
             "classes": [(1, {"BM": 16, "BN": 32, "W": 4, "S": 2, "SWAP": True}),
                         (8, {"BM": 16, "BN": 16, "W": 4, "S": 2}),
                         (None, {"BM": 32, "BN": 16, "W": 4, "S": 2})]}
    key = (n, k // 8, torch.float32)
    saved = dict(tlin.M_CLASS_TABLE)
    tlin.M_CLASS_TABLE[key] = entry
    try:
        w = torch.randn(n, k) * 0.1
        x = torch.randn(20, k)
        full = tst.segment_tree_gemm(x, w, 8)
        assert tst.plan(20, n, k, 8, torch.float32)["cfg"]["BM"] == 32
        assert torch.equal(full, adjacent_tree_sum(tst.linear_segments_naive(x, w, 8), dim=0))
        for sl in (slice(3, 4), slice(0, 8), slice(5, 12)):
            assert torch.equal(tst.segment_tree_gemm(x[sl], w, 8), full[sl]), sl
    finally:
        tlin.M_CLASS_TABLE.clear()
        tlin.M_CLASS_TABLE.update(saved)


def test_fp8_row_parallel_tree_launches_equal_the_per_segment_fp8_linears():
    """The CUDA ``fp8_linear_segment_tree`` launcher on CPU tensors: the activations quantized once, one FP8 GEMM per
    128-aligned K segment, the tree, bias, one rounding = the CUDA ``fp8_linear`` of each segment's slice, summed by the
    same tree; narrower segments take the dequantized ``linear_segment_tree``."""
    g = torch.Generator().manual_seed(7)
    wq, s = fp8.quantize(torch.randn(48, 512, generator=g) * 0.05, fp8.E4M3_WEIGHT_128)
    rows = fp8.weight_row_scales(s, 48)
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    got = tf8._fp8_linear_segment_tree_cuda(x, wq, rows, 4, b, torch.bfloat16)
    parts = torch.stack([tf8._fp8_linear_cuda(x[:, i * 128:(i + 1) * 128].contiguous(), wq[:, i * 128:(i + 1) * 128].contiguous(),
                                              rows[:, i:i + 1].contiguous(), None, torch.float32) for i in range(4)])
    assert torch.equal(got, (adjacent_tree_sum(parts, dim=0) + b.float()).to(torch.bfloat16))
    xd, wd = fp8._dequantized_operands(x, wq, rows, fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    from megatron_consistent.kernels.dispatch import implementation

    assert torch.equal(tf8._fp8_linear_segment_tree_cuda(x, wq, rows, 8, b, torch.bfloat16),
                       implementation("linear_segment_tree", x.device)(xd, wd, 8, b, torch.bfloat16))
