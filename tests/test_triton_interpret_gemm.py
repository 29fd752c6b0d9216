"""The GEMM kernels' indexing, masks and split machinery on CPU tensors in Triton's interpreter (issue #15).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``); the
interpreter evaluates ``tl.dot`` with numpy, so this proves the index / mask / split-order logic of every path
(swap-AB, split-parallel, spilled splits, one weight scale per tile) -- not the GPU's bits, which
tests/test_gpu_kernels.py and tests/test_gpu_fp8.py check on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
triton = pytest.importorskip("triton")

from megatron_consistent.kernels import fp8
from megatron_consistent.kernels.triton import fp8_linear as tf8
from megatron_consistent.kernels.triton import linear as tlin

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


def test_fp8_scalar_weight_scale_in_interpreter():
    torch.manual_seed(2)
    n, k = 256, 384
    wq, s = fp8.quantize(torch.randn(n, k) * 0.05, fp8.E4M3_WEIGHT_128)
    rows = fp8.weight_row_scales(s, n)
    xq, xs = fp8.quantize(torch.randn(40, k), fp8.E4M3_ACT_1x128)
    xs = xs.contiguous()
    ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=tf8._fp8_cfg(16, 32, 4, 2, 1))
    for cfg in (tf8._fp8_cfg(16, 32, 4, 2, 1, True), tf8._fp8_cfg(32, 128, 4, 2, 1, True)):
        for path in ("serial", "parallel"):
            for m in (1, 7, 40):
                y = tf8.fp8_gemm(xq[:m], xs[:m], wq, rows, None, torch.float32, cfg=cfg, path=path, w_block_rows=128)
                assert torch.equal(y, ref[:m]), (cfg, path, m)
