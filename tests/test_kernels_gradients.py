"""Backward passes of the kernels' ``autograd.Function``s: gradient vs fp64 reference.

Every op is re-implemented here in plain float64 torch (``ref_*``; none of
them calls the package), and checked two ways:

1. ``test_*_gradient_vs_fp64_reference`` — property tests over shapes and
   input dtypes (float32, bfloat16): the kernel's forward and the gradients its
   backward returns for a random upstream gradient are compared with the
   reference's forward and autograd gradients, evaluated at the very same
   (exactly representable) inputs, within tolerances derived from the dtype's
   machine epsilon (see ``TOLERANCES``).

2. ``test_*_backward_gradcheck`` — ``torch.autograd.gradcheck`` in float64.
   The kernels compute in float32 whatever the input dtype, so running
   gradcheck on the kernel's forward would compare float32-rounded finite
   differences against themselves and mean nothing.  Instead ``gradcheck`` is
   run on a hybrid Function whose forward is the float64 reference (so the
   numerical Jacobian is central finite differences of the exact math) and
   whose backward is the kernel's own backward (run on the same inputs, which
   are float32-representable so both sides see the same point).  This checks
   the hand-written backward formulas against finite differences, without
   trusting autograd of the reference either.  Its tolerances are float32
   ones (``GRADCHECK_ATOL/RTOL``).
"""

from __future__ import annotations


import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_consistent.kernels import (
    RopeConfig,
    apply_rope,
    attention,
    linear,
    rms_norm,
    silu_and_mul,
    token_logprobs,
)

seeds = st.integers(0, 2**32 - 1)
grad_dtypes = st.sampled_from([torch.float32, torch.bfloat16])

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}

# (rtol, atol as a fraction of the largest reference entry), per input dtype.
# float32: every kernel output/gradient is an fp32 computation with at most a
#   few hundred terms per reduction; rounding error grows like sqrt(K)*eps and
#   stays far below 32*eps (3.8e-6) relative; entries that are small only
#   because of cancellation get the same allowance relative to the op's scale
#   (largest entry of the upstream gradient and of the reference gradients).
# bfloat16: results are rounded once to bf16 (<= eps/2 relative, eps = 2**-7)
#   on top of fp32 work; attention's backward also reuses the bf16-rounded
#   output in rowsum(dO * O), which costs up to ~eps/2 relative to the largest
#   terms; allow 2*eps relative and 2*eps of the op's scale.
TOLERANCES = {
    torch.float32: (32 * EPS[torch.float32], 32 * EPS[torch.float32]),
    torch.bfloat16: (2 * EPS[torch.bfloat16], 2 * EPS[torch.bfloat16]),
}
# gradcheck: the analytical side is the kernel's float32 backward, entries O(1):
# 1e-4 is ~800 fp32 eps, ample for reductions of < 100 terms, yet a wrong
# formula (a missing term, a transposed head group) is off by O(1).
GRADCHECK_ATOL = 1e-4
GRADCHECK_RTOL = 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_near_reference(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, what: str, scale: float | None = None):
    """|actual - reference| <= rtol*|reference| + atol*scale elementwise (tolerances from ``TOLERANCES``).

    ``scale`` (default: max|reference|) is the magnitude of the quantities the
    computation went through; an entry that is small only through cancellation
    (e.g. dq = 0 for a query seeing a single key) keeps an error of order
    eps * scale, not eps * itself.
    """
    rtol, atol = TOLERANCES[dtype]
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(reference.shape)}"
    if scale is None:
        scale = float(reference.abs().max()) if reference.numel() else 0.0
    err = (actual.double() - reference).abs()
    bound = rtol * reference.abs() + atol * scale
    bad = err > bound
    assert not bad.any(), (
        f"{what} ({dtype}): {int(bad.sum())}/{err.numel()} entries off; worst error {float(err.max()):.3g}, "
        f"largest reference entry {float(reference.abs().max()):.3g}, scale {scale:.3g}"
    )


def check_vs_reference(kernel_fn, ref_fn, inputs, dtype, gen, names, forward_scale_floor: float = 0.0):
    """Forward and backward of ``kernel_fn`` vs the float64 ``ref_fn`` at ``inputs`` (all differentiated).

    Gradients share one ``scale``: the largest entry among the upstream
    gradient and all reference gradients of the op.  The forward's scale is the
    largest reference entry, at least ``forward_scale_floor`` (the magnitude of
    an intermediate the forward rounds whatever its output's size).
    """
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = kernel_fn(*leaves)
    upstream = _randn(gen, *out.shape, dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, upstream)

    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    out64 = ref_fn(*leaves64)
    grads64 = torch.autograd.grad(out64, leaves64, upstream.double())

    out_dtype = torch.float32 if out.dtype == torch.float32 else dtype
    ref_out = out64.detach()
    assert_near_reference(out, ref_out, out_dtype, "forward",
                          max(float(ref_out.abs().max()) if ref_out.numel() else 0.0, forward_scale_floor))
    scale = max(float(t.abs().max()) for t in (upstream, *grads64) if t.numel())
    for name, leaf, g, g64 in zip(names, leaves, grads, grads64, strict=True):
        assert g.dtype == leaf.dtype, f"grad {name} has dtype {g.dtype}, input {leaf.dtype}"
        assert_near_reference(g, g64, dtype, f"grad {name}", scale)


def gradcheck_kernel_backward(kernel_fn, ref_fn, inputs):
    """``torch.autograd.gradcheck`` with the kernel's backward as the analytical Jacobian and fp64 FD of ``ref_fn``."""

    class KernelBackwardOnReference(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            return ref_fn(*xs)

        @staticmethod
        def backward(ctx, grad):
            xs = [x.detach().to(torch.float32).requires_grad_() for x in ctx.saved_tensors]
            with torch.enable_grad():
                out = kernel_fn(*xs)
            grads = torch.autograd.grad(out, xs, grad.to(out.dtype))
            return tuple(g.double() for g in grads)

    inputs64 = tuple(t.detach().to(torch.float32).double().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(
        KernelBackwardOnReference.apply, inputs64, eps=1e-6, atol=GRADCHECK_ATOL, rtol=GRADCHECK_RTOL
    )


# --------------------------------------------------------------------------- fp64 references


def ref_linear(x, w, b=None):
    y = x @ w.t()
    return y if b is None else y + b


def ref_rms_norm(h, w, eps):
    return h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w


def ref_silu_and_mul(x):
    g, u = x.chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def ref_rope(x, positions, rotary_dim, base, style):
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.to(torch.float64)[..., None] * inv  # [..., T, rot/2]
    cos, sin = torch.cos(angle)[..., None, :], torch.sin(angle)[..., None, :]  # broadcast over heads
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "neox":
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def ref_attention(q, k, v, q_positions, k_lengths, scale):
    """Materialised causal softmax attention in float64; queries with no visible key give 0."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    kpos = torch.arange(k.shape[1])
    visible = (kpos[None, None, :] <= q_positions[:, :, None]) & (kpos[None, None, :] < k_lengths[:, None, None])
    visible = visible[:, None]  # [B, 1, Tq, Tk]
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = torch.where(visible, s, torch.finfo(torch.float64).min)
    p = torch.softmax(s, dim=-1) * visible
    out = (p @ vh) * visible.any(-1, keepdim=True)
    return out.transpose(1, 2)


def ref_token_logprobs(hidden, lm_head, tokens, temperature):
    logits = (hidden @ lm_head.t()) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


# --------------------------------------------------------------------------- linear


@given(seed=seeds, m=st.integers(1, 12), k=st.integers(1, 200), n=st.integers(1, 24), dtype=grad_dtypes, with_bias=st.booleans(),
       fp32_out=st.booleans())
def test_linear_gradient_vs_fp64_reference(seed, m, k, n, dtype, with_bias, fp32_out):
    gen = _gen(seed)
    inputs = [_randn(gen, 2, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=k**-0.5)]
    names = ["x", "weight"]
    if with_bias:
        inputs.append(_randn(gen, n, dtype=dtype))
        names.append("bias")
    out_dtype = torch.float32 if fp32_out else None
    check_vs_reference(lambda *a: linear(*a, out_dtype=out_dtype), ref_linear, inputs, dtype, gen, names)


def test_linear_backward_gradcheck():
    gen = _gen(0)
    x, w, b = _randn(gen, 2, 3, 20), _randn(gen, 4, 20, scale=0.3), _randn(gen, 4)
    gradcheck_kernel_backward(linear, ref_linear, (x, w, b))


# --------------------------------------------------------------------------- rms_norm


@given(seed=seeds, rows=st.integers(1, 10), hidden=st.integers(2, 200), dtype=grad_dtypes, eps=st.sampled_from([1e-6, 1e-5]),
       with_residual=st.booleans())
def test_rms_norm_gradient_vs_fp64_reference(seed, rows, hidden, dtype, eps, with_residual):
    gen = _gen(seed)
    x, w = _randn(gen, rows, hidden, dtype=dtype, scale=3.0), _randn(gen, hidden, dtype=dtype)
    if not with_residual:
        check_vs_reference(lambda h, wt: rms_norm(h, wt, eps), lambda h, wt: ref_rms_norm(h, wt, eps), [x, w], dtype, gen, ["x", "weight"])
        return
    # The kernel rounds x + residual to the model dtype before normalising; pick residual = -x/2 so that the sum
    # (x/2) is exact in every dtype and kernel and reference are differentiated at the same point.
    r = (x.double() * -0.5).to(dtype)
    check_vs_reference(lambda h, res, wt: rms_norm(h, wt, eps, residual=res)[0],
                       lambda h, res, wt: ref_rms_norm(h + res, wt, eps), [x, r, w], dtype, gen, ["x", "residual", "weight"])


def test_rms_norm_backward_gradcheck():
    gen = _gen(1)
    h, w = _randn(gen, 3, 12, scale=2.0), _randn(gen, 12)
    gradcheck_kernel_backward(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: ref_rms_norm(a, b, 1e-6), (h, w))


# --------------------------------------------------------------------------- silu_and_mul


@given(seed=seeds, rows=st.integers(1, 10), inter=st.integers(1, 150), dtype=grad_dtypes, scale=st.sampled_from([1.0, 6.0]))
def test_silu_and_mul_gradient_vs_fp64_reference(seed, rows, inter, dtype, scale):
    gen = _gen(seed)
    x = _randn(gen, rows, 2 * inter, dtype=dtype, scale=scale)
    check_vs_reference(silu_and_mul, ref_silu_and_mul, [x], dtype, gen, ["x"])


def test_silu_and_mul_backward_gradcheck():
    x = _randn(_gen(2), 4, 16, scale=3.0)
    gradcheck_kernel_backward(silu_and_mul, ref_silu_and_mul, (x,))


# --------------------------------------------------------------------------- rope


@given(seed=seeds, tokens=st.integers(1, 12), heads=st.integers(1, 3), head_dim=st.sampled_from([8, 16, 24]),
       partial=st.booleans(), style=st.sampled_from(["neox", "gptj"]), dtype=grad_dtypes)
def test_rope_gradient_vs_fp64_reference(seed, tokens, heads, head_dim, partial, style, dtype):
    gen = _gen(seed)
    rotary_dim = head_dim // 2 if partial and head_dim % 4 == 0 else head_dim
    cfg = RopeConfig(rotary_dim, 4096, base=10000.0, style=style)
    positions = torch.randint(0, 4096, (2, tokens), generator=gen)
    x = _randn(gen, 2, tokens, heads, head_dim, dtype=dtype, scale=2.0)
    check_vs_reference(lambda a: apply_rope(a, positions, cfg), lambda a: ref_rope(a, positions, rotary_dim, 10000.0, style),
                       [x], dtype, gen, ["x"])


def test_rope_backward_gradcheck():
    gen = _gen(3)
    positions = torch.tensor([0, 5, 77, 1023, 4000])
    for style in ("neox", "gptj"):
        cfg = RopeConfig(8, 4096, style=style)
        x = _randn(gen, 5, 2, 12)
        gradcheck_kernel_backward(lambda a: apply_rope(a, positions, cfg), lambda a: ref_rope(a, positions, 8, 10000.0, style), (x,))


# --------------------------------------------------------------------------- attention


@st.composite
def attention_cases(draw):
    """Batched queries (chunks over cached prefixes, padded with q_positions = -1) for MHA, GQA and MQA."""
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8, 16]))
    b = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 45), min_size=b, max_size=b))
    starts = [draw(st.integers(0, n - 1)) for n in lengths]
    tq = max(n - s for n, s in zip(lengths, starts)) + draw(st.integers(0, 2))
    tk = max(lengths) + draw(st.integers(0, 3))
    qpos = torch.full((b, tq), -1)
    for i, (n, s) in enumerate(zip(lengths, starts)):
        qpos[i, : n - s] = torch.arange(s, n)
    return hq, hkv, d, qpos, torch.tensor(lengths), tk


@settings(max_examples=15)
@given(seed=seeds, case=attention_cases(), dtype=grad_dtypes)
def test_attention_gradient_vs_fp64_reference(seed, case, dtype):
    hq, hkv, d, qpos, klen, tk = case
    gen = _gen(seed)
    b, tq = qpos.shape
    q = _randn(gen, b, tq, hq, d, dtype=dtype, scale=1.5)
    k, v = _randn(gen, b, tk, hkv, d, dtype=dtype), _randn(gen, b, tk, hkv, d, dtype=dtype)
    scale = d**-0.5
    check_vs_reference(lambda q_, k_, v_: attention(q_, k_, v_, qpos, klen),
                       lambda q_, k_, v_: ref_attention(q_, k_, v_, qpos, klen, scale), [q, k, v], dtype, gen, ["q", "k", "v"])


def test_attention_backward_gradcheck():
    gen = _gen(4)
    qpos = torch.tensor([[3, 4, 5], [0, -1, -1]])  # a prefill chunk over a cached prefix, and a padded one-token query
    klen = torch.tensor([6, 1])
    q = _randn(gen, 2, 3, 4, 4)
    k, v = _randn(gen, 2, 7, 2, 4), _randn(gen, 2, 7, 2, 4)  # GQA 4:2, one spare key slot
    gradcheck_kernel_backward(lambda a, b_, c: attention(a, b_, c, qpos, klen),
                              lambda a, b_, c: ref_attention(a, b_, c, qpos, klen, 0.5), (q, k, v))


# --------------------------------------------------------------------------- token_logprobs


@given(seed=seeds, rows=st.integers(1, 8), hidden=st.integers(1, 64), vocab=st.integers(0, 150).map(lambda n: 2 * n + 1),
       dtype=grad_dtypes, temperature=st.sampled_from([1.0, 0.7]))
def test_token_logprobs_gradient_vs_fp64_reference(seed, rows, hidden, vocab, dtype, temperature):
    gen = _gen(seed)
    h = _randn(gen, 2, rows, hidden, dtype=dtype)
    w = _randn(gen, vocab, hidden, dtype=dtype, scale=2.0 * hidden**-0.5)
    tokens = torch.randint(0, vocab, (2, rows), generator=gen)
    # the log-prob's sum of exponentials is >= 1 and rounded to float32: log(s) carries an absolute error up to
    # eps / 2 however small the log-prob (hypothesis: a token of probability 1 - 5.4e-8 gives 0.0 against -5.4e-8)
    check_vs_reference(lambda a, b: token_logprobs(a, b, tokens, temperature),
                       lambda a, b: ref_token_logprobs(a, b, tokens, temperature), [h, w], dtype, gen, ["hidden", "lm_head"],
                       forward_scale_floor=1.0)


def test_token_logprobs_backward_gradcheck():
    gen = _gen(5)
    tokens = torch.tensor([0, 6, 3])
    h, w = _randn(gen, 3, 10), _randn(gen, 7, 10, scale=0.5)
    for temperature in (1.0, 0.7):
        gradcheck_kernel_backward(lambda a, b: token_logprobs(a, b, tokens, temperature),
                                  lambda a, b: ref_token_logprobs(a, b, tokens, temperature), (h, w))
