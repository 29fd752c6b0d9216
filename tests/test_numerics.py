"""The deterministic building blocks of :mod:`megatron_consistent.kernels.numerics`.

Two kinds of checks:

* placement independence, compared with ``torch.equal``: the value computed
  for an element (``exp``, ``log``, ``sin_cos``) or for a row (``tree_sum``)
  is the same whatever the tensor's length, the element's offset, the memory
  layout, the neighbouring rows and the thread count;
* accuracy sanity checks against a float64 reference: ``exp`` and ``log``
  within 1 float32 ulp (they are float64 evaluations rounded once, so the
  float64-rounded reference can differ from them only in the last place);
  ``sin_cos`` within 2**-24 absolute (see its test for why not ulps).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_consistent.kernels import numerics

f32 = st.floats(width=32, allow_nan=False)
seeds = st.integers(0, 2**32 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ordinal(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 such that adjacent representable floats differ by 1 (and -0 == +0)."""
    i = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _ulps(y: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps between ``y`` and the float64 reference rounded (correctly) to float32."""
    return (_ordinal(y) - _ordinal(ref64.to(torch.float32))).abs()


def _embed(gen, value: torch.Tensor, length: int, offset: int, low: float, high: float, dtype) -> torch.Tensor:
    """A random tensor of ``length`` elements in [low, high) holding ``value`` at ``offset``."""
    t = (torch.rand(length, generator=gen, dtype=torch.float64) * (high - low) + low).to(dtype)
    t[offset] = value
    return t


# --------------------------------------------------------------------------- placement independence

ELEMENTWISE = {
    "exp": (lambda t: numerics.exp(t), torch.float32, -120.0, 100.0),
    "log": (lambda t: numerics.log(t), torch.float32, 1e-30, 1e30),
    "sin": (lambda t: numerics.sin_cos(t)[0], torch.float64, 0.0, 2e5),
    "cos": (lambda t: numerics.sin_cos(t)[1], torch.float64, 0.0, 2e5),
    # torch's own float32 sqrt (the norms' ``rstd``): on the AVX-512 CPUs here not correctly rounded for about 0.7 %
    # of values (session 25), but a function of the value alone -- what these tests pin
    "sqrt": (torch.sqrt, torch.float32, 0.0, 2e5),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
@given(data=st.data(), seed=seeds, length=st.integers(1, 3000))
def test_elementwise_value_independent_of_length_and_offset(name, data, seed, length):
    fn, dtype, low, high = ELEMENTWISE[name]
    if name == "log":
        x = data.draw(st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, width=32), label="x")
    elif name == "exp":
        x = data.draw(f32, label="x")
    else:
        x = data.draw(st.floats(0.0, 2e5), label="x")
    value = torch.tensor(x, dtype=dtype)
    alone = fn(value[None])
    offset = data.draw(st.integers(0, length - 1), label="offset")
    gen = _gen(seed)
    t = _embed(gen, value, length, offset, low, high, dtype)
    assert torch.equal(fn(t)[offset : offset + 1], alone)
    # Same element inside a non-contiguous 2-D view (transposed, so its neighbours in memory differ).
    rows = data.draw(st.integers(1, 7), label="rows")
    grid = _embed(gen, value, rows * length, offset * rows, low, high, dtype).reshape(length, rows).t()
    assert torch.equal(fn(grid)[0, offset : offset + 1], alone)
    assert torch.equal(fn(t), fn(t))  # repeat


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_independent_of_thread_count(name, torch_threads):
    """Large enough (> torch's 32768-element grain) for the work to be split between threads."""
    fn, dtype, low, high = ELEMENTWISE[name]
    gen = _gen(7)
    t = (torch.rand(200_003, generator=gen, dtype=torch.float64) * (high - low) + low).to(dtype)
    with torch_threads(1):
        one = fn(t)
    with torch_threads(2):
        two = fn(t)
    assert torch.equal(one, two)
    assert torch.equal(one[-7:], fn(t[-7:]))  # the tail of the buffer, alone


def _reference_tree_sum(row: np.ndarray) -> np.float32:
    """The contract's tree in numpy float32 scalars: pad to a power of two, element i pairs with i + n/2."""
    vals = [np.float32(v) for v in row]
    width = 1
    while width < len(vals):
        width *= 2
    vals += [np.float32(0.0)] * (width - len(vals))
    while len(vals) > 1:
        half = len(vals) // 2
        vals = [np.float32(vals[i] + vals[i + half]) for i in range(half)]
    return vals[0]


@given(data=st.data(), seed=seeds, n=st.integers(1, 200), scale=st.sampled_from([1.0, 1e-3, 1e4]))
def test_tree_sum_row_independent_of_neighbours_and_matches_the_tree(data, seed, n, scale, torch_threads):
    gen = _gen(seed)
    row = torch.randn(n, generator=gen) * scale
    others = data.draw(st.integers(0, 20), label="other rows")
    position = data.draw(st.integers(0, others), label="position")
    batch = torch.randn(others + 1, n, generator=gen) * scale
    batch[position] = row
    with torch_threads(data.draw(st.sampled_from([1, 2]), label="threads")):
        in_batch = numerics.tree_sum(batch)[position]
    alone = numerics.tree_sum(row[None])[0]
    assert torch.equal(in_batch, alone)
    assert torch.equal(numerics.tree_sum(row), alone)  # 1-D input
    assert torch.equal(numerics.tree_sum(batch.t().contiguous(), dim=0)[position], alone)  # reduced along dim 0
    expected = torch.tensor(_reference_tree_sum(row.numpy()))
    assert torch.equal(alone, expected)


@given(seed=seeds, n=st.integers(1, 300), data=st.data())
def test_tree_sum_zero_padding_up_to_the_power_of_two_is_invisible(seed, n, data):
    """Padding the axis with zeros up to (at most) its power-of-two width leaves the sum's bits unchanged."""
    width = 1 << max(n - 1, 0).bit_length()
    extra = data.draw(st.integers(0, width - n), label="zeros")
    x = torch.randn(4, n, generator=_gen(seed))
    padded = torch.cat([x, torch.zeros(4, extra)], dim=-1)
    assert torch.equal(numerics.tree_sum(x), numerics.tree_sum(padded))


# --------------------------------------------------------------------------- accuracy vs float64 (sanity)


@given(x=st.lists(f32, min_size=1, max_size=64))
def test_exp_within_one_ulp_of_float64(x):
    t = torch.tensor(x, dtype=torch.float32)
    assert int(_ulps(numerics.exp(t), torch.exp(t.double())).max()) <= 1


@given(x=st.lists(st.floats(min_value=0.0, allow_infinity=True, width=32), min_size=1, max_size=64))
def test_log_within_one_ulp_of_float64(x):
    t = torch.tensor(x, dtype=torch.float32)
    assert int(_ulps(numerics.log(t), torch.log(t.double())).max()) <= 1


def test_exp_log_dense_sweep_within_one_ulp(torch_threads):
    """Random bit patterns over the whole float32 range (subnormals, overflow and underflow included)."""
    gen = _gen(1234)
    bits = torch.randint(0, 0x7F800001, (300_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    positive = bits.view(torch.float32)
    assert int(_ulps(numerics.log(positive), torch.log(positive.double())).max()) <= 1
    x = torch.rand(300_000, generator=gen, dtype=torch.float64).mul(240.0).sub(130.0).to(torch.float32)
    assert int(_ulps(numerics.exp(x), torch.exp(x.double())).max()) <= 1


def test_special_values_follow_float64():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -1.0, 1e-45, 3e38, -200.0, 200.0, 89.0, -104.0])
    for fn, ref in ((numerics.exp, torch.exp), (numerics.log, torch.log)):
        y, r = fn(x), ref(x.double()).float()
        assert y.dtype == torch.float32
        for kind in (torch.isnan, torch.isposinf, torch.isneginf, lambda t: t == 0):
            assert torch.equal(kind(y), kind(r)), fn.__name__
        finite = torch.isfinite(r)
        assert int(_ulps(y[finite], r[finite].double()).max()) <= 1, fn.__name__
    # attention relies on exp(0) == 1 exactly: a key block with no visible key must leave its state unchanged.
    assert torch.equal(numerics.exp(torch.zeros(5)), torch.ones(5))


def test_sin_cos_absolute_error_vs_float64():
    """RoPE angles (position * inv_freq, position < 2**17): |error| <= 2**-24, i.e. <= 1 ulp at magnitude 1.

    The reduction subtracts k * float64(2*pi) without an exact split of 2*pi, so
    for large angles the reduced argument carries an absolute error of about
    1e-11; near a zero of sin/cos that is many ulps of a tiny result, but the
    rotation uses cos/sin next to values of order 1, where only the absolute
    error matters.  Hence an absolute, not ulp, bound.
    """
    pos = torch.arange(0, 1 << 17, 7, dtype=torch.float64)
    inv = torch.tensor([10000.0 ** (-2 * i / 128) for i in range(64)], dtype=torch.float64)
    angle = pos[:, None] * inv[None, :]
    sin, cos = numerics.sin_cos(angle)
    assert sin.dtype == cos.dtype == torch.float32
    assert float((sin.double() - torch.sin(angle)).abs().max()) <= 2.0**-24
    assert float((cos.double() - torch.cos(angle)).abs().max()) <= 2.0**-24
    small = angle[angle.abs() < 3.0]  # no reduction error there: 1 ulp like exp/log
    s, c = numerics.sin_cos(small)
    assert int(_ulps(s, torch.sin(small)).max()) <= 1 and int(_ulps(c, torch.cos(small)).max()) <= 1


def test_ceil_to():
    for n in range(0, 200):
        for block in (1, 3, 32, 64):
            r = numerics.ceil_to(n, block)
            assert r % block == 0 and n <= r < n + block


def test_exp_hands_other_devices_to_their_registered_kernel(monkeypatch):
    """A tensor off the CPU that needs no gradient goes to ``("exp", device)`` where one is registered (CUDA: one
    Triton launch, ``kernels/triton/exp.py``); with a gradient, on the CPU, or with none registered, the torch ops."""
    from megatron_consistent.kernels import dispatch

    calls = []
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("exp", "meta"), lambda x: calls.append(x) or "kernel")
    x = torch.empty(4, device="meta")
    assert numerics.exp(x) == "kernel" and calls == [x]
    assert numerics.exp(x.requires_grad_()).device.type == "meta" and len(calls) == 1  # autograd keeps torch ops
    with torch.no_grad():
        assert numerics.exp(x) == "kernel"
    monkeypatch.delitem(dispatch._IMPLEMENTATIONS, ("exp", "meta"))
    assert numerics.exp(torch.empty(4, device="meta")).device.type == "meta"  # none registered: the torch ops
    cpu = torch.linspace(-5, 5, 11)
    assert torch.equal(numerics.exp(cpu), numerics.exp_torch(cpu)) and len(calls) == 2
