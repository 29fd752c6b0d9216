"""Straight-through-estimator gradients of the FP8 linear vs a float64 reference applying the same quantizer.

Reference: ``xd, wd`` = the same quantize -> dequantize of x and W (computed by
the kernel's quantizer, then widened to float64 — exact); ``y = xd @ wd^T + b``
in float64 with the STE (``x + (xd - x).detach()``), so autograd gives
``dL/dx = g @ wd`` and ``dL/dW = g^T @ xd``.

Tolerance: the kernel forms the same matmuls in float32 and rounds once to the
parameter dtype.  Per element: float32 accumulation error <= K * 2^-24 *
(|g| @ |wd|) (a loose bound for any summation order), plus one rounding to
bf16 (<= 2^-8 relative) or float32 (<= 2^-24 relative).
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128, E4M3_WEIGHT_128, dequantize, fp8_linear_ste, quantize, weight_row_scales

_REL = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n, k", [(9, 256, 128), (13, 200, 300)])
def test_ste_gradients_match_float64_reference(dtype, m, n, k):
    g0 = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g0)).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g0) * 0.05).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g0).to(dtype).requires_grad_()
    gy = torch.randn(m, n, generator=g0).to(dtype)

    w_q, s = quantize(w.detach(), E4M3_WEIGHT_128)
    y = fp8_linear_ste(x, w, b, w_q, weight_row_scales(s, n))
    y.backward(gy)

    xq, xs = quantize(x.detach(), E4M3_ACT_1x128)
    xd, wd = dequantize(xq, xs, E4M3_ACT_1x128).double(), dequantize(w_q, s, E4M3_WEIGHT_128).double()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = (x64 + (xd - x64).detach()) @ (w64 + (wd - w64).detach()).t() + b64
    y64.backward(gy.double())

    g = gy.double().abs()
    rel = _REL[dtype]
    bound_x = k * 2.0**-24 * (g @ wd.abs()) + rel * x64.grad.abs() + 1e-30
    bound_w = m * 2.0**-24 * (g.t() @ xd.abs()) + rel * w64.grad.abs() + 1e-30
    bound_b = m * 2.0**-24 * g.sum(0) + rel * b64.grad.abs() + 1e-30
    assert torch.all((x.grad.double() - x64.grad).abs() <= bound_x)
    assert torch.all((w.grad.double() - w64.grad).abs() <= bound_w)
    assert torch.all((b.grad.double() - b64.grad).abs() <= bound_b)
    # forward vs the float64 reference: float32 accumulation + one rounding to dtype
    bound_y = (k + 1) * 2.0**-24 * (xd.abs() @ wd.abs().t() + b64.detach().abs()) + rel * y64.detach().abs() + 1e-30
    assert torch.all((y.detach().double() - y64.detach()).abs() <= bound_y)
