"""Independent float64 oracle of the hybrid Mamba-2 ops (plain torch, no package kernels).

Every function casts its inputs to float64 and evaluates the textbook definition with
differentiable torch ops, so ``torch.autograd.grad`` of it is the float64 gradient oracle:

* :func:`ssd_recurrence_f64` — the SSM as a plain sequential recurrence, token by token:
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = C_t . h_t + D x_t`` (head ``h`` reads
  group ``h // (H // G)``); no chunks at all.
* :func:`causal_conv1d_f64`, :func:`mamba_dt_f64`, :func:`gated_rms_norm_f64`,
  :func:`relu_squared_f64`.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _d(t):
    return None if t is None else t.to(F64)


def ssd_recurrence_f64(x, dt, A, B, C, D, initial_state=None):
    """Sequential recurrence in float64.

    ``x [..., T, H, P]``, ``dt [..., T, H]``, ``A, D [H]``, ``B, C [..., T, G, N]``,
    ``initial_state [..., H, P, N]`` (``A`` may also be per token, ``[..., T, H]``: its gradient then
    shows each token's contribution to the gradient of a shared ``A``).
    Returns ``(y [..., T, H, P], states [..., T+1, H, P, N])``
    with ``states[..., t, :, :, :]`` the state after ``t`` tokens (``states[..., 0]`` = initial).
    """
    x, dt, A, B, C, D = (_d(t) for t in (x, dt, A, B, C, D))
    *lead, t_len, nh, hp = x.shape
    ng, ns = B.shape[-2:]
    heads = torch.arange(nh) // (nh // ng)
    bh, ch = B[..., heads, :], C[..., heads, :]                        # [..., T, H, N]
    h = torch.zeros(*lead, nh, hp, ns, dtype=F64) if initial_state is None else _d(initial_state)
    ys, states = [], [h]
    for t in range(t_len):
        decay = torch.exp(dt[..., t, :] * (A if A.dim() == 1 else A[..., t, :]))                           # [..., H]
        h = decay[..., None, None] * h + (dt[..., t, :, None] * x[..., t, :, :])[..., None] * bh[..., t, :, None, :]
        ys.append((h * ch[..., t, :, None, :]).sum(-1) + D[:, None] * x[..., t, :, :])
        states.append(h)
    y = torch.stack(ys, dim=-3) if ys else x.new_zeros(x.shape)
    return y, torch.stack(states, dim=-4)


def causal_conv1d_f64(x, weight, bias=None, state=None, activation="silu"):
    """Depthwise causal conv in float64, ``y[t, c] = sum_j w[c, j] * xin[t + j, c]`` over ``xin = state ++ x``
    (sliding windows by ``unfold``; float64 ``F.conv1d`` with groups is very slow on CPU); returns ``(y, new_state)``."""
    x, weight, bias, state = (_d(t) for t in (x, weight, bias, state))
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(*x.shape[:-2], k - 1, x.shape[-1])
    xin = torch.cat([state, x], dim=-2)
    y = (xin.unfold(-2, k, 1) * weight).sum(-1)                       # [..., T, C]
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = y * torch.sigmoid(y)
    return y, xin[..., xin.shape[-2] - (k - 1):, :]


def mamba_dt_f64(dt_raw, dt_bias, dt_min=0.0, dt_max=math.inf):
    """``clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)`` in float64 (softplus = log1p(exp))."""
    v = _d(dt_raw) + _d(dt_bias)
    return torch.clamp(torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0)))), dt_min, dt_max)


def gated_rms_norm_f64(y, z, weight, group_size, eps):
    """``(y * silu(z))`` RMS-normalized per group of ``group_size`` channels, times ``weight``, in float64."""
    y, z, weight = _d(y), _d(z), _d(weight)
    h = y * (z * torch.sigmoid(z))
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    return (hg / torch.sqrt((hg * hg).mean(-1, keepdim=True) + eps)).reshape(h.shape) * weight


def relu_squared_f64(x):
    """``relu(x)**2`` in float64."""
    return torch.relu(_d(x)) ** 2
