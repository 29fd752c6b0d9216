"""Hybrid Mamba-2 kernels (issue #8): causal_conv1d, mamba_dt, ssd_scan / ssd_continue, gated_rms_norm, relu_squared.

Bitwise properties (``torch.equal``, never a tolerance):

* decode-vs-prefill at EVERY position: a whole-sequence ``ssd_scan`` against the same
  sequence fed token by token through ``ssd_continue`` and against random chunked-prefill
  splits (piece lengths not aligned to ``chunk_size``) — outputs, boundary states and the
  pending tokens after every piece; the same for ``causal_conv1d`` with state passing;
* a sequence alone vs inside a batch of other sequences (leading batch dims), at 1 or 2
  torch threads on either side;
* bf16 and fp32 inputs throughout.

Accuracy against the independent float64 oracle (:mod:`verify.ssm_reference`, a plain
token-by-token recurrence — no chunks) on identical inputs:

* forward: ``|y - y64| <= u_out * |y64| + 2 * 2**-14 * scale`` where ``u_out`` is the unit
  roundoff of the output dtype (the one final rounding: 2**-8 bf16, 2**-24 fp32) and
  ``scale`` is the oracle run on absolute values (``|x|, |B|, |C|, |D|, |S0|``) = the sum of
  the magnitudes of every term reaching ``y``.  Justification: each term passes through
  <= ~2 log2(L) + log2(N) + 8 float32 roundings (doubling prefix scan of dt*A, log2 L adds;
  one exp, <= 4 products, two fixed trees, two adds) and a state through one update per
  chunk, so a first-order bound is gamma_k * scale with k of a few tens (plus the exp's
  sensitivity to the rounding of cum): measured <= 102 u32 over 40 random cases and none
  over the limit in 300 ("thorough" profile); 2**-14 = 1024 u32 leaves 10x headroom while a
  wrong formula errs by O(1).  Boundary states: ``2**-14 * scale`` likewise.
* SSD gradients (fp32 inputs; the backward is a float32 recompute through cumsum/einsum,
  reductions of <= ~10^3 terms, error ~ log2(K) u ~ 1e-6 of the terms' magnitudes):
  ``grad x, B, C, D, S0`` elementwise <= 2**-16 (256 u) times the sum of the magnitudes of
  their terms (the oracle's gradient at absolute inputs — y is multilinear in them with
  nonnegative coefficients; a plain relative error fails on cancelling sums such as
  ``grad D = sum_t gy x`` of one head); ``grad dt`` relative Frobenius <= 1e-5 (measured
  <= 7e-7).  ``grad A`` is a sum over every
  token of contributions that cancel (|grad A| can be orders of magnitude below the sum of
  the magnitudes, e.g. when exp(dt A) ~ 1e-7), so it is bounded relative to that sum, per
  head, which the oracle gives by differentiating w.r.t. a per-token copy of ``A``:
  <= 1e-5 (measured <= 3.5e-7; the backward's segment sums are masked cumsums, not
  differences of cumsums, so no O(1) gradient pairs cancel into it).
  conv1d, gated_rms_norm and mamba_dt gradients are bounded elementwise by 2**-16 (256 u) times
  the sum of the magnitudes of the terms each element adds (their weight / bias gradients are
  row sums that can cancel to far below the terms, e.g. a one-channel conv or group_size 1).

Deliberately broken variants are caught by the same decode-vs-prefill checker
(``hypothesis.find`` must produce a violating case): an intra-chunk reduction that sums
only the tokens present in the call with ``torch.sum`` (length-dependent), the stock
per-token recurrent decode update, and a conv1d whose one-token decode path reduces the
taps with a tree instead of the prefill's left-to-right sum.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from megatron_consistent.kernels import (
    causal_conv1d,
    dispatch,
    gated_rms_norm,
    mamba_dt,
    relu_squared,
    ssd_chunk_end_state,
    ssd_continue,
    ssd_outputs_at,
    ssd_scan,
)
from megatron_consistent.kernels.numerics import exp, tree_sum
from megatron_consistent.verify.ssm_reference import (
    causal_conv1d_f64,
    gated_rms_norm_f64,
    mamba_dt_f64,
    relu_squared_f64,
    ssd_recurrence_f64,
)

ssd_module = importlib.import_module("megatron_consistent.kernels.ssd")

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPES = (BF16, F32)
U_OUT = {BF16: 2.0**-8, F32: 2.0**-24}
SSD_FWD_TOL = 2.0**-14
GRAD_REL_TOL = 1e-5
GRAD_TERMS_TOL = 2.0**-16

seeds = st.integers(0, 2**32 - 1)
# The expensive properties run half the active profile's examples (10 under "ci", 150 under "thorough").
FEWER = settings(max_examples=max(1, settings.default.max_examples // 2))
threads = st.sampled_from((1, 2))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _differences(a, b) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"output {i}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x, y):
            return f"output {i}: {int((x != y).sum())} of {x.numel()} elements differ"
    return None


@contextlib.contextmanager
def swapped_kernel(op: str, fn):
    """Register ``fn`` as the CPU forward of ``op`` for the body; the real kernel is restored afterwards."""
    original = dispatch.implementation(op, torch.device("cpu"))
    dispatch.register(op, "cpu")(fn)
    try:
        yield
    finally:
        dispatch.register(op, "cpu")(original)


def _pieces(draw, total: int, max_piece: int) -> list[int]:
    pieces = []
    while total:
        n = draw(st.integers(1, min(total, max_piece)))
        pieces.append(n)
        total -= n
    return pieces


# --------------------------------------------------------------------------- SSD cases


@dataclass(frozen=True)
class SSDCase:
    seed: int
    t: int
    nh: int
    ng: int
    hp: int
    ns: int
    chunk: int
    dtype: torch.dtype
    with_state: bool


@st.composite
def ssd_cases(draw, max_t=70, dtypes=DTYPES):
    nh = draw(st.sampled_from((1, 2, 4)))
    return SSDCase(
        seed=draw(seeds), t=draw(st.integers(1, max_t)), nh=nh,
        ng=draw(st.sampled_from([g for g in (1, 2, 4) if nh % g == 0])),
        hp=draw(st.integers(1, 16)), ns=draw(st.integers(1, 16)), chunk=draw(st.integers(4, 16)),
        dtype=draw(st.sampled_from(dtypes)), with_state=draw(st.booleans()),
    )


@st.composite
def ssd_problems(draw, max_t=70, dtypes=DTYPES):
    """A case plus a random chunked-prefill split of its tokens (pieces not aligned to the chunk size)."""
    case = draw(ssd_cases(max_t, dtypes))
    return case, _pieces(draw, case.t, 2 * case.chunk + 3)


def ssd_inputs(case: SSDCase, lead=()) -> dict:
    """x, dt (from mamba_dt), A in [-8, -0.5], B, C, D and an optional float32 initial state."""
    g = _gen(case.seed)
    dt_raw = _randn(g, *lead, case.t, case.nh)
    dt_bias = torch.rand(case.nh, generator=g) * 5 - 4
    return dict(
        x=_randn(g, *lead, case.t, case.nh, case.hp, dtype=case.dtype),
        dt=mamba_dt(dt_raw, dt_bias),
        A=-(torch.rand(case.nh, generator=g) * 7.5 + 0.5),
        B=_randn(g, *lead, case.t, case.ng, case.ns, dtype=case.dtype),
        C=_randn(g, *lead, case.t, case.ng, case.ns, dtype=case.dtype),
        D=_randn(g, case.nh),
        S0=_randn(g, *lead, case.nh, case.hp, case.ns) if case.with_state else None,
    )


def _tok(v, start, end, tail):
    """Slice tokens start:end of a [..., T, *tail] tensor."""
    return v[(..., slice(start, end)) + (slice(None),) * tail]


def ssd_decode_violation(inp: dict, chunk: int, pieces: list[int], step=ssd_continue) -> str | None:
    """Whole-sequence ``ssd_scan`` vs the sequence fed piece by piece through ``step`` (``ssd_continue`` signature).

    After every piece: the piece's outputs, the boundary state (vs ``ssd_scan`` of the prefix of
    complete chunks) and the pending tokens (vs the inputs since that boundary) must be identical.
    """
    x, dt, A, B, C, D, S0 = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "S0"))
    y_whole, _ = ssd_scan(x, dt, A, B, C, D, chunk, S0)
    ref_states = {}
    state, pending, start = S0, None, 0
    for n in pieces:
        end = start + n
        y_new, state, pending = step(state, pending, _tok(x, start, end, 2), _tok(dt, start, end, 1),
                                     _tok(B, start, end, 2), _tok(C, start, end, 2), A, D, chunk)
        if not torch.equal(y_new, _tok(y_whole, start, end, 2)):
            return f"y differs on tokens {start}..{end - 1}"
        boundary = end // chunk * chunk
        if boundary not in ref_states:
            ref_states[boundary] = ssd_scan(_tok(x, 0, boundary, 2), _tok(dt, 0, boundary, 1), A,
                                            _tok(B, 0, boundary, 2), _tok(C, 0, boundary, 2), D, chunk, S0)[1]
        if not torch.equal(state, ref_states[boundary]):
            return f"boundary state differs after token {end - 1}"
        expected = (_tok(x, boundary, end, 2), _tok(dt, boundary, end, 1), _tok(B, boundary, end, 2), _tok(C, boundary, end, 2))
        if _differences(pending, expected) is not None:
            return f"pending tokens differ after token {end - 1}"
        start = end
    return None


# --------------------------------------------------------------------------- (a) decode vs prefill


@given(problem=ssd_problems())
def test_ssd_token_by_token_and_chunked_prefill_match_whole_sequence(problem):
    case, pieces = problem
    inp = ssd_inputs(case)
    assert ssd_decode_violation(inp, case.chunk, [1] * case.t) is None
    assert ssd_decode_violation(inp, case.chunk, pieces) is None


@st.composite
def conv_problems(draw, max_t=70):
    t = draw(st.integers(1, max_t))
    return dict(seed=draw(seeds), t=t, channels=draw(st.integers(1, 24)), k=draw(st.integers(1, 5)),
                dtype=draw(st.sampled_from(DTYPES)), with_bias=draw(st.booleans()), with_state=draw(st.booleans()),
                activation=draw(st.sampled_from(("silu", None))), pieces=_pieces(draw, t, 9))


def conv_inputs(p: dict, lead=()):
    g = _gen(p["seed"])
    x = _randn(g, *lead, p["t"], p["channels"], dtype=p["dtype"])
    w = _randn(g, p["channels"], p["k"], dtype=p["dtype"], scale=p["k"] ** -0.5)
    b = _randn(g, p["channels"], dtype=p["dtype"]) if p["with_bias"] else None
    s = _randn(g, *lead, p["k"] - 1, p["channels"], dtype=p["dtype"]) if p["with_state"] else None
    return x, w, b, s


def conv_decode_violation(p: dict, pieces: list[int]) -> str | None:
    """Whole-sequence conv vs piece-wise with state passing: outputs and states after every piece."""
    x, w, b, s0 = conv_inputs(p)
    y_whole, _ = causal_conv1d(x, w, b, s0, p["activation"])
    history = torch.cat([x.new_zeros(p["k"] - 1, p["channels"]) if s0 is None else s0, x])
    state, start = s0, 0
    for n in pieces:
        y, state = causal_conv1d(x[start:start + n], w, b, state, p["activation"])
        if not torch.equal(y, y_whole[start:start + n]):
            return f"y differs on tokens {start}..{start + n - 1}"
        start += n
        if not torch.equal(state, history[start:start + p["k"] - 1]):
            return f"state differs after token {start - 1}"
    return None


@given(p=conv_problems())
def test_conv1d_token_by_token_and_pieces_match_whole_sequence(p):
    assert conv_decode_violation(p, [1] * p["t"]) is None
    assert conv_decode_violation(p, p["pieces"]) is None


# --------------------------------------------------------------------------- (b, c) batch and threads


def _lead_and_index(data):
    lead = data.draw(st.sampled_from(((1,), (3,), (2, 3))), label="leading dims")
    index = tuple(data.draw(st.integers(0, n - 1), label="row") for n in lead)
    return lead, index


@FEWER
@given(problem=ssd_problems(max_t=40), data=st.data(), t_alone=threads, t_batch=threads)
def test_ssd_sequence_alone_vs_in_batch(problem, data, t_alone, t_batch, torch_threads):
    """ssd_scan and a chunked-prefill run of ssd_continue: a sequence's bits alone == inside a batch (any thread count)."""
    case, pieces = problem
    lead, index = _lead_and_index(data)
    batch = ssd_inputs(case, lead)
    alone = {k: (v if v is None or k in ("A", "D") else v[index][None]) for k, v in batch.items()}

    def run(inp):
        outs = list(ssd_scan(*(inp[k] for k in ("x", "dt", "A", "B", "C", "D")), case.chunk, inp["S0"]))
        state, pending, start = inp["S0"], None, 0
        for n in pieces:
            sl = lambda v, tail: _tok(v, start, start + n, tail)  # noqa: E731
            y, state, pending = ssd_continue(state, pending, sl(inp["x"], 2), sl(inp["dt"], 1), sl(inp["B"], 2),
                                             sl(inp["C"], 2), inp["A"], inp["D"], case.chunk)
            outs += [y, state, *pending]
            start += n
        return outs

    with torch_threads(t_alone):
        out_alone = [o[0] for o in run(alone)]
    with torch_threads(t_batch):
        out_batch = [o[index] for o in run(batch)]
    assert _differences(out_alone, out_batch) is None


@FEWER
@given(p=conv_problems(max_t=30), data=st.data(), t_alone=threads, t_batch=threads)
def test_conv1d_sequence_alone_vs_in_batch(p, data, t_alone, t_batch, torch_threads):
    lead, index = _lead_and_index(data)
    x, w, b, s = conv_inputs(p, lead)
    with torch_threads(t_alone):
        alone = causal_conv1d(x[index][None], w, b, None if s is None else s[index][None], p["activation"])
    with torch_threads(t_batch):
        batched = causal_conv1d(x, w, b, s, p["activation"])
    assert _differences([a[0] for a in alone], [o[index] for o in batched]) is None


@given(seed=seeds, groups=st.integers(1, 4), group_size=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       data=st.data(), t_alone=threads, t_batch=threads)
def test_elementwise_ops_row_alone_vs_in_batch(seed, groups, group_size, dtype, data, t_alone, t_batch, torch_threads):
    """gated_rms_norm, relu_squared and mamba_dt: a row's bits do not depend on the other rows or the thread count."""
    lead, index = _lead_and_index(data)
    g = _gen(seed)
    d = groups * group_size
    y, z = _randn(g, *lead, 5, d, dtype=dtype), _randn(g, *lead, 5, d, dtype=dtype, scale=3.0)
    weight = _randn(g, d, dtype=dtype)
    dt_raw, dt_bias = _randn(g, *lead, 5, groups, scale=8.0), _randn(g, groups)
    ops = [lambda y, z, r: gated_rms_norm(y, z, weight, group_size, 1e-5),
           lambda y, z, r: relu_squared(z),
           lambda y, z, r: mamba_dt(r, dt_bias),
           lambda y, z, r: mamba_dt(r, dt_bias, 0.01, 2.0)]
    with torch_threads(t_alone):
        alone = [op(y[index][None], z[index][None], dt_raw[index][None])[0] for op in ops]
    with torch_threads(t_batch):
        batched = [op(y, z, dt_raw)[index] for op in ops]
    assert _differences(alone, batched) is None


def test_one_vs_two_threads_on_a_larger_call(torch_threads):
    """Every op on a larger call (several hundred tokens) gives the same bits at 1 and 2 threads."""
    case = SSDCase(seed=7, t=300, nh=4, ng=2, hp=16, ns=16, chunk=16, dtype=BF16, with_state=True)
    inp = ssd_inputs(case, (2,))
    g = _gen(8)
    xc = _randn(g, 2, 300, 96, dtype=BF16)
    wc = _randn(g, 96, 4, dtype=BF16)

    def everything():
        y, s = ssd_scan(*(inp[k] for k in ("x", "dt", "A", "B", "C", "D")), 16, inp["S0"])
        pending = tuple(_tok(inp[k], 288, 295, 1 if k == "dt" else 2) for k in ("x", "dt", "B", "C"))
        y2, s2, p2 = ssd_continue(s, pending, *(_tok(inp[k], 295, 300, 1 if k == "dt" else 2) for k in ("x", "dt", "B", "C")),
                                  inp["A"], inp["D"], 16)
        yc, sc = causal_conv1d(xc, wc, None, None)
        yn = gated_rms_norm(xc, xc, wc[:, 0], 24, 1e-5)
        return [y, s, y2, s2, *p2, yc, sc, yn, relu_squared(xc), mamba_dt(inp["dt"], inp["D"])]

    with torch_threads(1):
        one = everything()
    with torch_threads(2):
        two = everything()
    assert _differences(one, two) is None
    assert torch.equal(one[2], one[0][:, 295:])  # the replayed tokens equal the whole-sequence ones


@settings(max_examples=8)
@given(case=ssd_cases(max_t=40), work=st.sampled_from((1, 7, 300)))
def test_ssd_work_blocking_is_memory_only(case, work):
    """Splitting the work into blocks of positions / chunks / heads (tiny budgets) does not change a bit."""
    inp = ssd_inputs(case, (2,))
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D")]
    whole = ssd_scan(*args, case.chunk, inp["S0"])
    with mock.patch.object(ssd_module, "_WORK_ELEMENTS", work):
        blocked = ssd_scan(*args, case.chunk, inp["S0"])
    assert _differences(whole, blocked) is None


@given(case=ssd_cases(max_t=16), data=st.data())
def test_ssd_outputs_at_are_the_scan_outputs(case, data):
    """``ssd_outputs_at`` (the engine's decode step: one position a sequence, ragged, within one chunk) gives the
    whole scan's outputs at those positions, bitwise."""
    inp = ssd_inputs(case, (3,))
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D")]
    t = min(case.t, case.chunk)
    part = [v[:, :t] if v.dim() > 1 else v for v in args]
    y, _ = ssd_scan(*args, case.chunk, inp["S0"])
    pos = torch.tensor(data.draw(st.lists(st.integers(0, t - 1), min_size=3, max_size=3)))
    assert torch.equal(ssd_outputs_at(*part, case.chunk, inp["S0"], pos), y[torch.arange(3), pos])


@given(case=ssd_cases(max_t=16), closing=st.lists(st.booleans(), min_size=3, max_size=3))
def test_ssd_chunk_end_state_is_the_scan_boundary_state(case, closing):
    """``ssd_chunk_end_state`` over one complete chunk gives ``ssd_scan``'s boundary state, bitwise; rows not
    closing get their state back unchanged."""
    inp = ssd_inputs(case, (3,))
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D")]
    if case.t < case.chunk:
        return
    one = [v[:, :case.chunk] if v.dim() > 1 else v for v in args]
    state = inp["S0"] if inp["S0"] is not None else torch.zeros(3, case.nh, case.hp, case.ns)
    _, boundary = ssd_scan(*one, case.chunk, state)
    assert torch.equal(ssd_chunk_end_state(*one[:5], case.chunk, state), boundary)
    mask = torch.tensor(closing)
    got = ssd_chunk_end_state(*one[:5], case.chunk, state, mask)
    assert torch.equal(got, torch.where(mask[:, None, None, None], boundary, state))


@given(seed=seeds, n=st.integers(1, 40), tail=st.sampled_from(((), (3,), (2, 5))))
def test_leading_axis_tree_is_numerics_tree_sum(seed, n, tail):
    """The kernel's fast tree over axis 0 is numerics.tree_sum (same pairing, same bits)."""
    x = _randn(_gen(seed), n, *tail, scale=1e3)
    assert torch.equal(ssd_module._tree_sum0(x), tree_sum(x, dim=0))


# --------------------------------------------------------------------------- (e) forward vs float64 oracle


@given(case=ssd_cases())
def test_ssd_forward_vs_f64_recurrence(case):
    inp = ssd_inputs(case)
    x, dt, A, B, C, D, S0 = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "S0"))
    y, state = ssd_scan(x, dt, A, B, C, D, case.chunk, S0)
    assert y.dtype == case.dtype and state.dtype == F32
    y64, states64 = ssd_recurrence_f64(x, dt, A, B, C, D, S0)
    absolute = lambda v: None if v is None else v.abs()  # noqa: E731
    scale, sscale = ssd_recurrence_f64(x.abs(), dt, A, B.abs(), C.abs(), D.abs(), absolute(S0))
    assert ((y.to(F64) - y64).abs() <= U_OUT[case.dtype] * y64.abs() + 2 * SSD_FWD_TOL * scale).all()
    b = case.t // case.chunk * case.chunk
    assert ((state.to(F64) - states64[b]).abs() <= SSD_FWD_TOL * sscale[b]).all()


@given(p=conv_problems())
def test_conv1d_forward_vs_f64(p):
    x, w, b, s = conv_inputs(p)
    y, state = causal_conv1d(x, w, b, s, p["activation"])
    y64, state64 = causal_conv1d_f64(x, w, b, s, p["activation"])
    scale, _ = causal_conv1d_f64(x.abs(), w.abs(), None if b is None else b.abs(), None if s is None else s.abs(), None)
    # K products + K sums + silu (exp, add, divide): <= ~12 float32 roundings relative to the magnitude sum.
    assert ((y.to(F64) - y64).abs() <= U_OUT[p["dtype"]] * y64.abs() + 2.0**-18 * scale).all()
    assert torch.equal(state.to(F64), state64)


@given(seed=seeds, groups=st.integers(1, 4), group_size=st.integers(1, 64), dtype=st.sampled_from(DTYPES),
       eps=st.sampled_from((1e-5, 1e-6)))
def test_gated_rms_norm_relu_squared_mamba_dt_vs_f64(seed, groups, group_size, dtype, eps):
    g = _gen(seed)
    d = groups * group_size
    y, z, w = _randn(g, 6, d, dtype=dtype), _randn(g, 6, d, dtype=dtype, scale=4.0), _randn(g, d, dtype=dtype)
    out, out64 = gated_rms_norm(y, z, w, group_size, eps), gated_rms_norm_f64(y, z, w, group_size, eps)
    # silu (3 roundings), square + tree over <= 64 (7), sqrt/divide (2), two products: ~15 u relative; allow 128 u.
    assert out.dtype == dtype
    assert ((out.to(F64) - out64).abs() <= (U_OUT[dtype] + 2.0**-17) * out64.abs()).all()
    r = relu_squared(z)
    assert ((r.to(F64) - relu_squared_f64(z)).abs() <= U_OUT[dtype] * relu_squared_f64(z)).all()
    dt_raw, dt_bias = _randn(g, 6, groups, scale=12.0), _randn(g, groups, scale=3.0)
    for lo, hi in ((0.0, float("inf")), (0.001, 5.0)):
        dt, dt64 = mamba_dt(dt_raw, dt_bias, lo, hi), mamba_dt_f64(dt_raw, dt_bias, lo, hi)
        # The float32 add v = dt_raw + dt_bias rounds by u|v|, which softplus passes on with relative gain
        # sigmoid(v)|v| / softplus(v) <= |v|; exp, the float64 log and the last rounding add a few u: allow (16 + |v|) u.
        v = dt_raw.to(F64) + dt_bias.to(F64)
        assert dt.dtype == F32 and ((dt.to(F64) - dt64).abs() <= (16 + v.abs()) * 2.0**-24 * dt64.abs()).all()


# --------------------------------------------------------------------------- (f) gradients vs float64 oracle


def _rel(a, b) -> float:
    return float((a.to(F64) - b).norm() / b.norm().clamp_min(1e-300))


def _ssd_term_magnitudes(inp, gy, gs, boundary) -> dict:
    """Per element, the sum of the magnitudes of the terms of grad x, B, C, D, S0 and A.

    y and the states are multilinear in (x, B, C, D, S0) with nonnegative coefficients (dt >= 0, decays > 0), so
    the float64 gradient at |x|, |B|, |C|, |D|, |S0| with output gradients |gy|, |gs| adds every term's magnitude.
    A enters through the decays only, ``d exp(dt * A) / dA = dt * exp(dt * A) >= 0``: each term of grad A is such a
    nonnegative factor times a product of the others, so the same gradient (per token, summed) adds theirs too.
    """
    names = ("x", "B", "C", "D", "S0")
    leaves = [inp[k].detach().abs().to(F64).requires_grad_(True) for k in names]
    a_tok = inp["A"].detach().to(F64).expand(*inp["dt"].shape).clone().requires_grad_(True)
    y, states = ssd_recurrence_f64(leaves[0], inp["dt"], a_tok, *leaves[1:4], leaves[4])
    outs, gouts = [y], [gy.abs().to(F64)]
    if gs is not None:
        outs.append(states[boundary])
        gouts.append(gs.abs().to(F64))
    grads = torch.autograd.grad(outs, [*leaves, a_tok], gouts)
    return {**dict(zip(names, grads[:-1])), "A": grads[-1].sum(0)}


@FEWER
@given(case=ssd_cases(max_t=40, dtypes=(F32,)), pending=st.integers(0, 15))
def test_ssd_gradients_vs_f64(case, pending):
    inp = ssd_inputs(case)
    names = ("x", "dt", "A", "B", "C", "D", "S0")
    if inp["S0"] is None:
        inp["S0"] = torch.zeros(case.nh, case.hp, case.ns)
    leaves = [inp[k].clone().requires_grad_(True) for k in names]
    y, state = ssd_scan(*leaves[:6], case.chunk, leaves[6])
    g = _gen(case.seed + 1)
    gy, gs = _randn(g, *y.shape), _randn(g, *state.shape)
    grads = torch.autograd.grad([y, state], leaves, [gy, gs])

    x64 = [inp[k].detach().to(F64).requires_grad_(True) for k in names]
    a_tok = x64[2].detach().expand(case.t, case.nh).clone().requires_grad_(True)   # per-token copy of A
    y64, states64 = ssd_recurrence_f64(*x64[:2], a_tok, *x64[3:6], x64[6])
    b = case.t // case.chunk * case.chunk
    ref = torch.autograd.grad([y64, states64[b]], [*x64[:2], a_tok, *x64[3:]], [gy.to(F64), gs.to(F64)])
    magnitudes = _ssd_term_magnitudes(inp, gy, gs, b)
    for name, got, want in zip(names, grads, ref):
        if name == "A":  # float32 rounding scales with the terms, not with their sum (they cancel: session 13's CI)
            assert ((got.to(F64) - want.sum(0)).abs() <= GRAD_TERMS_TOL * magnitudes["A"] + 1e-30).all()
        elif name == "dt":
            assert _rel(got, want) <= GRAD_REL_TOL, name
        else:
            assert ((got.to(F64) - want).abs() <= GRAD_TERMS_TOL * magnitudes[name] + 1e-30).all(), name

    # ssd_continue: gradients of the new tokens' outputs reach the new inputs and the boundary state.
    p = min(pending, case.chunk - 1, case.t - 1)
    new = [inp[k][p:].clone().requires_grad_(True) for k in ("x", "dt", "B", "C")]
    s0 = inp["S0"].clone().requires_grad_(True)
    y_new, _, _ = ssd_continue(s0, tuple(inp[k][:p] for k in ("x", "dt", "B", "C")), *new, inp["A"], inp["D"], case.chunk)
    gy_new = _randn(g, *y_new.shape)
    got = torch.autograd.grad(y_new, [*new, s0], gy_new)
    n64 = [inp[k][p:].to(F64).requires_grad_(True) for k in ("x", "dt", "B", "C")]
    s64 = inp["S0"].to(F64).requires_grad_(True)
    full = [torch.cat([inp[k][:p].to(F64), v]) for k, v in zip(("x", "dt", "B", "C"), n64)]
    y64, _ = ssd_recurrence_f64(full[0], full[1], inp["A"], full[2], full[3], inp["D"], s64)
    want = torch.autograd.grad(y64[p:], [*n64, s64], gy_new.to(F64))
    magnitudes = _ssd_term_magnitudes(inp, torch.cat([torch.zeros(p, *gy_new.shape[1:]), gy_new]), None, b)
    for name, a, w in zip(("x", "dt", "B", "C", "S0"), got, want):
        if name == "dt":
            assert _rel(a, w) <= GRAD_REL_TOL, "ssd_continue dt"
        else:
            scale = magnitudes[name] if name == "S0" else magnitudes[name][p:]
            assert ((a.to(F64) - w).abs() <= GRAD_TERMS_TOL * scale + 1e-30).all(), f"ssd_continue {name}"


@given(p=conv_problems(max_t=30))
def test_conv1d_gradients_vs_f64(p):
    """float32 recompute backward vs float64 autograd, elementwise, relative to the magnitude of each gradient's terms.

    grad_w and grad_b sum over T, grad_x over K taps, and the terms can cancel (one channel, K = 1: grad_w is a
    26-term sum of mixed signs), so each element is bounded by 2**-16 (256 u) times the sum of the magnitudes of
    its terms: with G = |g| * |silu'|-magnitude, grad_x <- sum_j G |w|, grad_w <- sum_t G |xin|, grad_b <- sum_t G.
    """
    p = dict(p, dtype=F32, with_state=True)
    x, w, b, s = conv_inputs(p)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, s) if t is not None]
    y, state = causal_conv1d(leaves[0], leaves[1], leaves[2] if b is not None else None, leaves[-1], p["activation"])
    g = _gen(p["seed"] + 1)
    gy, gs = _randn(g, *y.shape), _randn(g, *state.shape)
    outs = [y, state] if state.numel() else [y]
    got = torch.autograd.grad(outs, leaves, [gy, gs][:len(outs)])
    l64 = [t.detach().to(F64).requires_grad_(True) for t in leaves]
    y64, state64 = causal_conv1d_f64(l64[0], l64[1], l64[2] if b is not None else None, l64[-1], p["activation"])
    want = torch.autograd.grad([y64, state64][:len(outs)], l64, [gy.to(F64), gs.to(F64)][:len(outs)], allow_unused=True)

    k = p["k"]
    xin = torch.cat([s, x]).to(F64)
    v, _ = causal_conv1d_f64(x, w, b, s, None)
    sig = torch.sigmoid(v)
    big_g = gy.to(F64).abs() * (sig * (1 + v.abs() * (1 - sig)) if p["activation"] == "silu" else 1.0)
    windows = xin.abs().unfold(0, k, 1)                                   # [T, C, K]
    scale_xin = torch.zeros_like(xin)
    for j in range(k):                                                    # xin[t + j] feeds y[t] through w[:, j]
        scale_xin[j:j + x.shape[0]] += big_g * w.to(F64).abs()[:, j]
    scale_xin[xin.shape[0] - (k - 1):] += gs.to(F64).abs()
    scales = [scale_xin[k - 1:], (windows * big_g[..., None]).sum(0)]
    if b is not None:
        scales.append(big_g.sum(0))
    scales.append(scale_xin[:k - 1])
    for a, wnt, scale in zip(got, want, scales, strict=True):
        wnt = torch.zeros_like(a, dtype=F64) if wnt is None else wnt
        assert ((a.to(F64) - wnt).abs() <= 2.0**-16 * scale + 1e-30).all()


@given(seed=seeds, groups=st.integers(1, 4), group_size=st.integers(1, 32))
def test_gated_norm_relu_squared_mamba_dt_gradients_vs_f64(seed, groups, group_size):
    g = _gen(seed)
    d = groups * group_size
    y, z, w = (_randn(g, 3, 4, d, scale=s).requires_grad_(True) for s in (1.0, 3.0, 1.0))
    w = _randn(g, d).requires_grad_(True)
    gout = _randn(g, 3, 4, d)
    got = torch.autograd.grad(gated_rms_norm(y, z, w, group_size, 1e-5), [y, z, w], gout)
    l64 = [t.detach().to(F64).requires_grad_(True) for t in (y, z, w)]
    want = torch.autograd.grad(gated_rms_norm_f64(*l64, group_size, 1e-5), l64, gout.to(F64))
    # grad_h = rstd * (gw - xhat * mean(gw * xhat)) cancels badly when a group is dominated by one channel
    # (group_size 1: out ~ sign(h), grad ~ eps / h^3), so y and z are bounded elementwise relative to the
    # magnitude of the two terms (float32 chain of ~10 ops and a <= 32-term reduction: ~20 u; allow 256 u);
    # grad_w likewise relative to the sum of the magnitudes of its per-row terms.
    y64, z64, w64 = (t.detach().to(F64) for t in (y, z, w))
    sig = torch.sigmoid(z64)
    h = (y64 * z64 * sig).reshape(3, 4, groups, group_size)
    rstd = 1 / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5)
    gw = (gout.to(F64) * w64).reshape(h.shape)
    scale_h = (rstd * (gw.abs() + (h * rstd).abs() * (gw * h * rstd).abs().mean(-1, keepdim=True))).reshape(y64.shape)
    scales = ((z64 * sig).abs() * scale_h, (y64 * sig).abs() * (1 + z64.abs() * (1 - sig)) * scale_h)
    scale_w = (gout.to(F64).abs() * (h * rstd).abs().reshape(y64.shape)).sum((0, 1))   # grad_w = sum_rows g * xhat
    for a, b, scale in zip(got, want, (*scales, scale_w)):
        assert ((a.to(F64) - b).abs() <= 2.0**-16 * scale + 1e-30).all()

    (gr,) = torch.autograd.grad(relu_squared(z), [z], gout)
    z64 = z.detach().to(F64).requires_grad_(True)
    (gr64,) = torch.autograd.grad(relu_squared_f64(z64), [z64], gout.to(F64))
    assert _rel(gr, gr64) <= GRAD_REL_TOL

    dt_raw, dt_bias = _randn(g, 3, 7, groups, scale=6.0).requires_grad_(True), _randn(g, groups).requires_grad_(True)
    gdt = _randn(g, 3, 7, groups)
    for lo, hi in ((0.0, float("inf")), (0.01, 3.0)):
        got = torch.autograd.grad(mamba_dt(dt_raw, dt_bias, lo, hi), [dt_raw, dt_bias], gdt)
        l64 = [t.detach().to(F64).requires_grad_(True) for t in (dt_raw, dt_bias)]
        want = torch.autograd.grad(mamba_dt_f64(*l64, lo, hi), l64, gdt.to(F64))
        # grad_raw = g * sigmoid(v) inside the clamp, elementwise; grad_bias sums it over rows (terms may cancel),
        # so both are bounded by 2**-16 times the sum of |g| * sigmoid(v) over the elements they add.
        terms = gdt.to(F64).abs() * torch.sigmoid(dt_raw.detach().to(F64) + dt_bias.detach().to(F64))
        for a, b, scale in zip(got, want, (terms, terms.sum((0, 1)))):
            assert ((a.to(F64) - b).abs() <= 2.0**-16 * scale + 1e-30).all()


# --------------------------------------------------------------------------- (g) broken variants are caught


def _present_tokens_torch_sum(x):
    """BROKEN stand-in for the kernel's tree over axis 0: torch.sum over only the leading entries that hold a
    nonzero anywhere in the call — for the intra-chunk term that is 'the tokens present', so its length (and
    with it torch's accumulation order) depends on how the sequence was split."""
    present = (x != 0).reshape(x.shape[0], -1).any(1).nonzero()
    n = int(present.max()) + 1 if len(present) else 1
    return x[:n].sum(0)


def _recurrent_decode_step(state, pending, x, dt, B, C, A, D, chunk_size):
    """BROKEN stand-in for ssd_continue: the stock per-token recurrent update h = exp(dt A) h + dt x B^T,
    y = C.h + D x (elementwise float32, deterministic functions) — correct math, different bits from the scan."""
    nh, ng = x.shape[-2], B.shape[-2]
    heads = torch.arange(nh) // (nh // ng)
    h = torch.zeros(*x.shape[:-3], nh, x.shape[-1], B.shape[-1]) if state is None else state
    ys = []
    for t in range(x.shape[-3]):
        xt, dtt = x[..., t, :, :].float(), dt[..., t, :]
        bt, ct = B[..., t, :, :].float()[..., heads, :], C[..., t, :, :].float()[..., heads, :]
        h = exp(dtt * A)[..., None, None] * h + (dtt[..., None] * xt)[..., None] * bt[..., None, :]
        ys.append((tree_sum(ct[..., None, :] * h) + D[:, None] * xt).to(x.dtype))
    return torch.stack(ys, dim=-3), h, pending


def _tree_taps_on_decode(x, weight, bias, state, activation):
    """BROKEN stand-in for the conv1d forward: a separate one-token decode path that reduces the K taps by a
    pairwise tree instead of the prefill's left-to-right sum (two kernels, two orders)."""
    if x.shape[-2] != 1:
        return _real_conv(x, weight, bias, state, activation)
    xin = torch.cat([state.to(x.dtype), x], dim=-2).float()
    acc = tree_sum(xin.transpose(-1, -2) * weight.float(), dim=-1)[..., None, :]
    if bias is not None:
        acc = acc + bias.float()
    if activation == "silu":
        acc = acc / (1.0 + exp(-acc))
    return acc.to(x.dtype), xin[..., 1:, :].to(x.dtype)


_real_conv = dispatch.implementation("causal_conv1d", torch.device("cpu"))
FIND = settings(max_examples=60, phases=[Phase.generate], database=None, derandomize=True)


@pytest.mark.parametrize("variant", ["present_tokens_torch_sum", "recurrent_decode"])
def test_decode_checker_catches_broken_ssd(variant):
    def violates(problem):
        case, pieces = problem
        inp = ssd_inputs(case)
        if variant == "recurrent_decode":
            return ssd_decode_violation(inp, case.chunk, [1] * case.t, step=_recurrent_decode_step) is not None
        with mock.patch.object(ssd_module, "_tree_sum0", _present_tokens_torch_sum):
            return (ssd_decode_violation(inp, case.chunk, [1] * case.t) is not None
                    or ssd_decode_violation(inp, case.chunk, pieces) is not None)

    case, pieces = find(ssd_problems(max_t=40), violates, settings=FIND)
    assert ssd_decode_violation(ssd_inputs(case), case.chunk, pieces) is None  # the real kernel passes the same case


def test_decode_checker_catches_broken_conv1d():
    def violates(p):
        with swapped_kernel("causal_conv1d", _tree_taps_on_decode):
            return conv_decode_violation(p, [1] * p["t"]) is not None

    found = find(conv_problems(max_t=20).filter(lambda p: p["k"] >= 3), violates, settings=FIND)
    assert conv_decode_violation(found, [1] * found["t"]) is None


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_by_name():
    x, dt = torch.zeros(5, 4, 2), torch.zeros(5, 4)
    A, D, B = torch.zeros(4), torch.zeros(4), torch.zeros(5, 3, 2)
    with pytest.raises(ValueError, match="4 heads cannot be split over 3 groups"):
        ssd_scan(x, dt, A, B, B, D, 4)
    with pytest.raises(ValueError, match="pending tokens, must be fewer than chunk_size"):
        B2 = torch.zeros(5, 2, 2)
        ssd_continue(None, (x, dt, B2, B2), x, dt, B2, B2, A, D, 4)
    with pytest.raises(ValueError, match=r"ssd_outputs_at: positions \(2,\) is not \(\)"):
        ssd_outputs_at(x, dt, A, torch.zeros(5, 2, 2), torch.zeros(5, 2, 2), D, 4, None, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ssd_outputs_at: 5 tokens, at most one chunk \(4\)"):
        ssd_outputs_at(x, dt, A, torch.zeros(5, 2, 2), torch.zeros(5, 2, 2), D, 4, None, torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ssd_chunk_end_state: 5 tokens, not one chunk \(4\)"):
        ssd_chunk_end_state(x, dt, A, torch.zeros(5, 2, 2), torch.zeros(5, 2, 2), 4, torch.zeros(4, 2, 2))
    with pytest.raises(ValueError, match="state must be float32"):
        ssd_scan(x, dt, A, torch.zeros(5, 2, 2), torch.zeros(5, 2, 2), D, 4, torch.zeros(4, 2, 2, dtype=BF16))
    with pytest.raises(ValueError, match="unsupported activation 'gelu'"):
        causal_conv1d(torch.zeros(3, 4), torch.zeros(4, 2), None, None, "gelu")
    with pytest.raises(ValueError, match="group_size 3 does not divide 8"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 3, 1e-5)


def test_cuda_backend_registers_the_ssm_torch_ops():
    """kernels/cuda_torch_ops.py is part of the lazily imported CUDA backend and registers the CPU contract code for cuda."""
    from megatron_consistent.kernels import cuda_torch_ops
    from megatron_consistent.kernels.dispatch import _IMPLEMENTATIONS, LAZY_BACKENDS

    assert cuda_torch_ops.__name__ in LAZY_BACKENDS["cuda"]
    for op, fn in cuda_torch_ops.OPS.items():
        assert _IMPLEMENTATIONS[(op, "cuda")] is fn


def test_cuda_ssd_scan_choice_is_refused_by_name(monkeypatch):
    """``MC_SSD_SCAN`` picks the CUDA scan's evaluation (kernels/cuda_torch_ops.py): the fused Triton kernels by
    default, the torch one when asked, anything else refused with the variable's name before any work."""
    from megatron_consistent.kernels import cuda_torch_ops, ssd

    monkeypatch.setenv("MC_SSD_SCAN", "torch")
    assert cuda_torch_ops._ssd_evaluation()["ssd_steps"] is ssd.TORCH_STEPS
    monkeypatch.setenv("MC_SSD_SCAN", "cuda")
    with pytest.raises(ValueError, match="MC_SSD_SCAN='cuda'"):
        cuda_torch_ops._ssd_evaluation()["ssd_steps"]
    pytest.importorskip("triton")
    monkeypatch.delenv("MC_SSD_SCAN", raising=False)
    from megatron_consistent.kernels.triton.ssd_scan import TRITON_STEPS

    assert cuda_torch_ops._ssd_evaluation()["ssd_steps"] is TRITON_STEPS
