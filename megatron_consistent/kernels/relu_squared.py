"""Squared ReLU ``relu(x)**2`` (Nemotron-H MLP / expert activation ``relu2``).

Numerics contract (CPU): ``r = max(float32(x), 0)``; ``y = round_to_dtype(r * r)`` —
one IEEE float32 product and one rounding, elementwise, so position-, batch- and
thread-independent.  Backward: float32 closed form ``grad * 2 * relu(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register


@register("relu_squared", "cpu")
def _relu_squared_cpu(x: torch.Tensor) -> torch.Tensor:
    r = torch.clamp_min(x.to(torch.float32), 0.0)
    return (r * r).to(x.dtype)


class ReluSquaredFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`relu_squared`."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return implementation("relu_squared", x.device)(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        r = torch.clamp_min(x.to(torch.float32), 0.0)
        return (grad_y.to(torch.float32) * (2.0 * r)).to(x.dtype)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)**2`` under the contract above."""
    if not x.is_floating_point():
        raise ValueError(f"relu_squared: needs a floating-point input, got {x.dtype}")
    return ReluSquaredFunction.apply(x)


class ReluSquared(nn.Module):
    """Thin module around :func:`relu_squared`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_squared(x)
