""":mod:`megatron_consistent.kernels.numerics`' arithmetic as Triton device functions, for kernels that evaluate a
torch contract built on it with the same bits (the SSD scan, the Mamba-2 mixer's elementwise ops).

* :func:`exp_f32`: :func:`numerics.exp` -- float64 clamp to [-110, 90], ``n = floor(x log2 e + 0.5)``, ``r = x - n
  ln 2``, Horner (highest degree first, a multiply then an add), times ``2**n`` (exponent bits), one rounding to
  float32; NaN stays NaN.
* :func:`tree_rows` / :func:`tree_cols`: :func:`numerics.tree_sum` over one axis of a register tile whose length is a
  power of two (the caller pads with zeros, as ``tree_sum`` does): element ``i`` + element ``i + n/2``, level by level.

A caller launches with ``enable_fp_fusion=False``, so every multiply and add is its own IEEE operation, as in torch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..numerics import EXP_COEFFS, LN2, LOG2E

_EXP_C: tl.constexpr = tl.constexpr(tuple(EXP_COEFFS))
_EXP_DEGREE: tl.constexpr = tl.constexpr(len(EXP_COEFFS) - 1)
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_LN2: tl.constexpr = tl.constexpr(LN2)
_MAX_LEVELS: tl.constexpr = tl.constexpr(16)  # trees over up to 2**16 elements


@triton.jit
def exp_f32(x):
    """float32 ``exp(x)`` with :func:`numerics.exp`'s bits (module docstring)."""
    xd = tl.minimum(tl.maximum(x.to(tl.float64), -110.0), 90.0)
    n = tl.floor(xd * _LOG2E + 0.5)
    r = xd - n * _LN2
    p = tl.full(xd.shape, _EXP_C[_EXP_DEGREE], tl.float64)
    for j in tl.static_range(_EXP_DEGREE):
        p = p * r
        p = p + _EXP_C[_EXP_DEGREE - 1 - j]
    two_n = ((n.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    y = (p * two_n).to(tl.float32)
    return tl.where(x != x, x, y)


@triton.jit
def tree_rows(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``tree_sum`` over axis 0 of ``v [ROWS, COLS]`` (ROWS a power of two): row ``i`` + row ``i + ROWS/2``, level by
    level; returns ``[COLS]``."""
    for level in tl.static_range(_MAX_LEVELS):
        if (ROWS >> level) > 1:
            lo, hi = tl.split(tl.permute(tl.reshape(v, (2, ROWS >> (level + 1), COLS)), (1, 2, 0)))
            v = lo + hi
    return tl.reshape(v, (COLS,))


@triton.jit
def tree_cols(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``tree_sum`` over axis 1 of ``v [ROWS, COLS]`` (COLS a power of two); returns ``[ROWS]``."""
    for level in tl.static_range(_MAX_LEVELS):
        if (COLS >> level) > 1:
            lo, hi = tl.split(tl.permute(tl.reshape(v, (ROWS, 2, COLS >> (level + 1))), (0, 2, 1)))
            v = lo + hi
    return tl.reshape(v, (ROWS,))
