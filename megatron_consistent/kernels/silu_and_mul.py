"""Gated activation ``silu(gate) * up`` on a ``[..., 2I]`` input (gate first, then up).

Numerics contract (CPU): ``g, u = float32(x[..., :I]), float32(x[..., I:])``;
``silu = g / (1 + exp(-g))`` with the deterministic :func:`numerics.exp`;
``y = round_to_dtype(silu * u)`` — one rounding, elementwise, so position- and
batch-independent.  Backward: float32 closed form.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import exp


@register("silu_and_mul", "cpu")
def _silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    g = x[..., :half].to(torch.float32)
    u = x[..., half:].to(torch.float32)
    return ((g / (1.0 + exp(-g))) * u).to(x.dtype)


class SiluAndMulFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`silu_and_mul`."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return implementation("silu_and_mul", x.device)(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        g = x[..., :half].to(torch.float32)
        u = x[..., half:].to(torch.float32)
        s = torch.sigmoid(g)
        gy = grad_y.to(torch.float32)
        grad_g = gy * u * (s * (1.0 + g * (1.0 - s)))
        grad_u = gy * (g * s)
        return torch.cat([grad_g, grad_u], dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` under the contract above."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {x.shape[-1]}")
    return SiluAndMulFunction.apply(x)


class SiluAndMul(nn.Module):
    """Thin module around :func:`silu_and_mul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
