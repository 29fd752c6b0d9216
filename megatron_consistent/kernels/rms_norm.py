"""RMSNorm, optionally fused with the residual add that precedes it.

Numerics contract (CPU):

* with a residual: ``h = round_to_dtype(float32(x) + float32(residual))`` — the
  new residual stream, in the input dtype; without: ``h = x``;
* ``ms = tree_sum(float32(h)**2) / H`` (fixed pairwise tree over the hidden axis);
* ``rstd = 1 / sqrt(ms + eps)`` (torch's float32 sqrt -- on the AVX-512 CPUs here one ulp off the correctly
  rounded value for about 0.7 % of inputs, but a function of its input alone, tests/test_numerics.py -- and an
  IEEE division);
* ``y = round_to_dtype((float32(h) * rstd) * float32(weight))`` — one rounding.

The fused and unfused forms are bitwise identical by construction, so either
engine may use either.  Backward: float32 closed form.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import tree_sum


def add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``round_to_dtype(float32(x) + float32(residual))`` — the residual add of the contract."""
    return (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)


@register("rms_norm", "cpu")
def _rms_norm_cpu(h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    hf = h.to(torch.float32)
    ms = tree_sum(hf * hf) / h.shape[-1]
    rstd = 1.0 / torch.sqrt(ms + eps)
    y = ((hf * rstd[..., None]) * weight.to(torch.float32)).to(h.dtype)
    return y, rstd


@register("add_rms_norm", "cpu")
def _add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h), h)`` with ``h = add_residual(x, residual)``: the fused form's reference (inference only)."""
    h = add_residual(x, residual)
    return _rms_norm_cpu(h, weight, eps)[0], h


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`rms_norm` (no residual; the add is differentiated by autograd)."""

    @staticmethod
    def forward(ctx, h, weight, eps):
        y, rstd = implementation("rms_norm", h.device)(h, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        h, weight, rstd = ctx.saved_tensors
        hf = h.to(torch.float32)
        g = grad_y.to(torch.float32)
        xhat = hf * rstd[..., None]
        gw = g * weight.to(torch.float32)
        grad_h = rstd[..., None] * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        grad_w = (g * xhat).reshape(-1, h.shape[-1]).sum(0)
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of ``x`` (or of ``x + residual``, then returns ``(y, new_residual)``)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: input has {x.shape[-1]} features, weight has {weight.shape[0]}")
    if residual is None:
        return RMSNormFunction.apply(x, weight, eps)
    h = add_residual(x, residual)
    return RMSNormFunction.apply(h, weight, eps), h


class RMSNorm(nn.Module):
    """Thin module around :func:`rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)
