"""The CUDA RMSNorm kernel's rows-per-program layout in Triton's interpreter (CPU tensors).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``), like the other
``test_triton_interpret_*`` files.  Short rows (a per-head qk-norm: hidden 96 / 128) share a program; the masks of the
last, partial program and of a hidden size that is not a power of two must leave every row as it is alone, with and
without the fused residual add.  The interpreter's reductions are numpy's, so this proves indices and masks; the bits
on the GPU are tests/test_gpu_kernels.py's (rows alone == the batch).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

from megatron_consistent.kernels.triton import rms_norm as trms


@pytest.mark.parametrize("hidden", [96, 128, 512, 2048])
def test_rows_per_program_keep_each_row_alone(hidden):
    g = torch.Generator().manual_seed(hidden)
    h, x, w = torch.randn(37, hidden, generator=g), torch.randn(37, hidden, generator=g), torch.randn(hidden, generator=g)
    y, rstd = trms._rms_norm_cuda(h, w, 1e-6)
    ref_rstd = 1 / torch.sqrt((h.double() ** 2).mean(-1) + 1e-6)
    assert ((rstd.double() - ref_rstd) / ref_rstd).abs().max().item() < 1e-6
    assert (y.double() - h.double() * ref_rstd[:, None] * w.double()).abs().max().item() < 1e-5
    for rows in (slice(0, 1), slice(5, 30), slice(36, 37)):
        alone, alone_rstd = trms._rms_norm_cuda(h[rows], w, 1e-6)
        assert torch.equal(alone, y[rows]) and torch.equal(alone_rstd, rstd[rows])
    fused, summed = trms._add_rms_norm_cuda(x, h, w, 1e-6)
    assert torch.equal(summed, x + h)
    assert torch.equal(fused, trms._rms_norm_cuda(x + h, w, 1e-6)[0])
