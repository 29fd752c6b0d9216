""":mod:`megatron_consistent.kernels.numerics`' arithmetic as Triton device functions, for kernels that evaluate a
torch contract built on it with the same bits (the SSD scan, the Mamba-2 mixer's elementwise ops).

* :func:`exp_f32`: :func:`numerics.exp` -- float64 clamp to [-110, 90], ``n = floor(x log2 e + 0.5)``, ``r = x - n
  ln 2``, Horner (highest degree first, a multiply then an add), times ``2**n`` (exponent bits), one rounding to
  float32; NaN stays NaN.
* :func:`log_f32`: :func:`numerics.log` -- float64 ``x = m 2**e`` (``frexp`` on the exponent and mantissa bits, a
  subnormal scaled by ``2**54`` first), ``m`` moved to ``[sqrt(1/2), sqrt(2))`` (compared with the float64
  ``sqrt(1/2)``: a bare Python float in a Triton comparison would be rounded to float32 in the compiled kernel),
  ``t = (m - 1) / (m + 1)`` (IEEE float64 division: Triton's ``/`` on float64 is ``div.rn.f64``), ``lm = (2 t) *
  P(t**2)`` (the atanh series by Horner), ``e ln 2 + lm``, one rounding to float32; ``log(0) = -inf``,
  ``log(x < 0) = NaN``, ``log(inf) = inf``, ``log(NaN) = NaN`` (``0x7FC00000``, torch's ``full_like(y, nan)``).
* :func:`tree_rows` / :func:`tree_cols`: :func:`numerics.tree_sum` over one axis of a register tile whose length is a
  power of two (the caller pads with zeros, as ``tree_sum`` does): element ``i`` + element ``i + n/2``, level by level.
* :func:`tree_cols_split`: the same tree as :func:`tree_cols`, its top levels as adds of separately formed column
  slices (no layout change of the whole tile; ``benchmarks/offline_compile_tree.py``).
* :func:`tree_rows_split`: the same for :func:`tree_rows` and row slices.
* :func:`tree_leaves`: ``tree_sum`` of leaves formed one at a time (any tile each), in the tree's own order, its top
  levels in a runtime loop over residue classes where asked (a smaller program to compile).

A caller launches with ``enable_fp_fusion=False``, so every multiply and add is its own IEEE operation, as in torch.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ..numerics import _LOG_COEFFS, _SQRT_HALF, EXP_COEFFS, LN2, LOG2E

_EXP_C: tl.constexpr = tl.constexpr(tuple(EXP_COEFFS))
_EXP_DEGREE: tl.constexpr = tl.constexpr(len(EXP_COEFFS) - 1)
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_LN2: tl.constexpr = tl.constexpr(LN2)
_MAX_LEVELS: tl.constexpr = tl.constexpr(16)  # trees over up to 2**16 elements
_LOG_C: tl.constexpr = tl.constexpr(tuple(_LOG_COEFFS))
_LOG_DEGREE: tl.constexpr = tl.constexpr(len(_LOG_COEFFS) - 1)
_SQRT_HALF_C: tl.constexpr = tl.constexpr(_SQRT_HALF)
_TWO_54: tl.constexpr = tl.constexpr(2.0**54)  # scales a float64 subnormal to a normal number, exactly
_INF: tl.constexpr = tl.constexpr(math.inf)
_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # float32(math.nan), torch's full_like(y, nan)


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
def log_f32(x):
    """float32 ``log(x)`` of float32 or float64 ``x`` with :func:`numerics.log`'s bits (module docstring)."""
    xd = x.to(tl.float64)
    tiny = (xd.to(tl.int64, bitcast=True) & 0x7FF0000000000000) == 0  # zero or subnormal
    xs = tl.where(tiny, xd * _TWO_54, xd)
    bits = xs.to(tl.int64, bitcast=True)
    # frexp: m in [1/2, 1) (the mantissa bits under the exponent of 1/2), e = the unbiased exponent + 1
    e = ((bits >> 52) & 0x7FF) - 1022 - tl.where(tiny, 54, 0)
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    low = m < tl.full(m.shape, _SQRT_HALF_C, tl.float64)  # a float64 constant (a bare one compares as float32)
    m = tl.where(low, m * 2.0, m)
    e = tl.where(low, e - 1, e).to(tl.float64)
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    p = tl.full(xd.shape, _LOG_C[_LOG_DEGREE], tl.float64)
    for j in tl.static_range(_LOG_DEGREE):
        p = p * t2
        p = p + _LOG_C[_LOG_DEGREE - 1 - j]
    lm = (t * 2.0) * p
    y = (e * _LN2 + lm).to(tl.float32)
    nan = tl.full(y.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    y = tl.where(xd == 0.0, -_INF, y)
    y = tl.where(xd < 0.0, nan, y)
    y = tl.where(xd == _INF, _INF, y)
    return tl.where(xd != xd, nan, y)


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


@triton.jit
def tree_cols_split(PRODUCT: tl.constexpr, args, ROWS: tl.constexpr, COLS: tl.constexpr, W: tl.constexpr):
    """:func:`tree_cols` of the ``[ROWS, COLS]`` tile whose columns ``c`` (a ``[W]`` index tensor) are
    ``PRODUCT(args, c)`` (a ``[ROWS, W]`` tile: the caller's loads and products; ``args`` a tuple), with the same bits:
    the same additions of the same pairs in the same order.  Its top levels are adds of the ``COLS / W`` contiguous
    slices of width ``W`` (a power of two <= ``COLS``), each formed on its own: slice ``m`` + slice ``m + COLS / 2W``
    (columns ``i`` and ``i + COLS/2``), then the sums likewise (:func:`tree_leaves` over the slices); the last levels
    are :func:`tree_cols` over ``W``.  The whole tile is never held nor moved between layouts, only the last
    ``[ROWS, W]`` (``benchmarks/offline_compile_tree.py``: at ``[128, 128]``, ``W = 16``, 8x less shared-memory
    traffic than :func:`tree_cols` and a third of its registers)."""
    return tree_cols(_tree_of_leaves(PRODUCT, args, COLS, W, 0, W), ROWS, W)


@triton.jit
def tree_rows_split(PRODUCT: tl.constexpr, args, ROWS: tl.constexpr, COLS: tl.constexpr, W: tl.constexpr):
    """:func:`tree_rows` of the ``[ROWS, COLS]`` tile whose rows ``r`` (a ``[W]`` index tensor) are
    ``PRODUCT(args, r)`` (a ``[W, COLS]`` tile), with the same bits: :func:`tree_cols_split` with rows for columns --
    the top levels adds of the ``ROWS / W`` row slices, each formed on its own, the last :func:`tree_rows` over
    ``W``."""
    return tree_rows(_tree_of_leaves(PRODUCT, args, ROWS, W, 0, W), W, COLS)


@triton.jit
def tree_leaves(LEAF: tl.constexpr, args, N: tl.constexpr, K: tl.constexpr, zero):
    """``tree_sum`` of the ``N`` leaves ``LEAF(args, i)`` (``i`` an index ``0 ..< N``, a runtime one where ``K > 1``;
    ``N`` a power of two; each leaf a tile of one shape, summed elementwise), with its bits, leaf by leaf: no tile
    holds the leaves side by side and none moves between layouts.  ``tree_sum`` pairs leaf ``i`` with ``i + N/2``
    first, so its root is the tree of the even leaves (in their order) plus the tree of the odd ones, and so on down:
    leaf ``i`` enters at the position ``i`` bit-reversed, and depth first at most ``log2 N`` partial sums are live.  A
    leaf past the caller's length must be ``+0`` (the tree's zero padding).

    The top ``log2 K`` levels run in a runtime loop, so the compiled program holds ``N / K`` leaves, not ``N``: the
    tree is the tree of its ``K`` residue classes (class ``c``: leaves ``c, c + K, ...``, its own ``tree_sum`` of
    ``N / K`` leaves, formed unrolled), the classes taken in the top tree's order (``c`` the loop count bit-reversed)
    and combined by a binary counter of partial sums -- at count ``k`` the class sum is added to the partials of the
    levels where ``k`` has its trailing ones (the earlier partial on the left), then kept at the next level; both
    choices are formed and one selected (an add whose result is not taken changes nothing).  ``zero``: a zero tile of
    the leaves' shape.  ``K`` a power of two <= 16 (1: no loop)."""
    if K == 1:
        return _tree_of_leaves(LEAF, args, N, 0, 0, 1)
    s0 = zero
    s1 = zero
    s2 = zero
    s3 = zero
    v = zero
    for k in range(K):
        c = 0
        for bit in tl.static_range(4):
            if (K >> (bit + 1)) > 0:
                c = c * 2 + ((k >> bit) & 1)
        v = _tree_of_leaves(LEAF, args, N // K, 0, 0, 1, c, K)
        carry = k >= 0
        s0, v, carry = _counter_level(s0, v, carry, k, 0)
        if K > 2:
            s1, v, carry = _counter_level(s1, v, carry, k, 1)
        if K > 4:
            s2, v, carry = _counter_level(s2, v, carry, k, 2)
        if K > 8:
            s3, v, carry = _counter_level(s3, v, carry, k, 3)
    return v


@triton.jit
def _counter_level(s, v, carry, k, BIT: tl.constexpr):
    """Level ``BIT`` of :func:`tree_leaves`' binary counter: with the carry on, where bit ``BIT`` of the
    count ``k`` is set ``v`` becomes ``s + v`` (the earlier partial on the left) and the carry stays on, where it is
    clear ``s`` keeps ``v``; returns ``(s, v, carry)``."""
    bit_set = ((k >> BIT) & 1) == 1
    total = s + v
    return tl.where(carry & ~bit_set, v, s), tl.where(carry & bit_set, total, v), carry & bit_set


@triton.jit
def _tree_of_leaves(LEAF: tl.constexpr, args, N: tl.constexpr, W: tl.constexpr, I0: tl.constexpr,
                    STRIDE: tl.constexpr, C0=0, STEP: tl.constexpr = 1):
    """The ``tree_sum`` partial of the leaves ``I0, I0 + STRIDE, I0 + 2 STRIDE, ... < N`` (a residue class): the
    leaf itself where ``STRIDE = N``, else that of ``I0`` + that of ``I0 + STRIDE`` with the stride doubled.  Leaf
    ``i`` is ``LEAF(args, C0 + STEP i)`` (``W = 0``; ``C0`` may be a runtime index: leaf ``i`` of a class of a larger
    tree) or the ``W`` columns from ``i``, ``LEAF(args, arange(0, W) + i)``."""
    if STRIDE == N:
        if W == 0:
            return LEAF(args, C0 + STEP * I0)
        else:
            return LEAF(args, tl.arange(0, W) + I0)  # (tensor first: the interpreter wraps constexpr + tensor)
    else:
        return (_tree_of_leaves(LEAF, args, N, W, I0, STRIDE * 2, C0, STEP)
                + _tree_of_leaves(LEAF, args, N, W, I0 + STRIDE, STRIDE * 2, C0, STEP))
