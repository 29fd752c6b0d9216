"""GPU (CUDA) causal conv1d: the Triton kernel (``kernels/triton/causal_conv1d.py``) against the contract's torch code
(``_causal_conv1d_cpu``) run on the same CUDA tensors, bitwise (outputs, NaNs included, and new states).

At Nemotron-H 8B's ``xBC`` width (C = 8192 + 2 x 8 x 128 = 10240, K = 4, bf16 activations, float32 weight and bias;
x a column slice of the wider ``zxbcdt`` projection, as the engine passes it): a prefill of T = 1, 64, 1000 tokens
and a decode step of 64 rows; then small property shapes over the dtypes, activations, bias, states, strides and the
exp range edges.  Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from _bits import bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the Triton causal conv1d kernel (kernels/triton/causal_conv1d.py)")]

if torch.cuda.is_available():
    from megatron_consistent.kernels.triton.causal_conv1d import causal_conv1d_triton

from megatron_consistent.kernels.causal_conv1d import _causal_conv1d_cpu

DEV = torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NEMOTRON_H_8B_C = 8192 + 2 * 8 * 128


def check(x, w, b, s, act):
    y, ns = causal_conv1d_triton(x, w, b, s, act)
    y_ref, ns_ref = _causal_conv1d_cpu(x, w, b, s, act)
    assert y.device.type == "cuda" and ns.is_contiguous()
    assert ns.numel() == 0 or ns.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert bits_equal(ns, ns_ref), "new_state differs"
    assert bits_equal(y, y_ref), f"{(y.view(-1) != y_ref.view(-1)).sum().item()} of {y.numel()} outputs differ"


def _inputs(seed, lead, t_len, c, k, dtype, bias=True, state=None, scale=1.0, extra=0):
    """CPU-drawn inputs on the GPU: x ``[*lead, T, C]`` (a column slice of a tensor ``extra`` channels wider when
    ``extra``), float32 weight / bias, a state in ``state`` dtype (default ``dtype``; the op casts it)."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(*lead, t_len, c + extra, generator=g) * scale).to(dtype).to(DEV)
    x = wide[..., extra // 2:extra // 2 + c]
    w = (torch.randn(c, k, generator=g) * k ** -0.5).to(DEV)
    b = torch.randn(c, generator=g).to(DEV) if bias else None
    s = (torch.randn(*lead, k - 1, c, generator=g) * scale).to(state or dtype).to(DEV)
    return x, w, b, s


@pytest.mark.parametrize("t_len", [1, 64, 1000])
def test_nemotron_h_8b_prefill(t_len):
    """One sequence: x a column slice of ``zxbcdt`` (z 8192 | xBC 10240 | dt 64 wide)."""
    for state in (BF16, F32):
        check(*_inputs(t_len, (1,), t_len, NEMOTRON_H_8B_C, 4, BF16, state=state, extra=8192 + 64), "silu")


def test_nemotron_h_8b_decode_step():
    """64 rows of one token each (``xbc[:, None]``), each with its own state."""
    x, w, b, s = _inputs(7, (64,), 1, NEMOTRON_H_8B_C, 4, BF16, extra=8192 + 64)
    check(x, w, b, s, "silu")
    y, _ = causal_conv1d_triton(x, w, b, s, "silu")
    y_row, _ = causal_conv1d_triton(x[5:6], w, b, s[5:6], "silu")
    assert bits_equal(y_row, y[5:6]), "a row alone differs from the row in the batch"


@pytest.mark.parametrize("t_len", [1, 2, 3, 7, 64, 130])
@pytest.mark.parametrize("c,k,lead", [(6, 2, ()), (40, 3, (3,)), (200, 4, (2, 2)), (257, 4, (1,))])
def test_property_shapes(t_len, c, k, lead):
    for i, (dtype, act, bias) in enumerate([(d, a, b) for d in (BF16, F16, F32) for a in ("silu", None)
                                            for b in (True, False)]):
        check(*_inputs(i + 31 * t_len + c, lead, t_len, c, k, dtype, bias, state=(None, F32)[i % 2], extra=7 * i % 3),
              act)


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_exp_range_edges_nan_and_inf(dtype):
    """The exp clamps, float32 overflow of ``exp(-acc)``, +-0, subnormals, +-inf and NaN along the positions (so
    infinities meet zero weights and NaNs meet NaNs: every NaN result is the canonical one on the GPU); NaN in the
    state, weights and bias; T = 0 and an empty batch."""
    special = [0.0, -0.0, 88.72, -88.72, 89.99, 90.0, 90.01, -104.0, -110.0, -110.5, 1e-40, -1e-40, float("inf"),
               -float("inf"), float("nan"), -float("nan"), 3.0e38, -3.0e38]
    x = torch.cat([torch.linspace(-130, 130, 1021), torch.tensor(special)]).to(dtype)
    x = x[:, None].expand(-1, 4).contiguous().to(DEV)
    w = torch.zeros(4, 3, device=DEV)
    w[:, 2] = 1.0
    for act in ("silu", None):
        check(x, w, None, torch.zeros(2, 4, dtype=dtype, device=DEV), act)
        check(x, torch.rand(4, 3, device=DEV), torch.randn(4, device=DEV), torch.zeros(2, 4, dtype=dtype, device=DEV),
              act)
    x, w, b, s = _inputs(5, (2,), 9, 12, 4, dtype, scale=60.0)
    x[0, 3, 1], s[1, 0, 4], w[7, 2], b[9] = float("nan"), float("nan"), float("nan"), float("nan")
    check(x, w, b, s, "silu")
    check(*_inputs(1, (2,), 0, 6, 4, dtype), "silu")
    check(*_inputs(1, (0, 3), 5, 6, 4, dtype), "silu")


@pytest.mark.parametrize("cut", [1, 3, 500])
def test_pieces_with_the_state_passed_equal_the_whole(cut):
    x, w, b, s = _inputs(3, (2,), 1000, NEMOTRON_H_8B_C, 4, BF16, extra=8192 + 64)
    y, ns = causal_conv1d_triton(x, w, b, s, "silu")
    y1, s1 = causal_conv1d_triton(x[:, :cut], w, b, s, "silu")
    y2, s2 = causal_conv1d_triton(x[:, cut:], w, b, s1, "silu")
    assert bits_equal(torch.cat([y1, y2], dim=1), y) and bits_equal(s2, ns)
