"""GPU (CUDA): the Triton forwards of the Mamba-2 mixer's gated RMSNorm and ``dt``
(``kernels/triton/gated_rms_norm.py``, ``kernels/triton/mamba_dt.py``) against the torch contract functions
(``_gated_rms_norm_cpu``, ``_mamba_dt_cpu``) run on the same CUDA tensors: bit for bit (``torch.equal`` on integer
views, NaN included), at Nemotron-H 8B's widths and at small property shapes.

On the GPU every op of the torch evaluation is an IEEE operation (float32 ``/`` and ``sqrt`` correctly rounded, no
mul-add contraction across its separate kernels), so these comparisons also see what the interpreter tests cannot:
Triton's approximate float32 ``/`` / ``sqrt`` / ``rsqrt`` where ``div_rn`` / ``sqrt_rn`` belong, a fused multiply-add,
``tl.minimum`` / ``tl.maximum`` dropping a NaN, torch's CUDA division by a Python int (a multiply by the float32
reciprocal).  The reference's ``exp`` / ``log`` are pinned to the torch-op evaluation (``numerics.exp_torch`` /
``log_torch`` where a faster registered one exists).  Skipped without CUDA.  Inputs are drawn on the CPU (seeded
generators) and copied to the GPU.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the Triton gated RMSNorm / mamba_dt forwards")]

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from megatron_consistent.kernels.triton import gated_rms_norm as tgn
    from megatron_consistent.kernels.triton import mamba_dt as tdt
    from megatron_consistent.kernels.triton import numerics as tnum

from megatron_consistent.kernels import numerics, ssd

gnorm = importlib.import_module("megatron_consistent.kernels.gated_rms_norm")  # the package re-exports the function

DEV = torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
INT_VIEW = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}
INF = math.inf
CLAMPS = [(0.0, INF), (1e-3, 0.1), (-INF, INF)]


@pytest.fixture(autouse=True)
def _torch_op_reference(monkeypatch):
    """The reference functions' ``exp`` / ``log`` as torch ops (a registered fast path, if any, left out)."""
    monkeypatch.setattr(gnorm, "exp", getattr(numerics, "exp_torch", numerics.exp))
    monkeypatch.setattr(ssd, "exp", getattr(numerics, "exp_torch", numerics.exp))
    monkeypatch.setattr(ssd, "log", getattr(numerics, "log_torch", numerics.log))


def assert_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    a, b = out.view(INT_VIEW[out.dtype]), ref.view(INT_VIEW[ref.dtype])
    differ = a != b
    assert not differ.any(), f"{differ.sum().item()} of {out.numel()} outputs differ"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- gated RMSNorm


def _check_norm(y, z, w, group_size, eps=1e-5):
    out = tgn.gated_rms_norm_triton(y, z, w, group_size, eps)
    assert_bits(out, gnorm._gated_rms_norm_cpu(y, z, w, group_size, eps))
    return out


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_gated_norm_nemotron_h_8b(rows):
    """D = 8192 in 8 groups of 1024, bf16; ``z`` and ``y`` column slices of one projection row (the engine's)."""
    g = _gen(rows)
    d, gs = 8192, 1024
    proj = (torch.randn(rows, 2 * d + 640, generator=g) * 2).to(BF16).to(DEV)
    z, y = proj[:, :d], proj[:, d + 640:]
    w = (torch.randn(d, generator=g) * 0.2 + 1).to(BF16).to(DEV)
    out = _check_norm(y, z, w, gs)
    assert torch.equal(tgn.gated_rms_norm_triton(y, z, w, gs, 1e-5), out)  # run to run
    if rows > 1:  # a row alone: the bits it has in the batch
        assert torch.equal(tgn.gated_rms_norm_triton(y[rows // 2:rows // 2 + 1], z[rows // 2:rows // 2 + 1], w, gs,
                                                     1e-5), out[rows // 2:rows // 2 + 1])


@pytest.mark.parametrize("dtype", [BF16, F32, F16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("group_size,n_groups", [(1, 4), (3, 3), (8, 3), (24, 2), (64, 3), (1024, 2), (1000, 1)])
def test_gated_norm_property_shapes(group_size, n_groups, rows, dtype):
    """Group sizes that are not powers of two too (torch's CUDA ``/ group_size`` is a multiply by the reciprocal)."""
    g = _gen(group_size * 7 + rows)
    d = group_size * n_groups
    y = (torch.randn(2, rows, d, generator=g) * 2).to(dtype).to(DEV)
    z = (torch.randn(2, rows, d, generator=g) * 4).to(dtype).to(DEV)
    w = torch.randn(d, generator=g).to(DEV)
    for eps in (1e-5, 0.1):
        _check_norm(y, z, w, group_size, eps)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gated_norm_special_values(dtype):
    """Large ``|z|`` (exp's clamps, float32 overflow of ``1 + exp(-z)``), inf / NaN gates and inputs, all-zero groups,
    subnormals, ``h * h`` overflowing and underflowing."""
    gs = 8
    edges = torch.tensor([80.0, 88.5, 89.0, 90.0, 91.0, 110.0, 111.0, 1e30, -80.0, -88.5, -89.0, -90.0, -91.0, -110.0,
                          -111.0, -1e30, 0.0, -0.0, 1e-40, -1e-40, INF, -INF, math.nan, 3e38])
    g = _gen(5)
    y = torch.randn(12, 4 * gs, generator=g) * 2
    z = torch.randn(12, 4 * gs, generator=g) * 3
    z[:3].view(-1)[:edges.numel()] = edges
    y[6, 1], y[7, gs + 3], y[8, 2] = math.nan, INF, -INF
    y[9, :gs] = 0
    y[10, gs:2 * gs] = 1e30
    y[11, :] = 1e-30
    w = torch.randn(4 * gs, generator=g)
    _check_norm(y.to(dtype).to(DEV), z.to(dtype).to(DEV), w.to(DEV), gs)
    _check_norm(y.to(dtype).to(DEV), z.to(dtype).to(DEV), w.to(DEV), gs, 0.0)


def test_gated_norm_strided_views():
    g = _gen(9)
    d, gs = 96, 24
    proj = torch.randn(3, 5, 3 * d, generator=g).to(BF16).to(DEV)
    w = torch.randn(d, generator=g).to(DEV)
    _check_norm(proj[..., d:2 * d], proj[..., :d], w, gs)
    _check_norm(proj[..., d:2 * d].transpose(0, 1), proj[..., :d].transpose(0, 1), w, gs)
    _check_norm(proj[..., 0:2 * d:2], proj[..., 1:2 * d:2], w, gs)


# --------------------------------------------------------------------------- mamba_dt


def _check_dt(dt_raw, dt_bias, dt_min, dt_max):
    out = tdt.mamba_dt_triton(dt_raw, dt_bias, dt_min, dt_max)
    assert_bits(out, ssd._mamba_dt_cpu(dt_raw, dt_bias, dt_min, dt_max))
    return out


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_mamba_dt_nemotron_h_8b(rows, dtype):
    """H = 128 heads, ``dt_raw`` the last columns of the input projection (row stride > H), Nemotron-H's bias range."""
    g = _gen(rows)
    proj = (torch.randn(rows, 2 * 8192 + 2 * 1024 + 128, generator=g) * 3).to(dtype).to(DEV)
    raw = proj[:, -128:]
    bias = (torch.rand(128, generator=g) * 6 - 7).to(DEV)  # inverse softplus of dt in [1e-3, 0.1]
    for dt_min, dt_max in CLAMPS:
        _check_dt(raw, bias, dt_min, dt_max)


def _v_values() -> torch.Tensor:
    twenty = torch.tensor([20.0, -20.0])
    around = torch.cat([torch.nextafter(twenty, twenty * 2), torch.nextafter(twenty, twenty * 0)])
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, -104.0, -110.0, -111.0, 1e30, -1e30, INF, -INF,
                            math.nan])
    grid = torch.linspace(-30, 30, 60001)
    return torch.cat([grid, twenty, around, special, torch.randn(4000, generator=_gen(0)) * 8])


@pytest.mark.parametrize("dt_min,dt_max", CLAMPS + [(0.0, 0.0), (1e-4, 100.0)])
def test_mamba_dt_across_the_branches(dt_min, dt_max):
    v = _v_values()
    heads = 16
    raw = v[: v.numel() // heads * heads].reshape(-1, heads).to(DEV)
    _check_dt(raw, torch.zeros(heads, device=DEV), dt_min, dt_max)
    _check_dt(raw, (torch.randn(heads, generator=_gen(1)) * 3).to(DEV), dt_min, dt_max)


@pytest.mark.parametrize("heads", [1, 3, 24, 128, 300])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_mamba_dt_property_shapes(heads, rows):
    g = _gen(heads + rows)
    raw = (torch.randn(2, rows, heads, generator=g) * 10).to(DEV)
    bias = torch.randn(heads, generator=g).to(DEV)
    out = _check_dt(raw, bias, 0.0, INF)
    _check_dt(raw.to(BF16), bias, 1e-3, 0.1)
    assert torch.equal(tdt.mamba_dt_triton(raw[:, :1], bias, 0.0, INF), out[:, :1])  # rows alone


def test_log_is_the_torch_log():
    """``log_f32`` alone against ``numerics.log``'s torch ops on the GPU: random float64 bits over the whole range,
    mantissas between ``float32(sqrt(1/2))`` and ``sqrt(1/2)`` (the reduction's float64 threshold: a bare Python
    constant in a Triton comparison is rounded to float32 in the compiled kernel, not in the interpreter),
    subnormals, the special cases, ``1 + exp(v)``."""
    @triton.jit
    def _probe(X, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, tnum.log_f32(tl.load(X + i, mask=i < n, other=1.0)), mask=i < n)

    g = _gen(2)
    bits = (torch.randint(1, 2047, (200000,), generator=g, dtype=torch.int64) << 52) | torch.randint(
        0, 1 << 52, (200000,), generator=g, dtype=torch.int64)
    s = numerics._SQRT_HALF
    sliver = torch.linspace(float(torch.tensor(s).float()), s, 1001, dtype=torch.float64)
    sliver = torch.cat([sliver * 2.0 ** k for k in (-1040, -3, 0, 1, 9, 900)])
    special = torch.tensor([5e-324, 1e-310, 0.0, -0.0, -1.0, INF, -INF, math.nan], dtype=torch.float64)
    one_plus = 1.0 + numerics.exp(torch.linspace(-20, 20, 40001)).double()
    x = torch.cat([bits.view(torch.float64), sliver, special, one_plus]).to(DEV)
    out = torch.empty(x.shape, dtype=F32, device=DEV)
    _probe[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, enable_fp_fusion=False)
    assert_bits(out, getattr(numerics, "log_torch", numerics.log)(x))
