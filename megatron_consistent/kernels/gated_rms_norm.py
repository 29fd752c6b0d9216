"""Gated, grouped RMSNorm of the Mamba-2 mixer (``norm_before_gate=False``).

Numerics contract (CPU), for ``y, z`` of shape ``[..., D]`` and ``D = n_groups * group_size``:

* ``h = float32(y) * (float32(z) / (1 + exp(-float32(z))))`` — silu with the
  deterministic :func:`numerics.exp`, the gate applied before the norm;
* per group of ``group_size`` consecutive channels:
  ``ms = tree_sum(h * h) / group_size`` (fixed pairwise tree over the group),
  ``rstd = 1 / sqrt(ms + eps)`` (torch's float32 sqrt, a function of its input alone but on the AVX-512 CPUs
  here not always correctly rounded, as in :mod:`rms_norm`; an IEEE division);
* ``out = round_to_dtype((h * rstd) * float32(weight))`` — one rounding to ``y.dtype``.

Every output element depends only on its own row's group, never on other rows,
the thread count or the row's position in the batch.  (HF's ``MambaRMSNormGated``
rounds the normalized value to the input dtype before the weight product; we
round once, like :mod:`rms_norm`.)  Backward: float32 recompute through
differentiable torch ops and ``torch.autograd.grad``.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import exp, tree_sum


def _check(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    if y.shape != z.shape:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)} and gate z {tuple(z.shape)} differ in shape")
    d = y.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} does not match {d} channels")
    if group_size <= 0 or d % group_size:
        raise ValueError(f"gated_rms_norm: group_size {group_size} does not divide {d} channels")


@register("gated_rms_norm", "cpu")
def _gated_rms_norm_cpu(y, z, weight, group_size: int, eps: float) -> torch.Tensor:
    zf = z.to(torch.float32)
    h = y.to(torch.float32) * (zf / (1.0 + exp(-zf)))
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    ms = tree_sum(hg * hg) / group_size
    rstd = 1.0 / torch.sqrt(ms + eps)
    out = (hg * rstd[..., None]).reshape(h.shape) * weight.to(torch.float32)
    return out.to(y.dtype)


def _gated_rms_norm_autograd(y, z, weight, group_size: int, eps: float) -> torch.Tensor:
    """Differentiable float32 form of the same math (torch ops; used by the backward only)."""
    zf = z.to(torch.float32)
    h = y.to(torch.float32) * (zf * torch.sigmoid(zf))
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    rstd = torch.rsqrt((hg * hg).mean(-1, keepdim=True) + eps)
    return (hg * rstd).reshape(h.shape) * weight.to(torch.float32)


class GatedRMSNormFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`gated_rms_norm` (recompute-based float32 backward)."""

    @staticmethod
    def forward(ctx, y, z, weight, group_size, eps):
        ctx.save_for_backward(y, z, weight)
        ctx.group_size, ctx.eps = group_size, eps
        return implementation("gated_rms_norm", y.device)(y, z, weight, group_size, eps)

    @staticmethod
    def backward(ctx, grad_out):
        y, z, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().to(torch.float32).requires_grad_(True) for t in (y, z, weight)]
            out = _gated_rms_norm_autograd(*leaves, ctx.group_size, ctx.eps)
            grads = torch.autograd.grad(out, leaves, grad_out.to(torch.float32))
        return tuple(g.to(t.dtype) for g, t in zip(grads, (y, z, weight))) + (None, None)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``rms_norm_grouped(y * silu(z)) * weight`` under the contract above."""
    _check(y, z, weight, group_size)
    return GatedRMSNormFunction.apply(y, z, weight, group_size, eps)


class GatedRMSNorm(nn.Module):
    """Thin module around :func:`gated_rms_norm`."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)
