"""Mamba-2 depthwise causal conv1d forward on CUDA (Triton): :mod:`megatron_consistent.kernels.causal_conv1d`'s
contract in one kernel.

:func:`causal_conv1d_triton` has ``_causal_conv1d_cpu``'s signature and results.  One program a (row of the leading
dims, block of positions, block of channels); with ``xin = state ++ x`` (the state cast to ``x.dtype`` by torch, as
there), tap ``j`` of position ``t`` reads ``state[t + j]`` for ``t + j < K - 1`` and ``x[t + j - (K - 1)]`` otherwise:

* ``acc = float32(w[c, 0]) * float32(xin[t, c])``, then for ``j = 1..K-1`` in that order ``acc = acc + float32(w[c, j])
  * float32(xin[t + j, c])``; then ``acc = acc + float32(bias[c])``;
* ``"silu"``: ``acc = div_rn(acc, 1 + exp(-acc))`` with :func:`numerics.exp_f32` (:func:`numerics.exp`'s float64
  arithmetic: clamp, range reduction, Horner order, one rounding); ``None``: identity;
* ``y = acc`` rounded once to ``x.dtype`` (round to nearest even, as torch's cast).

The launch disables Triton's mul-add fusion (``enable_fp_fusion=False``), so every multiply and add is its own IEEE
operation, and the division is ``div_rn`` (Triton's ``/`` on float32 is not IEEE-rounded on the GPU).  So this is not
a new contract but another evaluation of the torch one, with its bits on the same device: in Triton's interpreter on
CPU tensors those of ``_causal_conv1d_cpu`` (tests/test_triton_interpret_conv1d.py), on the GPU those of the same
torch code on CUDA tensors (tests/test_gpu_conv1d.py).  An output depends on its own ``K`` inputs only: not on the
batch, on ``T``, on the blocks or on how the sequence was cut into pieces.  ``new_state`` (the last ``K - 1`` rows of
``xin``) is a copy made with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import exp_f32

ACTIVATIONS = ("silu", None)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _tap(X, S, W, row, t, c, out, sx_row, sx_t, sx_c, C, j: tl.constexpr, K: tl.constexpr):
    """``float32(w[c, j]) * float32(xin[t + j, c])`` for a [BT, BC] tile."""
    i = t + j - (K - 1)  # xin row t + j: state row K - 1 + i when i < 0, else x row i
    in_x = (i >= 0)[:, None]
    xv = tl.load(X + row * sx_row + i[:, None] * sx_t + c[None, :] * sx_c, mask=out & in_x, other=0.0)
    sv = tl.load(S + (row * (K - 1) + (K - 1) + i[:, None]) * C + c[None, :], mask=out & ~in_x, other=0.0)
    w = tl.load(W + c * K + j, mask=c < C, other=0.0)
    return w[None, :] * tl.where(in_x, xv, sv).to(tl.float32)


# The token counts are not specialised and the position block is 1 (decode) or 16 (any prefill): Triton compiles a
# binary per ``== 1`` / ``% 16`` class of an integer argument and per constexpr value, and a hybrid rollout compiled
# ``n_t_blocks == 1`` (a prefill piece of at most 16 tokens) inside a timed pass (session 46, H100).  Index arithmetic
# and masks only (an output's taps, in order, are its own lane's): never a bit.
@triton.jit(do_not_specialize=["T", "n_t_blocks"])
def _causal_conv1d_kernel(X, S, W, B, Y, T, C, n_t_blocks, sx_row, sx_t, sx_c, K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    row = (tl.program_id(0) // n_t_blocks).to(tl.int64)
    t = ((tl.program_id(0) % n_t_blocks) * BT + tl.arange(0, BT)).to(tl.int64)  # t * strides: int64
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    out = (t < T)[:, None] & (c < C)[None, :]
    acc = _tap(X, S, W, row, t, c, out, sx_row, sx_t, sx_c, C, 0, K)
    for j in tl.static_range(1, K):  # taps in order, a product then a sum each
        acc = acc + _tap(X, S, W, row, t, c, out, sx_row, sx_t, sx_c, C, j, K)
    if HAS_BIAS:
        acc = acc + tl.load(B + c, mask=c < C, other=0.0)[None, :]
    if SILU:
        acc = tl.math.div_rn(acc, 1.0 + exp_f32(-acc))
    tl.store(Y + (row * T + t[:, None]) * C + c[None, :], acc.to(Y.dtype.element_ty), mask=out)


def causal_conv1d_triton(x, weight, bias, state, activation):
    """``_causal_conv1d_cpu(x, weight, bias, state, activation) -> (y, new_state)`` with its bits (module docstring):
    ``x [..., T, C]`` (bf16 / fp16 / fp32, any strides), ``weight [C, K]``, ``bias [C]`` or ``None``, ``state [...,
    K-1, C]``, ``activation`` ``"silu"`` or ``None``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_triton: unsupported activation {activation!r} (supported: 'silu', None)")
    if x.dim() < 2 or x.dtype not in DTYPES:
        raise ValueError(f"causal_conv1d_triton: x {tuple(x.shape)} {x.dtype} is not [..., T, C] of bf16/fp16/fp32")
    *lead, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"causal_conv1d_triton: weight {tuple(weight.shape)} is not [C={C}, K >= 1]")
    K = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv1d_triton: bias {tuple(bias.shape)} is not [C={C}]")
    if state is None or tuple(state.shape) != (*lead, K - 1, C):
        raise ValueError(f"causal_conv1d_triton: state {None if state is None else tuple(state.shape)} is not "
                         f"{(*lead, K - 1, C)}")
    s = state.to(x.dtype)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        x3 = x.reshape(-1, T, C)  # a view for column slices of a wider tensor (the engine's zxbcdt.split)
        bt, bc = (1 if T == 1 else 16), min(256, triton.next_power_of_2(C))  # 2 binaries a model: decode, prefill
        n_t_blocks = triton.cdiv(T, bt)
        wf = weight.to(torch.float32).contiguous()
        _causal_conv1d_kernel[(x3.shape[0] * n_t_blocks, triton.cdiv(C, bc))](
            x3, s.contiguous(), wf, wf if bias is None else bias.to(torch.float32).contiguous(), y, T, C, n_t_blocks,
            *x3.stride(), K=K, HAS_BIAS=bias is not None, SILU=activation == "silu", BT=bt, BC=bc, num_warps=4,
            enable_fp_fusion=False)
    new_state = torch.cat([s[..., min(T, K - 1):, :], x[..., max(T - K + 1, 0):, :]], dim=-2)  # last K-1 of s ++ x
    return y, new_state
