"""Bitwise invariance of the CPU kernels (every comparison is ``torch.equal``: identical values,
dtype and shape — the bits, up to the sign of a zero).

What must not change a row's bits: how many rows share the call and where the
row sits among them, the thread count, how a sequence is cut into prefill
chunks or decode steps, which other positions / sequences share the call, the
padding around it, whether K/V come from a contiguous buffer or a paged cache,
and simply running the same thing again.

The checkers (``batch_invariance_violation``, ``prefill_decode_violation``) are
applied both to the real kernels, which must pass, and to deliberately
batch-dependent variants registered through :mod:`dispatch`, which they must
catch — so a checker that silently compares nothing cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_consistent.kernels import (
    KV_BLOCK,
    RopeConfig,
    add_residual,
    apply_rope,
    attention,
    causal_positions,
    compute_logits,
    dispatch,
    gather_kv,
    gather_logprobs,
    linear,
    log_softmax,
    rms_norm,
    rope_cache,
    rope_scaling_items,
    silu_and_mul,
    token_logprobs,
    write_kv,
)

# The package re-exports the function `attention` under the submodule's name, so fetch the module itself.
attention_module = importlib.import_module("megatron_consistent.kernels.attention")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CPU = torch.device("cpu")

dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**32 - 1)
threads = st.sampled_from((1, 2))
temperatures = st.sampled_from((1.0, 0.7))
LLAMA3_SCALING = rope_scaling_items(
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64}
)


# --------------------------------------------------------------------------- helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _differences(a, b) -> str | None:
    """None when every tensor of ``a`` equals (``torch.equal``, same dtype and shape) its peer in ``b``; else a description."""
    for i, (x, y) in enumerate(zip(_as_tuple(a), _as_tuple(b), strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"output {i}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x, y):
            n = int((x != y).sum())
            return f"output {i}: {n} of {x.numel()} elements differ"
    return None


@contextlib.contextmanager
def swapped_kernel(op: str, fn):
    """Register ``fn`` as the CPU forward of ``op`` for the body; the real kernel is restored afterwards."""
    original = dispatch.implementation(op, CPU)
    dispatch.register(op, "cpu")(fn)
    try:
        yield
    finally:
        dispatch.register(op, "cpu")(original)


def batch_invariance_violation(op, row, others, position, threads_alone, threads_batch, torch_threads):
    """Compare ``op`` on ``row`` alone (a batch of one) with ``op`` on ``row`` inserted at ``position`` among ``others``.

    ``op`` maps a batch (leading dim = rows) to a tensor or tuple of tensors
    with the same leading dim.  Returns None when the row's outputs have the
    same bits in both calls, else a description of the difference.
    """
    batch = torch.cat([others[:position], row[None], others[position:]])
    with torch_threads(threads_alone):
        alone = tuple(t[0] for t in _as_tuple(op(row[None])))
    with torch_threads(threads_batch):
        in_batch = tuple(t[position] for t in _as_tuple(op(batch)))
    return _differences(alone, in_batch)


def rows_and_position(data, gen, row_shape, dtype, max_batch=24, scale=1.0):
    """Draw a batch size (1..max_batch) and the row's position in it; return (row, other rows, position)."""
    n_others = data.draw(st.integers(0, max_batch - 1), label="other rows")
    position = data.draw(st.integers(0, n_others), label="position")
    row = _randn(gen, *row_shape, dtype=dtype, scale=scale)
    others = _randn(gen, n_others, *row_shape, dtype=dtype, scale=scale)
    return row, others, position


# --------------------------------------------------------------------------- linear


def _linear_op(weight, bias, out_dtype):
    return lambda batch: linear(batch, weight, bias, out_dtype)


@given(data=st.data(), seed=seeds, k=st.integers(1, 300), n=st.integers(1, 40), dtype=dtypes,
       with_bias=st.booleans(), fp32_out=st.booleans(), t_alone=threads, t_batch=threads)
def test_linear_row_alone_vs_in_batch(data, seed, k, n, dtype, with_bias, fp32_out, t_alone, t_batch, torch_threads):
    gen = _gen(seed)
    weight = _randn(gen, n, k, dtype=dtype)
    bias = _randn(gen, n, dtype=dtype) if with_bias else None
    out_dtype = torch.float32 if fp32_out else None
    row, others, position = rows_and_position(data, gen, (k,), dtype)
    op = _linear_op(weight, bias, out_dtype)
    assert batch_invariance_violation(op, row, others, position, t_alone, t_batch, torch_threads) is None


@given(seed=seeds, k=st.integers(1, 200), n=st.integers(1, 24), dtype=dtypes, lead=st.sampled_from([(3, 5), (2, 1, 4), (7,)]))
def test_linear_leading_dims_and_repeat(seed, k, n, dtype, lead):
    """A [..., K] input gives, per row, the bits of the flattened call, of the row alone, and of a second run."""
    gen = _gen(seed)
    weight = _randn(gen, n, k, dtype=dtype)
    x = _randn(gen, *lead, k, dtype=dtype)
    y = linear(x, weight)
    assert y.shape == (*lead, n)
    assert torch.equal(y.reshape(-1, n), linear(x.reshape(-1, k), weight))
    assert torch.equal(y, linear(x, weight))
    flat = x.reshape(-1, k)
    i = seed % flat.shape[0]
    assert torch.equal(y.reshape(-1, n)[i], linear(flat[i : i + 1], weight)[0])


@given(seed=seeds, m=st.integers(1, 9), k=st.integers(1, 200), n=st.integers(1, 24), dtype=dtypes, with_bias=st.booleans())
def test_linear_out_dtype_is_one_rounding_of_fp32_accumulator(seed, m, k, n, dtype, with_bias):
    """Contract: the result in the input dtype is the float32 result rounded once (logits and hidden states agree)."""
    gen = _gen(seed)
    x, weight = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype)
    bias = _randn(gen, n, dtype=dtype) if with_bias else None
    y32 = linear(x, weight, bias, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert torch.equal(linear(x, weight, bias), y32.to(dtype))


def broken_linear(x, w):
    """A plain float32 GEMM: its reduction order depends on the batch shape (BLAS kernel selection)."""
    return (x.float() @ w.float().t()).to(x.dtype)


def _broken_linear_impl(x2d, weight, bias, out_dtype):
    y = broken_linear(x2d.float(), weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _linear_search(torch_threads, max_m=128, k=1024, n=64, seed=0):
    """Scan batch sizes M = 1..max_m (row at a random position) with the batch-invariance checker.

    Returns (op, visited cases, description of the first difference or None).
    """
    gen = _gen(seed)
    weight = _randn(gen, n, k)
    op = _linear_op(weight, None, None)
    visited = []
    for m in range(1, max_m + 1):
        row, others = _randn(gen, k), _randn(gen, m - 1, k)
        position = int(torch.randint(0, m, (1,), generator=gen))
        visited.append((row, others, position))
        found = batch_invariance_violation(op, row, others, position, 1, 1, torch_threads)
        if found is not None:
            return op, visited, found
    return op, visited, None


def test_checker_catches_batch_dependent_linear(torch_threads):
    """The same checker that passes the real linear must flag a BLAS matmul; the real kernel passes those very batches."""
    with swapped_kernel("linear", _broken_linear_impl):
        op, visited, found = _linear_search(torch_threads)
    assert found is not None, "no batch size in 1..128 exposed the batch-dependent matmul"
    assert dispatch.implementation("linear", CPU) is not _broken_linear_impl  # restored
    for row, others, position in visited:
        assert batch_invariance_violation(op, row, others, position, 1, 2, torch_threads) is None


# --------------------------------------------------------------------------- rms_norm


@given(data=st.data(), seed=seeds, hidden=st.integers(1, 300), dtype=dtypes, with_residual=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-5]), t_alone=threads, t_batch=threads)
def test_rms_norm_row_alone_vs_in_batch(data, seed, hidden, dtype, with_residual, eps, t_alone, t_batch, torch_threads):
    gen = _gen(seed)
    weight = _randn(gen, hidden, dtype=dtype)
    if with_residual:
        row, others, position = rows_and_position(data, gen, (2, hidden), dtype, scale=3.0)

        def op(batch):  # returns (normalised, new residual)
            return rms_norm(batch[:, 0], weight, eps, residual=batch[:, 1])
    else:
        row, others, position = rows_and_position(data, gen, (hidden,), dtype, scale=3.0)

        def op(batch):
            return rms_norm(batch, weight, eps)

    assert batch_invariance_violation(op, row, others, position, t_alone, t_batch, torch_threads) is None


@given(seed=seeds, lead=st.sampled_from([(1,), (5,), (2, 3)]), hidden=st.integers(1, 300), dtype=dtypes, res_dtype=dtypes)
def test_rms_norm_fused_residual_equals_unfused(seed, lead, hidden, dtype, res_dtype):
    gen = _gen(seed)
    x = _randn(gen, *lead, hidden, dtype=dtype, scale=2.0)
    residual = _randn(gen, *lead, hidden, dtype=res_dtype, scale=2.0)
    weight = _randn(gen, hidden, dtype=dtype)
    y_fused, h_fused = rms_norm(x, weight, 1e-6, residual=residual)
    h = add_residual(x, residual)
    assert h.dtype == dtype
    assert torch.equal(h_fused, h)
    assert torch.equal(y_fused, rms_norm(h, weight, 1e-6))
    assert torch.equal(rms_norm(x, weight, 1e-6, residual=residual)[0], y_fused)  # repeat


# --------------------------------------------------------------------------- silu_and_mul


@given(data=st.data(), seed=seeds, inter=st.integers(1, 200), dtype=dtypes, t_alone=threads, t_batch=threads)
def test_silu_and_mul_row_alone_vs_in_batch(data, seed, inter, dtype, t_alone, t_batch, torch_threads):
    gen = _gen(seed)
    row, others, position = rows_and_position(data, gen, (2 * inter,), dtype, scale=4.0)
    assert batch_invariance_violation(silu_and_mul, row, others, position, t_alone, t_batch, torch_threads) is None


@given(seed=seeds, inter=st.integers(2, 300), dtype=dtypes, data=st.data())
def test_silu_and_mul_element_independent_of_width(seed, inter, dtype, data):
    """Output column j is the same whether computed in a width-I input or in a narrower one at another index."""
    gen = _gen(seed)
    x = _randn(gen, 3, 2 * inter, dtype=dtype, scale=6.0)
    cols = torch.tensor(sorted(data.draw(st.sets(st.integers(0, inter - 1), min_size=1, max_size=inter), label="cols")))
    narrow = torch.cat([x[:, cols], x[:, inter + cols]], dim=-1)
    assert torch.equal(silu_and_mul(x)[:, cols], silu_and_mul(narrow))


# --------------------------------------------------------------------------- rotary


@st.composite
def rope_configs(draw, max_positions=256):
    head_dim = draw(st.sampled_from([8, 16, 24, 64]))
    rotary_dim = draw(st.sampled_from(sorted({head_dim, head_dim // 2 + (head_dim // 2) % 2, 4})))
    scaling = draw(st.sampled_from([None, LLAMA3_SCALING]))
    style = draw(st.sampled_from(["neox", "gptj"]))
    base = draw(st.sampled_from([10000.0, 500000.0]))
    return head_dim, RopeConfig(rotary_dim, max_positions, base=base, style=style, scaling=scaling)


@given(data=st.data(), seed=seeds, rope=rope_configs(), heads=st.integers(1, 4), dtype=dtypes, t_alone=threads, t_batch=threads)
def test_rope_token_independent_of_other_positions(data, seed, rope, heads, dtype, t_alone, t_batch, torch_threads):
    """A token's rotation depends on its own vector and position only — not on which other positions share the call."""
    head_dim, cfg = rope
    gen = _gen(seed)
    n = data.draw(st.integers(1, 40), label="tokens")
    positions = torch.randint(0, cfg.max_positions, (n,), generator=gen)
    x = _randn(gen, n, heads, head_dim, dtype=dtype, scale=2.0)
    i = data.draw(st.integers(0, n - 1), label="token")
    with torch_threads(t_batch):
        full = apply_rope(x, positions, cfg)
    with torch_threads(t_alone):
        alone = apply_rope(x[i : i + 1], positions[i : i + 1], cfg)
    assert torch.equal(full[i], alone[0])
    # Same token and position inside a batch [B, T, H, D] with other sequences at other positions.
    b = data.draw(st.integers(1, 3), label="batch")
    xb = _randn(gen, b, n, heads, head_dim, dtype=dtype)
    pb = torch.randint(0, cfg.max_positions, (b, n), generator=gen)
    sb, tb = data.draw(st.integers(0, b - 1), label="seq"), data.draw(st.integers(0, n - 1), label="slot")
    xb[sb, tb], pb[sb, tb] = x[i], positions[i]
    assert torch.equal(apply_rope(xb, pb, cfg)[sb, tb], full[i])
    # Dimensions past rotary_dim pass through untouched.
    assert torch.equal(full[..., cfg.rotary_dim :], x[..., cfg.rotary_dim :])
    assert torch.equal(apply_rope(x, positions, cfg), full)  # repeat


@given(rope=rope_configs(max_positions=64), longer=st.integers(1, 5000), seed=seeds, dtype=dtypes)
def test_rope_tables_of_different_lengths_agree(rope, longer, seed, dtype):
    head_dim, short = rope
    long = RopeConfig(short.rotary_dim, short.max_positions + longer, short.base, short.style, short.scaling)
    cos_s, sin_s = rope_cache(short)
    cos_l, sin_l = rope_cache(long)
    assert torch.equal(cos_s, cos_l[: short.max_positions]) and torch.equal(sin_s, sin_l[: short.max_positions])
    gen = _gen(seed)
    positions = torch.randint(0, short.max_positions, (17,), generator=gen)
    x = _randn(gen, 17, 2, head_dim, dtype=dtype)
    assert torch.equal(apply_rope(x, positions, short), apply_rope(x, positions, long))


# --------------------------------------------------------------------------- attention


@st.composite
def head_layouts(draw):
    """(Hq, Hkv, D): MHA, GQA and MQA layouts."""
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 24]))
    return hkv * group, hkv, d


def _qkv(gen, t, hq, hkv, d, dtype, b=1):
    return (_randn(gen, b, t, hq, d, dtype=dtype, scale=2.0), _randn(gen, b, t, hkv, d, dtype=dtype),
            _randn(gen, b, t, hkv, d, dtype=dtype))


def _chunk_bounds(length, sizes):
    bounds, s = [], 0
    for size in sizes:
        if s >= length:
            break
        bounds.append((s, min(length, s + size)))
        s += size
    if s < length:
        bounds.append((s, length))
    return bounds


def prefill_decode_violation(q, k, v, chunk_sizes, *, garbage_capacity=0, gen=None, threads_pair=(1, 1), torch_threads=None):
    """Compare one whole-sequence attention call with the same queries computed chunk by chunk over a cached prefix.

    ``q, k, v`` hold one sequence (B=1).  Chunk ``[s, e)`` attends to keys
    ``0..e-1`` held in a buffer of capacity ``e + garbage_capacity`` whose tail
    is filled with random values and cut off by ``k_lengths``.  Returns None if
    every query's output has the same bits, else a description.
    """
    t = q.shape[1]
    ctx = torch_threads or (lambda n: contextlib.nullcontext())
    with ctx(threads_pair[0]):
        full = attention(q, k, v, causal_positions(1, t))
    for s, e in _chunk_bounds(t, chunk_sizes):
        kc, vc = k[:, :e], v[:, :e]
        if garbage_capacity:
            pad = _randn(gen, 1, garbage_capacity, *k.shape[2:], dtype=k.dtype, scale=5.0)
            kc, vc = torch.cat([kc, pad], 1), torch.cat([vc, pad.flip(-1)], 1)
        with ctx(threads_pair[1]):
            out = attention(q[:, s:e], kc, vc, torch.arange(s, e)[None], torch.tensor([e]))
        diff = _differences(full[:, s:e], out)
        if diff is not None:
            return f"chunk [{s}, {e}): {diff}"
    return None


@given(seed=seeds, layout=head_layouts(), t=st.integers(1, 70), dtype=dtypes,
       chunk_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), garbage=st.sampled_from([0, 0, 5, 33]),
       t_full=threads, t_chunk=threads)
def test_attention_full_vs_chunked_prefill(seed, layout, t, dtype, chunk_sizes, garbage, t_full, t_chunk, torch_threads):
    hq, hkv, d = layout
    gen = _gen(seed)
    q, k, v = _qkv(gen, t, hq, hkv, d, dtype)
    assert prefill_decode_violation(q, k, v, chunk_sizes, garbage_capacity=garbage, gen=gen,
                                    threads_pair=(t_full, t_chunk), torch_threads=torch_threads) is None


@settings(max_examples=10)
@given(seed=seeds, layout=head_layouts(), t=st.integers(1, 70), dtype=dtypes)
def test_attention_full_vs_token_by_token_decode(seed, layout, t, dtype):
    hq, hkv, d = layout
    gen = _gen(seed)
    q, k, v = _qkv(gen, t, hq, hkv, d, dtype)
    assert prefill_decode_violation(q, k, v, [1] * t) is None
    # Decode straight after a prefill of half the sequence.
    assert prefill_decode_violation(q, k, v, [max(1, t // 2)] + [1] * t) is None


@given(data=st.data(), seed=seeds, layout=head_layouts(), dtype=dtypes, t_alone=threads, t_batch=threads)
def test_attention_batch_with_padding_vs_each_sequence_alone(data, seed, layout, dtype, t_alone, t_batch, torch_threads):
    """Sequences of different lengths, each at its own prefill/decode stage, padded (q_positions=-1) and batched."""
    hq, hkv, d = layout
    gen = _gen(seed)
    nseq = data.draw(st.integers(1, 4), label="sequences")
    lengths = data.draw(st.lists(st.integers(1, 60), min_size=nseq, max_size=nseq), label="lengths")
    starts = [data.draw(st.integers(0, n - 1), label="chunk start") for n in lengths]
    extra = data.draw(st.integers(0, 8), label="extra key capacity")
    seqs = [_qkv(gen, n, hq, hkv, d, dtype) for n in lengths]
    tq = max(n - s for n, s in zip(lengths, starts)) + data.draw(st.integers(0, 3), label="extra query padding")
    tk = max(lengths) + extra
    q = _randn(gen, nseq, tq, hq, d, dtype=dtype, scale=3.0)  # padding slots hold random values
    k = _randn(gen, nseq, tk, hkv, d, dtype=dtype, scale=3.0)
    v = _randn(gen, nseq, tk, hkv, d, dtype=dtype, scale=3.0)
    qpos = torch.full((nseq, tq), -1)
    for b, ((qs, ks, vs), n, s) in enumerate(zip(seqs, lengths, starts)):
        q[b, : n - s], k[b, :n], v[b, :n] = qs[0, s:n], ks[0], vs[0]
        qpos[b, : n - s] = torch.arange(s, n)
    with torch_threads(t_batch):
        out = attention(q, k, v, qpos, torch.tensor(lengths))
    for b, ((qs, ks, vs), n, s) in enumerate(zip(seqs, lengths, starts)):
        with torch_threads(t_alone):
            alone = attention(qs, ks, vs, causal_positions(1, n))
        assert torch.equal(out[b, : n - s], alone[0, s:n]), f"sequence {b}"
        assert torch.equal(out[b, n - s :], torch.zeros_like(out[b, n - s :])), "padding queries must give 0"


def _softmax_attention_impl(q, k, v, q_positions, k_lengths, scale):
    """Materialised-softmax attention on BLAS matmuls: the reduction order depends on Tq and Tk."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    kpos = torch.arange(k.shape[1])
    visible = (kpos[None, None, :] <= q_positions[:, :, None]) & (kpos[None, None, :] < k_lengths[:, None, None])
    s = s.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))
    return (p @ vf).transpose(1, 2).to(q.dtype), lse


_real_attention = dispatch.implementation("attention", CPU)


def _length_dependent_block_impl(q, k, v, q_positions, k_lengths, scale):
    """The real algorithm, but with a KV block size chosen from the key length (as split-KV heuristics do)."""
    saved = attention_module.KV_BLOCK
    attention_module.KV_BLOCK = 16 if k.shape[1] <= 2 * KV_BLOCK else 2 * KV_BLOCK
    try:
        return _real_attention(q, k, v, q_positions, k_lengths, scale)
    finally:
        attention_module.KV_BLOCK = saved


@pytest.mark.parametrize("broken", [_softmax_attention_impl, _length_dependent_block_impl], ids=["softmax", "length-dependent-block"])
def test_checker_catches_prefill_decode_dependent_attention(broken):
    """``prefill_decode_violation`` passes the real kernel and flags a variant whose numerics depend on the call shape."""
    findings = []
    for seed in range(4):
        gen = _gen(seed)
        q, k, v = _qkv(gen, 80, 4, 2, 16, torch.float32)
        assert prefill_decode_violation(q, k, v, [1] * 80) is None
        with swapped_kernel("attention", broken):
            findings.append(prefill_decode_violation(q, k, v, [1] * 80))
        assert dispatch.implementation("attention", CPU) is _real_attention
        if findings[-1] is not None:
            break
    assert findings[-1] is not None, f"{broken.__name__} was not caught: {findings}"


# --------------------------------------------------------------------------- paged KV


def _paged_cache(gen, num_blocks, block_size, hkv, d, dtype):
    """A cache in the layout documented in :mod:`paged_kv` (``[blocks, Hkv, block_size, 2*D]``), full of stale values."""
    return _randn(gen, num_blocks, hkv, block_size, 2 * d, dtype=dtype, scale=7.0)


@given(data=st.data(), seed=seeds, block_size=st.sampled_from([1, 3, 8, 16]), layout=head_layouts(), dtype=dtypes)
def test_paged_kv_round_trip_and_attention(data, seed, block_size, layout, dtype):
    hq, hkv, d = layout
    gen = _gen(seed)
    nseq = data.draw(st.integers(1, 4), label="sequences")
    lengths = data.draw(st.lists(st.integers(1, 50), min_size=nseq, max_size=nseq), label="lengths")
    pages_per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(pages_per_seq) + data.draw(st.integers(0, 5), label="spare pages")
    table_width = max(pages_per_seq) + data.draw(st.integers(0, 2), label="table padding")
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at arbitrary pages (possibly other sequences'): they must be masked by seq_lens.
    block_table = torch.randint(0, num_blocks, (nseq, table_width), generator=gen)
    used = 0
    for b, p in enumerate(pages_per_seq):
        block_table[b, :p] = perm[used : used + p]
        used += p
    seqs = [_qkv(gen, n, hq, hkv, d, dtype) for n in lengths]
    cache = _paged_cache(gen, num_blocks, block_size, hkv, d, dtype)

    # Write all tokens in a random order, in batches of random size, with padding slots (-1) carrying junk.
    tokens = [(b, t) for b, n in enumerate(lengths) for t in range(n)]
    order = torch.randperm(len(tokens), generator=gen).tolist()
    i = 0
    while i < len(order):
        step = data.draw(st.integers(1, 16), label="write batch")
        chunk = [tokens[j] for j in order[i : i + step]]
        i += step
        pad = data.draw(st.integers(0, 2), label="padding slots")
        slots = [int(block_table[b, t // block_size]) * block_size + t % block_size for b, t in chunk] + [-1] * pad
        key = torch.stack([seqs[b][1][0, t] for b, t in chunk] + [_randn(gen, hkv, d, dtype=dtype, scale=9.0) for _ in range(pad)])
        value = torch.stack([seqs[b][2][0, t] for b, t in chunk] + [_randn(gen, hkv, d, dtype=dtype, scale=9.0) for _ in range(pad)])
        write_kv(cache, torch.tensor(slots), key, value)

    seq_lens = torch.tensor(lengths)
    k_paged, v_paged = gather_kv(cache, block_table, seq_lens)
    assert k_paged.shape == (nseq, max(lengths), hkv, d)
    for b, n in enumerate(lengths):
        assert torch.equal(k_paged[b, :n], seqs[b][1][0]) and torch.equal(v_paged[b, :n], seqs[b][2][0])
        assert torch.equal(k_paged[b, n:], torch.zeros_like(k_paged[b, n:]))
        assert torch.equal(v_paged[b, n:], torch.zeros_like(v_paged[b, n:]))

    # Attention of each sequence's last chunk over the gathered K/V equals attention over contiguous K/V.
    starts = [data.draw(st.integers(0, n - 1), label="chunk start") for n in lengths]
    tq = max(n - s for n, s in zip(lengths, starts))
    q = torch.zeros(nseq, tq, hq, d, dtype=dtype)
    qpos = torch.full((nseq, tq), -1)
    for b, (n, s) in enumerate(zip(lengths, starts)):
        q[b, : n - s] = seqs[b][0][0, s:n]
        qpos[b, : n - s] = torch.arange(s, n)
    out = attention(q, k_paged, v_paged, qpos, seq_lens)
    for b, ((qs, ks, vs), n, s) in enumerate(zip(seqs, lengths, starts)):
        contiguous = attention(qs[:, s:], ks, vs, torch.arange(s, n)[None])
        assert torch.equal(out[b, : n - s], contiguous[0])


# --------------------------------------------------------------------------- log-softmax and token log-probs

odd_vocab = st.one_of(st.integers(0, 600).map(lambda n: 2 * n + 1), st.sampled_from([50257, 32001]))


@given(data=st.data(), seed=seeds, vocab=odd_vocab, temperature=temperatures, logit_dtype=dtypes,
       scale=st.sampled_from([1.0, 8.0, 40.0]), t_alone=threads, t_batch=threads)
def test_log_softmax_row_alone_vs_in_batch(data, seed, vocab, temperature, logit_dtype, scale, t_alone, t_batch, torch_threads):
    gen = _gen(seed)
    row, others, position = rows_and_position(data, gen, (vocab,), logit_dtype, max_batch=8, scale=scale)
    op = lambda batch: log_softmax(batch, temperature)  # noqa: E731
    assert batch_invariance_violation(op, row, others, position, t_alone, t_batch, torch_threads) is None
    # One temperature per row ([rows, 1]): the row keeps its bits beside rows sampled at other temperatures.
    row_t = torch.cat([row.float(), torch.tensor([temperature])])
    others_t = torch.cat([others.float(), torch.rand(len(others), 1, generator=gen) + 0.5], dim=1)
    op_t = lambda batch: log_softmax(batch[:, :-1].to(logit_dtype), batch[:, -1:])  # noqa: E731
    assert batch_invariance_violation(op_t, row_t, others_t, position, t_alone, t_batch, torch_threads) is None
    assert torch.equal(op_t(row_t[None]), op(row[None]))  # a [1, 1] temperature tensor == the same number


@given(seed=seeds, vocab=st.integers(0, 3000).map(lambda n: 2 * n + 1), scale=st.sampled_from([1.0, 8.0]))
def test_log_softmax_temperature_is_one_ieee_division(seed, vocab, scale):
    """Contract: temperature T divides the float32 logits by float32(T) once, then the T=1 path runs."""
    z = _randn(_gen(seed), 2, vocab, scale=scale)
    t32 = torch.tensor(0.7, dtype=torch.float32)
    assert torch.equal(log_softmax(z, 0.7), log_softmax(z / t32, 1.0))
    per_row = torch.tensor([[0.7], [1.3]])
    assert torch.equal(log_softmax(z, per_row), torch.cat([log_softmax(z[:1], 0.7), log_softmax(z[1:] / per_row[1], 1.0)]))
    assert torch.equal(log_softmax(z, 0.0), log_softmax(z, 1.0))  # greedy (T <= 0) is treated as T = 1


@given(data=st.data(), seed=seeds, hidden=st.integers(1, 130), vocab=st.integers(0, 200).map(lambda n: 2 * n + 1),
       dtype=dtypes, temperature=temperatures, t_alone=threads, t_batch=threads)
def test_token_logprobs_row_alone_vs_in_batch(data, seed, hidden, vocab, dtype, temperature, t_alone, t_batch, torch_threads):
    gen = _gen(seed)
    lm_head = _randn(gen, vocab, hidden, dtype=dtype, scale=0.5)
    row, others, position = rows_and_position(data, gen, (hidden + 1,), torch.float32, max_batch=16, scale=2.0)
    # Column 0 carries the target token id, the rest the hidden state.
    row[0] = float(torch.randint(0, vocab, (1,), generator=gen))
    if len(others):
        others[:, 0] = torch.randint(0, vocab, (len(others),), generator=gen).float()

    def op(batch):
        return token_logprobs(batch[:, 1:].to(dtype), lm_head, batch[:, 0].long(), temperature)

    assert batch_invariance_violation(op, row, others, position, t_alone, t_batch, torch_threads) is None
    # token_logprobs is the gathered log_softmax of compute_logits, bit for bit, also for [B, T] inputs.
    h = row[1:].to(dtype).expand(2, 3, hidden).clone()
    tok = torch.randint(0, vocab, (2, 3), generator=gen)
    lp = token_logprobs(h, lm_head, tok, temperature)
    ref = log_softmax(compute_logits(h, lm_head), temperature).gather(-1, tok[..., None])[..., 0]
    assert lp.dtype == torch.float32 and torch.equal(lp, ref)
    assert torch.equal(gather_logprobs(compute_logits(h, lm_head), tok, temperature), lp)
    assert torch.equal(lp, token_logprobs(h, lm_head, tok, temperature))  # repeat


# --------------------------------------------------------------------------- repeated runs


def _every_op(gen, dtype):
    """One call of each op on fixed random inputs, as (name, thunk)."""
    x = _randn(gen, 5, 96, dtype=dtype)
    w = _randn(gen, 40, 96, dtype=dtype)
    q, k, v = _qkv(gen, 45, 4, 2, 16, dtype)
    positions = torch.randint(0, 512, (45,), generator=gen)
    cfg = RopeConfig(16, 512, style="gptj", scaling=LLAMA3_SCALING)
    tokens = torch.randint(0, 40, (5,), generator=gen)
    return [
        ("linear", lambda: linear(x, w, w[:, 0], out_dtype=torch.float32)),
        ("rms_norm", lambda: rms_norm(x, w[0], 1e-6, residual=x.flip(0))),
        ("silu_and_mul", lambda: silu_and_mul(x)),
        ("rope", lambda: apply_rope(q[0], positions, cfg)),
        ("attention", lambda: attention(q, k, v, causal_positions(1, 45))),
        ("log_softmax", lambda: log_softmax(_randn(_gen(1), 5, 1001), 0.7)),
        ("token_logprobs", lambda: token_logprobs(x, w, tokens, 0.7)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeated_runs_give_identical_bits(dtype, torch_threads):
    for name, thunk in _every_op(_gen(11), dtype):
        runs = []
        for n in (1, 2, 2, 1):
            with torch_threads(n):
                runs.append(thunk())
        for later in runs[1:]:
            assert _differences(runs[0], later) is None, name
