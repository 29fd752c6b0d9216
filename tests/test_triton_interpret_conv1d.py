"""The CUDA causal conv1d kernel (``kernels/triton/causal_conv1d.py``) in Triton's interpreter (CPU tensors): the bits
of the contract's torch evaluation (``_causal_conv1d_cpu``).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable, like the other ``test_triton_interpret_*`` files.  The
interpreter runs each Triton operation as one numpy operation, IEEE like torch's CPU elementwise ops, so the kernel must
give ``_causal_conv1d_cpu``'s bits exactly: its taps in the contract's order, its ``exp`` ``numerics.exp``'s arithmetic,
its state / input rows and its masks (channels and positions that are not multiples of the blocks) right.  float32 outputs are
compared directly.  The interpreter's 16-bit conversions are not all torch's: it truncates float32 to bfloat16 (torch
rounds to nearest even) and reads bfloat16 subnormals as zero, so a bf16 case checks that the float32 accumulator of
its operand values is the contract's, bitwise, and that the output is that accumulator after the interpreter's one
rounding; numpy converts float16 NaNs with other payloads than torch's CPU code, so a float16 case compares the bits of
every output but the NaNs, and where the NaNs are.  On the GPU the outputs of every dtype are compared directly, NaNs
included (tests/test_gpu_conv1d.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
triton = pytest.importorskip("triton")

import triton.language as tl

from megatron_consistent.kernels.causal_conv1d import _causal_conv1d_cpu
from megatron_consistent.kernels.triton import causal_conv1d as tcc

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
INT = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}


def _bits(v: torch.Tensor) -> torch.Tensor:
    return v.view(INT[v.dtype])


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty), mask=offs < n)


def _backend_round(y32: torch.Tensor, dtype) -> torch.Tensor:
    """float32 -> dtype rounded as this backend's kernels round (the interpreter truncates to bf16)."""
    out = torch.empty(y32.shape, dtype=dtype)
    if y32.numel():
        _cast_kernel[(triton.cdiv(y32.numel(), 1024),)](y32.contiguous().view(-1), out.view(-1), y32.numel(),
                                                         BLOCK=1024)
    return out


def check(x, w, b, s, act):
    """The kernel's ``(y, new_state)`` against ``_causal_conv1d_cpu``'s, bitwise (module docstring for 16 bits)."""
    y, ns = tcc.causal_conv1d_triton(x, w, b, s, act)
    y_ref, ns_ref = _causal_conv1d_cpu(x, w, b, s, act)
    assert ns.dtype == ns_ref.dtype and ns.shape == ns_ref.shape and torch.equal(_bits(ns), _bits(ns_ref))
    assert ns.is_contiguous() and (ns.numel() == 0 or ns.untyped_storage().data_ptr() not in
                                   (x.untyped_storage().data_ptr(), s.untyped_storage().data_ptr()))
    assert y.dtype == x.dtype and y.shape == x.shape
    if x.dtype == BF16:  # the float32 accumulator of the same operand values, then the interpreter's one rounding
        s_x = s.to(BF16)
        y32, _ = tcc.causal_conv1d_triton(x.float(), w, b, s_x.float(), act)
        acc, _ = _causal_conv1d_cpu(x.float(), w, b, s_x.float(), act)
        assert torch.equal(_bits(y32), _bits(acc)), f"{(_bits(y32) != _bits(acc)).sum().item()} of {y.numel()} differ"
        y_ref = _backend_round(acc, BF16)
    if x.dtype == F16:  # numpy's float16 conversions are torch's but for the NaNs' payloads
        nan = y_ref.isnan()
        assert torch.equal(y.isnan(), nan)
        y, y_ref = y[~nan], y_ref[~nan]
    assert torch.equal(_bits(y), _bits(y_ref)), f"{(_bits(y) != _bits(y_ref)).sum().item()} of {y.numel()} differ"
    return y, ns


def _inputs(seed, lead, t_len, c, k, dtype, bias=True, state="random", view=False, scale=1.0):
    """x ``[*lead, T, C]`` (a column slice of a wider tensor when ``view``), float32 weight / bias, a state that is
    zeros, random in ``dtype`` or random float32 (cast to ``dtype`` by the op)."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(*lead, t_len, c + 7, generator=g) * scale).to(dtype)
    x = wide[..., 3:3 + c] if view else wide[..., :c].contiguous()
    w = torch.randn(c, k, generator=g) * k ** -0.5
    b = torch.randn(c, generator=g) if bias else None
    s = torch.randn(*lead, k - 1, c, generator=g) * scale
    s = {"zeros": torch.zeros_like(s, dtype=dtype), "random": s.to(dtype), "float32": s}[state]
    return x, w, b, s


SHAPES = [(6, 2, ()), (40, 3, (3,)), (200, 4, (2, 2)), (256, 4, ()), (257, 3, (1,))]  # C: a block of 256 and past


@pytest.mark.parametrize("t_len", [1, 2, 3, 7, 64, 130])
@pytest.mark.parametrize("c,k,lead", SHAPES)
def test_conv1d_equals_the_torch_contract(t_len, c, k, lead):
    """T below, at and past K - 1 and the 16-row block; every dtype, activation, bias / no bias, and the three kinds
    of state in turn; x a column slice of a wider tensor when there are leading dims."""
    for i, (dtype, act, bias) in enumerate([(d, a, b) for d in (F32, BF16, F16) for a in ("silu", None)
                                            for b in (True, False)]):
        state = ("zeros", "random", "float32")[(i + t_len) % 3]
        check(*_inputs(i + 31 * t_len + c, lead, t_len, c, k, dtype, bias, state, view=bool(lead)), act)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_exp_range_edges_and_nan(dtype):
    """``acc = x`` (a zero state, only the last tap weighted, no bias; the values along the channels) over the exp
    clamps (-110 / 90), float32 overflow of ``exp(-acc)`` (y = -0), +-0, +-inf and NaN; then NaN in the input, the
    state, the weights and the bias of a random case.  Each output meets one NaN at most: where two NaNs meet in an
    operation, the CPU's result is the NaN of whichever operand the compiled loop put first, which the contract does not
    fix (on the GPU every NaN result is the canonical one).  Subnormal inputs in float32 only (module docstring)."""
    special = [0.0, -0.0, 88.72, -88.72, 89.99, 90.0, 90.01, -104.0, -110.0, -110.5, float("inf"), -float("inf"),
               float("nan"), -float("nan"), 3.0e38, -3.0e38] + ([1e-40, -1e-40] if dtype == F32 else [])
    x = torch.cat([torch.linspace(-130, 130, 1021), torch.tensor(special)]).to(dtype)[None, :]
    w = torch.zeros(x.shape[1], 3)
    w[:, 2] = 1.0
    for act in ("silu", None):
        check(x, w, None, torch.zeros(2, x.shape[1], dtype=dtype), act)
    x, w, b, s = _inputs(5, (2,), 9, 12, 4, dtype, scale=60.0)
    x[0, 3, 1], s[1, 0, 4], w[7, 2], b[9] = float("nan"), float("nan"), float("nan"), float("nan")
    check(x, w, b, s, "silu")


def test_other_strides_and_k1():
    """x with a channel stride (a transposed tensor), a weight that is a strided view, bf16 weights; K = 1."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 9, generator=g).t()
    w = torch.randn(40, 2, 3, generator=g)[:, 1, :]
    check(x, w, torch.randn(40, generator=g), torch.randn(2, 40, generator=g), "silu")
    check(x.to(BF16), w.to(BF16), None, torch.randn(2, 40, generator=g), "silu")
    check(x, torch.randn(40, 1, generator=g), None, torch.zeros(0, 40), "silu")


def test_empty_sequence_and_empty_batch():
    x, w, b, s = _inputs(1, (2,), 0, 6, 4, BF16)
    y, ns = check(x, w, b, s, "silu")
    assert y.shape == (2, 0, 6) and torch.equal(ns, s)
    check(*_inputs(1, (0, 3), 5, 6, 4, F32), "silu")
    check(*_inputs(1, (0,), 0, 6, 3, F32), None)


def test_a_row_alone_equals_the_row_in_a_batch():
    x, w, b, s = _inputs(4, (5,), 37, 40, 4, F32, view=True)
    y, ns = tcc.causal_conv1d_triton(x, w, b, s, "silu")
    for r in (0, 3):
        y_r, ns_r = tcc.causal_conv1d_triton(x[r], w, b, s[r], "silu")
        assert torch.equal(_bits(y_r), _bits(y[r])) and torch.equal(ns_r, ns[r])


@pytest.mark.parametrize("cut", [1, 2, 20, 36])
def test_two_pieces_with_the_state_passed_equal_the_whole(cut):
    x, w, b, s = _inputs(6, (2,), 37, 40, 4, F32, view=True)
    y, ns = tcc.causal_conv1d_triton(x, w, b, s, "silu")
    y1, s1 = tcc.causal_conv1d_triton(x[:, :cut], w, b, s, "silu")
    y2, s2 = tcc.causal_conv1d_triton(x[:, cut:], w, b, s1, "silu")
    assert torch.equal(_bits(torch.cat([y1, y2], dim=1)), _bits(y)) and torch.equal(s2, ns)


@triton.jit
def _reversed_tap(X, S, W, row, t, c, out, sx_row, sx_t, sx_c, C, j: tl.constexpr, K: tl.constexpr):
    return _TAP(X, S, W, row, t, c, out, sx_row, sx_t, sx_c, C, K - 1 - j, K)


_TAP = tcc._tap


def test_a_kernel_that_sums_the_taps_in_reverse_is_caught(monkeypatch):
    """The kernel with its taps summed from the last to the first (the same products, another order of the sums):
    the comparison above sees it."""
    x, w, b, s = _inputs(8, (2,), 64, 40, 4, F32)
    monkeypatch.setattr(tcc, "_tap", _reversed_tap)
    y, _ = tcc.causal_conv1d_triton(x, w, b, s, None)
    y_ref, _ = _causal_conv1d_cpu(x, w, b, s, None)
    differ = (_bits(y) != _bits(y_ref)).sum().item()
    assert 0 < differ, differ  # the same products summed in another order: other bits
    with pytest.raises(AssertionError):
        check(x, w, b, s, None)


@pytest.mark.parametrize("change,match", [
    (dict(w=torch.zeros(5, 4)), "weight"), (dict(w=torch.zeros(6, 0)), "weight"), (dict(w=torch.zeros(6)), "weight"),
    (dict(b=torch.zeros(5)), "bias"), (dict(s=torch.zeros(2, 2, 6)), "state"), (dict(s=torch.zeros(3, 3, 6)), "state"),
    (dict(s=None), "state"), (dict(act="relu"), "activation"), (dict(x=torch.zeros(6)), "x"),
    (dict(x=torch.zeros(2, 3, 6, dtype=torch.float64)), "x")])
def test_bad_shapes_are_refused(change, match):
    args = dict(x=torch.zeros(2, 3, 6), w=torch.zeros(6, 4), b=torch.zeros(6), s=torch.zeros(2, 3, 6), act="silu")
    args.update(change)
    with pytest.raises(ValueError, match=match) as err:
        tcc.causal_conv1d_triton(args["x"], args["w"], args["b"], args["s"], args["act"])
    assert "\n" not in str(err.value)
