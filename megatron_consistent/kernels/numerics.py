"""Deterministic building blocks shared by every CPU kernel.

PyTorch's CPU elementwise transcendental functions (``exp``, ``log``, ``sin``…)
take a vectorised path for the body of a buffer and a scalar libm path for its
tail, and the two can differ in the last bit; which element lands in the tail
depends on the buffer length and the thread split, i.e. on the batch.  Its
reductions (``sum``) likewise choose their accumulation order from the shape.
The functions here use only IEEE-754 correctly rounded operations
(``+ - * /``, ``floor``, casts, bit manipulation) applied one
elementwise op at a time, so the value of every element depends on its own
inputs alone — never on its neighbours, the tensor's size or the thread count.

Contract:

* ``exp`` / ``log`` / ``sin`` / ``cos``: evaluated in float64 by range reduction
  and a fixed polynomial (Horner order), rounded once to float32.
* ``tree_sum``: the reduced axis is zero-padded to the next power of two and
  summed by a fixed pairwise tree (element ``i`` pairs with ``i + n/2``).
  The tree depends on the axis length only.
* ``adjacent_tree_sum``: a power-of-two axis summed by the pairwise tree of
  neighbours (``2i`` pairs with ``2i + 1``, level by level), so every aligned
  contiguous run of ``2^j`` elements is one subtree: a sum split across ranks
  by contiguous shards, each rank reducing its own subtree, then the ranks'
  values reduced by the same rule, gives the bits of the whole tree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dispatch import registered

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_TWO_PI_HI = 6.283185307179586  # float64(2*pi)
_TWO_PI_LO = 2.4492935982947064e-16  # 2*pi - _TWO_PI_HI

EXP_COEFFS = [1.0 / math.factorial(k) for k in range(13)]  # Taylor, |r| <= ln2/2
_LOG_COEFFS = [1.0 / (2 * k + 1) for k in range(12)]  # atanh series in t^2
_SIN_COEFFS = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(16)]  # in r^2
_COS_COEFFS = [(-1.0) ** k / math.factorial(2 * k) for k in range(16)]


def _horner(coeffs: list[float], r: torch.Tensor) -> torch.Tensor:
    """sum_k coeffs[k] * r**k by Horner's rule, highest degree first."""
    p = torch.full_like(r, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * r
        p = p + c
    return p


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact 2**n in float64 for integral float64 n in [-1022, 1023]."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp(x: torch.Tensor) -> torch.Tensor:
    """float32 exp(x): float64 range reduction x = n*ln2 + r, Taylor degree 12, one rounding.

    A tensor on another device than the CPU that needs no gradient goes to the implementation registered as ``("exp",
    device)`` if there is one (CUDA: the same arithmetic in one Triton launch, ``kernels/triton/exp.py``; these torch
    ops are some 30 launches)."""
    if x.device.type != "cpu" and not (x.requires_grad and torch.is_grad_enabled()):
        fast = registered("exp", x.device)
        if fast is not None:
            return fast(x)
    return exp_torch(x)


def exp_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`exp` by torch ops on any device (the contract's reference evaluation)."""
    xd = x.to(torch.float64).clamp(-110.0, 90.0)
    n = torch.floor(xd * LOG2E + 0.5)
    r = xd - n * LN2
    y = (_horner(EXP_COEFFS, r) * _pow2(n)).to(torch.float32)
    return torch.where(torch.isnan(x), x.to(torch.float32), y)


def log(x: torch.Tensor) -> torch.Tensor:
    """float32 log(x): float64 x = m*2^e with m in [sqrt(1/2), sqrt(2)), 2*atanh series, one rounding."""
    xd = x.to(torch.float64)
    m, e = torch.frexp(xd)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = torch.where(low, e - 1, e).to(torch.float64)
    t = (m - 1.0) / (m + 1.0)
    lm = (t * 2.0) * _horner(_LOG_COEFFS, t * t)
    y = (e * LN2 + lm).to(torch.float32)
    y = torch.where(xd == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(xd < 0, torch.full_like(y, math.nan), y)
    y = torch.where(torch.isinf(xd) & (xd > 0), torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(xd), torch.full_like(y, math.nan), y)


def sin_cos(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (sin, cos) of float64 angles: Cody-Waite reduction to [-pi, pi], Taylor degree 31."""
    a = angle.to(torch.float64)
    k = torch.floor(a / _TWO_PI_HI + 0.5)
    r = (a - k * _TWO_PI_HI) - k * _TWO_PI_LO
    r2 = r * r
    return (r * _horner(_SIN_COEFFS, r2)).to(torch.float32), _horner(_COS_COEFFS, r2).to(torch.float32)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by a fixed pairwise tree (zero-padded to a power of two)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def adjacent_tree_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over ``dim`` (a power-of-two length) by the tree of neighbours: ``((x0 + x1) + (x2 + x3)) + ...``."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n & (n - 1) or n == 0:
        raise ValueError(f"adjacent_tree_sum needs a power-of-two length, got {n}")
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def ceil_to(n: int, block: int) -> int:
    """Smallest multiple of ``block`` that is >= n."""
    return -(-n // block) * block
