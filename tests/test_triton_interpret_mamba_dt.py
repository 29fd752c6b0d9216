"""The CUDA ``mamba_dt`` kernel (``kernels/triton/mamba_dt.py``) and the Triton ``log``
(``kernels/triton/numerics.py``'s ``log_f32``) in Triton's interpreter (CPU tensors): the bits of the contract's
torch evaluation (``kernels/ssd.py``'s ``_mamba_dt_cpu``, ``kernels/numerics.py``'s ``log``).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable, like the other ``test_triton_interpret_*`` files.  The
interpreter runs each Triton operation as one numpy operation, IEEE like torch's CPU elementwise ops, so the kernel
must give ``_mamba_dt_cpu``'s bits exactly: the thresholds at +-20 (``>`` and ``<``, 20 itself on the log branch), the
``exp`` and ``log`` arithmetic (float64 ``frexp`` by bits, the atanh series), the clamp's bounds rounded to float32
and its NaN (the log's NaN constant passes through, bit for bit).  The interpreter cannot tell IEEE ``div_rn`` from
Triton's approximate float32 ``/`` (both are numpy's division there); the GPU test (tests/test_gpu_gated_norm_dt.py)
does.  The interpreter converts bfloat16 subnormals to float32 wrongly, so the bf16 inputs here have none.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

import triton
import triton.language as tl

from megatron_consistent.kernels import numerics, ssd
from megatron_consistent.kernels.triton import mamba_dt as tdt
from megatron_consistent.kernels.triton import numerics as tnum

INF = math.inf
CLAMPS = [(0.0, INF), (1e-3, 0.1), (-INF, INF), (0.0, 0.0), (1e-4, 100.0)]


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
    differ = out.view(torch.int32) != ref.view(torch.int32)
    assert not differ.any(), f"{differ.sum().item()} of {out.numel()} outputs differ"


def _check(dt_raw, dt_bias, dt_min, dt_max):
    out = tdt.mamba_dt_triton(dt_raw, dt_bias, dt_min, dt_max)
    assert_same_bits(out, ssd._mamba_dt_cpu(dt_raw, dt_bias, dt_min, dt_max))
    return out


def _v_values() -> torch.Tensor:
    """``v`` across [-30, 30]: a fine grid, +-20 and its float32 neighbours, the log branch's extremes, the exp clamp
    and float32 underflow, infinities and NaN."""
    twenty = torch.tensor([20.0, -20.0])
    around = torch.cat([torch.nextafter(twenty, twenty * 2), torch.nextafter(twenty, twenty * 0),
                        torch.nextafter(torch.nextafter(twenty, twenty * 2), twenty * 2)])
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 19.999, -19.999, 20.001, -20.001, 88.0, -88.0,
                            -103.0, -104.0, -110.0, -111.0, -1e30, 1e30, INF, -INF, math.nan])
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.linspace(-30, 30, 6001), twenty, around, special, torch.randn(2000, generator=g) * 8])


@pytest.mark.parametrize("dt_min,dt_max", CLAMPS)
def test_v_across_the_branches(dt_min, dt_max):
    v = _v_values()
    heads = 8
    raw = v[: v.numel() // heads * heads].reshape(-1, heads)
    _check(raw, torch.zeros(heads), dt_min, dt_max)
    out = _check(raw.t().contiguous()[:, :heads].contiguous(), torch.zeros(heads), dt_min, dt_max)  # other rows
    if math.isinf(dt_max):
        assert torch.isnan(_check(torch.tensor([[math.nan]]), torch.zeros(1), dt_min, dt_max)).all()
    assert out.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("heads", [1, 3, 8, 24, 128, 300])
def test_shapes_and_dtypes(heads, rows, dtype):
    """Head counts that are and are not powers of two, over one column block (256) too; bias nonzero."""
    g = torch.Generator().manual_seed(heads * 100 + rows)
    raw = (torch.randn(rows, heads, generator=g) * 6).to(dtype)
    bias = torch.randn(heads, generator=g) * 3
    for dt_min, dt_max in CLAMPS[:2]:
        _check(raw, bias, dt_min, dt_max)
    _check(raw, bias.to(dtype), 0.0, INF)


def test_leading_dims_and_column_slices():
    """``dt_raw [b, t, H]`` as a column slice of the input projection (row stride > H), a non-collapsible view
    (copied), a strided head dim (copied)."""
    g = torch.Generator().manual_seed(1)
    heads = 12
    proj = (torch.randn(3, 7, 100, generator=g) * 10).to(torch.bfloat16)
    raw = proj[..., 80:80 + heads]
    bias = torch.randn(heads, generator=g)
    out = _check(raw, bias, 1e-3, 0.1)
    assert out.shape == (3, 7, heads) and out.is_contiguous()
    _check(raw.transpose(0, 1), bias, 0.0, INF)
    _check(proj[..., : 2 * heads: 2], bias, 0.0, INF)
    _check(proj[0, 0, :heads], bias, 0.0, INF)  # no leading dims


def test_special_inputs_in_dt_raw_and_bias():
    """NaN / inf in ``dt_raw`` or in the bias: NaN stays NaN through the clamp, +inf is ``v``, -inf is
    ``exp(v) = 0``."""
    raw = torch.tensor([[math.nan, INF, -INF, 1.0], [0.0, -25.0, 25.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, math.nan])
    for dt_min, dt_max in CLAMPS:
        out = _check(raw, bias, dt_min, dt_max)
        assert torch.isnan(out[:, 3]).all() and torch.isnan(out[0, 0])


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), heads=st.integers(1, 70), scale=st.sampled_from([1.0, 10.0, 25.0, 100.0]),
       seed=st.integers(0, 10_000), bf16=st.booleans(), clamp=st.sampled_from(CLAMPS))
def test_property_random_inputs(rows, heads, scale, seed, bf16, clamp):
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(rows, heads, generator=g) * scale).to(torch.bfloat16 if bf16 else torch.float32)
    _check(raw, torch.randn(heads, generator=g), *clamp)


def test_empty_inputs():
    for shape in [(0, 8), (2, 0, 8)]:
        out = tdt.mamba_dt_triton(torch.empty(shape), torch.zeros(8), 0.0, INF)
        assert out.shape == shape and out.dtype == torch.float32
    assert tdt.mamba_dt_triton(torch.empty(5, 0), torch.zeros(0), 0.0, INF).shape == (5, 0)


@pytest.mark.parametrize("raw,bias,lo,hi,message", [
    ((4, 8), (7,), 0.0, INF, "does not match"),
    ((4, 8), (4, 8), 0.0, INF, "does not match"),
    ((4, 8), (8,), 1.0, 0.5, "dt_min"),
    ((), (1,), 0.0, INF, "head dim"),
])
def test_bad_shapes_are_refused(raw, bias, lo, hi, message):
    with pytest.raises(ValueError, match=message):
        tdt.mamba_dt_triton(torch.zeros(raw), torch.zeros(bias), lo, hi)


# --------------------------------------------------------------------------- log_f32 alone


@triton.jit
def _log_probe(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tnum.log_f32(tl.load(X + i, mask=i < n, other=1.0)), mask=i < n)


def _triton_log(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32)
    _log_probe[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def _log_inputs() -> torch.Tensor:
    """float64: random positive normals over the whole exponent range (random mantissa bits), mantissas at and around
    sqrt(1/2), subnormals, zeros, negatives, infinities, NaN, and ``1 + exp(v)`` for ``v`` in [-20, 20]."""
    g = torch.Generator().manual_seed(2)
    mant = torch.randint(0, 1 << 52, (4000,), generator=g, dtype=torch.int64)
    expo = torch.randint(1, 2047, (4000,), generator=g, dtype=torch.int64)
    normals = ((expo << 52) | mant).view(torch.float64)
    s = torch.tensor(numerics._SQRT_HALF, dtype=torch.float64)
    edge = torch.stack([s, torch.nextafter(s, s * 0), torch.nextafter(s, s * 2)])
    # mantissas between float32(sqrt(1/2)) and sqrt(1/2): moved to [1, sqrt(2)) only if the constant is float64
    sliver = torch.linspace(float(s.float()), float(s), 1001, dtype=torch.float64)
    edge = torch.cat([t * 2.0 ** k for k in (-1060, -3, 0, 1, 7, 1000) for t in (edge, sliver)])
    sub = torch.tensor([5e-324, 1e-310, 2.2250738585072e-308, 1e-320], dtype=torch.float64)
    special = torch.tensor([0.0, -0.0, -1.0, -1e-310, -INF, INF, math.nan, 1.0, 2.0, 0.5, 1.0 + 2.0 ** -52],
                           dtype=torch.float64)
    v = torch.linspace(-20, 20, 4001)
    one_plus = 1.0 + numerics.exp(v).to(torch.float64)
    return torch.cat([normals, edge, sub, special, one_plus])


def test_log_is_the_contract_log():
    x = _log_inputs()
    assert_same_bits(_triton_log(x), numerics.log(x))
    x32 = torch.cat([torch.rand(3000) * 100, torch.tensor([1e-40, 1e-45, 0.0, -2.0, INF, math.nan])])
    assert_same_bits(_triton_log(x32), numerics.log(x32))  # float32 arguments


# --------------------------------------------------------------------------- broken variants are caught


@pytest.mark.parametrize("k,rel", [(0, 1e-8), (1, 1e-6)])
def test_a_perturbed_log_coefficient_is_caught(monkeypatch, k, rel):
    """One coefficient of the atanh series moved (relative ``rel``): the comparisons see it.  (A change of the
    higher coefficients' last bits is below float32's resolution, ``t**(2k) <= 0.03**k``: the outputs keep their
    bits.)"""
    coeffs = list(numerics._LOG_COEFFS)
    coeffs[k] *= 1 + rel
    monkeypatch.setattr(tnum, "_LOG_C", tl.constexpr(tuple(coeffs)))
    with pytest.raises(AssertionError, match="outputs differ"):
        test_log_is_the_contract_log()
    with pytest.raises(AssertionError, match="outputs differ"):
        test_v_across_the_branches(0.0, INF)


@triton.jit
def _log_without_low_mantissas(x):
    """A different reduction: the mantissa kept in [1/2, 1) (no move to [sqrt(1/2), sqrt(2)))."""
    xd = x.to(tl.float64)
    bits = xd.to(tl.int64, bitcast=True)
    e = (((bits >> 52) & 0x7FF) - 1022).to(tl.float64)
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    t = (m - 1.0) / (m + 1.0)
    p = tl.full(xd.shape, tnum._LOG_C[tnum._LOG_DEGREE], tl.float64)
    for j in tl.static_range(tnum._LOG_DEGREE):
        p = p * (t * t)
        p = p + tnum._LOG_C[tnum._LOG_DEGREE - 1 - j]
    return ((e * tnum._LN2) + (t * 2.0) * p).to(tl.float32)


def test_a_broken_log_is_caught(monkeypatch):
    monkeypatch.setattr(tdt, "log_f32", _log_without_low_mantissas)
    with pytest.raises(AssertionError, match="outputs differ"):
        test_v_across_the_branches(0.0, INF)
