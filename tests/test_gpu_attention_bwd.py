"""GPU attention backward (Triton, kernels/triton/attention_bwd.py): accuracy, determinism, GQA, padding.

Skipped without CUDA.  Gradients go through ``kernels.attention`` (AttentionFunction), so the
dispatch to the registered ``("attention_backward", "cuda")`` kernel is exercised too.

Tolerance vs a float64 reference (same bf16 inputs, exact softmax): the kernel feeds the
probabilities ``p`` and ``dS`` to the tensor cores rounded to bf16 (relative error <= 2^-9 per
element, FlashAttention-2 practice), uses the bf16-rounded output in ``rowsum(dO * O)``, and rounds
dq/dk/dv to bf16 (relative error <= 2^-9 of each element).  Accumulation is float32.  Those
roundings give errors of a few 2^-9 of the gradient's scale, so we require
``max|g - ref| <= 2e-2 * max|ref|`` (about 5x the bf16 unit 2^-8 of the largest entry) and
``||g - ref|| / ||ref|| <= 1e-2`` (an aggregate well above bf16 noise, far below any real bug:
a wrong mask, scale or lse base gives O(1) relative errors).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton attention backward)")]

from megatron_consistent.kernels import attention
from megatron_consistent.kernels.dispatch import implementation

DEV = torch.device("cuda")


def _inputs(b, tq, tk, hq, hkv, d, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, tq, hq, d, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(b, tk, hkv, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(b, tk, hkv, d, generator=g).to(DEV, torch.bfloat16)
    go = torch.randn(b, tq, hq, d, generator=g).to(DEV, torch.bfloat16)
    return q, k, v, go


def _grads(q, k, v, go, pos, klen):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, pos, klen)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, go, pos, klen):
    """float64 gradients of exact causal GQA attention (materialised softmax)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, 2).transpose(1, 2)
    vv = v.repeat_interleave(hq // hkv, 2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * d ** -0.5
    kp = torch.arange(tk, device=DEV)
    vis = (kp[None, None, :] <= pos[:, :, None]) & (kp[None, None, :] < klen[:, None, None])
    p = torch.softmax(s.masked_fill(~vis[:, None], -math.inf), -1).nan_to_num(0.0)
    o = (p @ vv).transpose(1, 2)
    return torch.autograd.grad(o, (q, k, v), go.double())


def _check_close(name, g, ref):
    assert g.dtype == torch.bfloat16 and g.shape == ref.shape, name
    assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
    err = (g.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    rel = ((g.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= 2e-2 * scale, f"{name}: max error {err:.3g} vs max |ref| {scale:.3g}"
    assert rel <= 1e-2, f"{name}: relative norm error {rel:.3g}"


def test_backward_is_the_triton_kernel():
    from megatron_consistent.kernels.triton import attention_bwd

    assert implementation("attention_backward", DEV) is attention_bwd._attention_backward_cuda


@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
@pytest.mark.parametrize("t", [333, 512])
def test_backward_vs_float64(hq, hkv, t):
    """Causal training sequences (T not a multiple of the 64-blocks, and one that is); GQA 32/8 and MHA."""
    b, d = 2, 128
    q, k, v, go = _inputs(b, t, t, hq, hkv, d, seed=hq + t)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    klen = torch.full((b,), t, device=DEV)
    _, dq, dk, dv = _grads(q, k, v, go, pos, klen)
    rq, rk, rv = _reference(q, k, v, go, pos, klen)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _check_close(name, g, r)


def test_backward_padding_and_k_lengths():
    """Right-padded batch (positions -1, k_lengths) : padded rows/keys get exactly zero gradient."""
    b, t, hq, hkv, d = 3, 200, 32, 8, 128
    q, k, v, go = _inputs(b, t, t, hq, hkv, d, seed=7)
    lens = [200, 150, 77]
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    for i, n in enumerate(lens):
        pos[i, n:] = -1
    klen = torch.tensor(lens, device=DEV)
    _, dq, dk, dv = _grads(q, k, v, go, pos, klen)
    rq, rk, rv = _reference(q, k, v, go, pos, klen)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _check_close(name, g, r)
    for i, n in enumerate(lens):
        assert torch.all(dq[i, n:] == 0) and torch.all(dk[i, n:] == 0) and torch.all(dv[i, n:] == 0)
    # each sequence alone gives the same gradients up to bf16 blocking noise
    for i, n in enumerate(lens):
        _, dqi, dki, dvi = _grads(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], go[i:i + 1, :n],
                                  pos[i:i + 1, :n], klen[i:i + 1])
        _check_close("dq alone", dqi[0], dq[i, :n].double())
        _check_close("dk alone", dki[0], dk[i, :n].double())


def test_backward_chunk_over_longer_cache():
    """Queries at positions 100..219 over a 300-key cache cut at k_length 200 (unequal Tq/Tk, GQA 8/2)."""
    b, tq, tk, hq, hkv, d = 2, 120, 300, 8, 2, 64
    q, k, v, go = _inputs(b, tq, tk, hq, hkv, d, seed=11)
    pos = (torch.arange(tq, device=DEV) + 100).expand(b, tq).contiguous()
    klen = torch.tensor([200, 300], device=DEV)
    _, dq, dk, dv = _grads(q, k, v, go, pos, klen)
    rq, rk, rv = _reference(q, k, v, go, pos, klen)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _check_close(name, g, r)
    assert torch.all(dk[0, 200:] == 0) and torch.all(dv[0, 200:] == 0)
    assert torch.all(dk[:, 220:] == 0)


def test_backward_unsorted_positions():
    """Arbitrary (permuted) query positions: the block table stays correct."""
    b, t, hq, hkv, d = 1, 256, 4, 2, 128
    q, k, v, go = _inputs(b, t, t, hq, hkv, d, seed=13)
    g = torch.Generator(device="cpu").manual_seed(0)
    pos = torch.randperm(t, generator=g).to(DEV)[None]
    klen = torch.full((b,), t, device=DEV)
    _, dq, dk, dv = _grads(q, k, v, go, pos, klen)
    rq, rk, rv = _reference(q, k, v, go, pos, klen)
    for name, gr, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _check_close(name, gr, r)


@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 16)])
def test_backward_deterministic(hq, hkv):
    """Two backward passes over the same inputs give identical bits (no atomics)."""
    b, t, d = 2, 1000, 128
    q, k, v, go = _inputs(b, t, t, hq, hkv, d, seed=17)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    pos[1, 700:] = -1
    klen = torch.tensor([t, 700], device=DEV)
    first = _grads(q, k, v, go, pos, klen)
    for _ in range(2):
        again = _grads(q, k, v, go, pos, klen)
        for a, c in zip(first, again):
            assert torch.equal(a, c)
