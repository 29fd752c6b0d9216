"""Depthwise causal 1-D convolution with state passing (the Mamba-2 ``conv1d`` on ``xBC``).

``causal_conv1d(x, weight, bias, state, activation) -> (y, new_state)`` with
``x [..., T, C]``, ``weight [C, K]``, ``bias [C]`` or ``None`` and ``state [..., K-1, C]``
= the ``K-1`` inputs that precede ``x[0]`` (zeros when ``None``; cast to ``x.dtype``,
which is lossless when it holds earlier inputs).  With ``xin = state ++ x``:

Numerics contract (CPU):

* ``acc = float32(w[c,0]) * float32(xin[t,c])``, then for taps ``j = 1..K-1`` in that
  order ``acc = acc + float32(w[c,j]) * float32(xin[t+j,c])`` (one IEEE product and one
  IEEE sum per tap, no fused multiply-add); then ``acc = acc + float32(bias[c])``;
* ``activation="silu"``: ``acc = acc / (1 + exp(-acc))`` with :func:`numerics.exp`;
  ``None``: identity;
* ``y = round_to_dtype(acc)`` — one rounding.
* ``new_state`` = the last ``K-1`` rows of ``xin`` (in ``x.dtype``).

Each output depends only on its own ``K`` inputs, so its bits do not depend on ``T``,
on how a sequence is cut into pieces (with the state passed along), on the batch or
on the thread count.  Backward: float32 recompute with torch ops + ``autograd.grad``
(gradients for ``x``, ``weight``, ``bias`` and ``state``).
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import exp

ACTIVATIONS = ("silu", None)


@register("causal_conv1d", "cpu")
def _causal_conv1d_cpu(x, weight, bias, state, activation):
    k = weight.shape[1]
    t = x.shape[-2]
    xin = torch.cat([state.to(x.dtype), x], dim=-2)  # state: a tensor (CausalConv1dFunction makes the zeros)
    wf = weight.to(torch.float32)
    acc = xin[..., 0:t, :].to(torch.float32) * wf[:, 0]
    for j in range(1, k):
        acc = acc + xin[..., j:j + t, :].to(torch.float32) * wf[:, j]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    if activation == "silu":
        acc = acc / (1.0 + exp(-acc))
    return acc.to(x.dtype), xin[..., xin.shape[-2] - (k - 1):, :].clone()


def _causal_conv1d_autograd(x, weight, bias, state, activation):
    """Differentiable float32 form of the same math (torch ops; used by the backward only)."""
    k = weight.shape[1]
    t = x.shape[-2]
    xin = torch.cat([state, x], dim=-2)
    acc = sum(xin[..., j:j + t, :] * weight[:, j] for j in range(k))
    if bias is not None:
        acc = acc + bias
    if activation == "silu":
        acc = acc * torch.sigmoid(acc)
    return acc, xin[..., xin.shape[-2] - (k - 1):, :]


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`causal_conv1d` (float32 recompute backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, activation):
        ctx.state_given = state is not None  # no gradient may be returned for a None input
        if state is None:
            state = x.new_zeros(*x.shape[:-2], weight.shape[1] - 1, x.shape[-1])
        ctx.save_for_backward(x, weight, bias, state)
        ctx.activation = activation
        return implementation("causal_conv1d", x.device)(x, weight, bias, state, activation)

    @staticmethod
    def backward(ctx, grad_y, grad_state):
        x, weight, bias, state = ctx.saved_tensors
        originals = (x, weight, bias, state)
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().to(torch.float32).requires_grad_(True) for t in originals]
            y, new_state = _causal_conv1d_autograd(*leaves, ctx.activation)
            outs, gouts = [y], [grad_y.to(torch.float32)]
            if grad_state is not None and new_state.numel():
                outs.append(new_state)
                gouts.append(grad_state.to(torch.float32))
            present = [leaf for leaf in leaves if leaf is not None]
            grads = iter(torch.autograd.grad(outs, present, gouts, allow_unused=True))
        result = []
        for leaf, t in zip(leaves, originals):
            if leaf is None:
                result.append(None)
                continue
            g = next(grads)
            result.append(torch.zeros_like(t) if g is None else g.to(t.dtype))
        if not ctx.state_given:
            result[3] = None
        return tuple(result) + (None,)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  state: torch.Tensor | None = None, activation: str | None = "silu"):
    """Depthwise causal conv (+ optional silu) of ``x [..., T, C]``; returns ``(y, new_state)``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r} (supported: 'silu', None)")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)} is not [C={x.shape[-1]}, K]")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"causal_conv1d: bias {tuple(bias.shape)} is not [C={x.shape[-1]}]")
    k = weight.shape[1]
    if state is not None and state.shape != (*x.shape[:-2], k - 1, x.shape[-1]):
        raise ValueError(f"causal_conv1d: state {tuple(state.shape)} is not {(*x.shape[:-2], k - 1, x.shape[-1])}")
    return CausalConv1dFunction.apply(x, weight, bias, state, activation)


class CausalConv1d(nn.Module):
    """Thin module around :func:`causal_conv1d` (weight ``[C, K]``)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool = True, activation: str | None = "silu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=kernel_size ** -0.5)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        return causal_conv1d(x, self.weight, self.bias, state, self.activation)
