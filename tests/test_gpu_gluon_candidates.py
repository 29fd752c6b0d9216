"""The Gluon kernels (``kernels/triton/gluon_segment_tree.py``, ``gluon_fp8_gemm.py``, ``gluon_attention.py``;
on Hopper by default, ``MC_GLUON=0`` off) against the committed kernels, bitwise, on a Hopper GPU.

Every schedule of the Gluon tree must give the bits of ``segment_tree.segment_tree_gemm`` and every schedule of the
Gluon FP8 GEMM those of ``fp8_linear.fp8_gemm`` -- at ragged M and N (the TMA unit's zero fill and clipping), with a
bias, and for a tensor-parallel rank's float32 subtree; every schedule of the Gluon attention those of
``attention_fwd`` and ``paged_attention`` (partitions, chunks over prefixes, padding, strided views, pages 16-128
with NaN in every unwritten cache slot); and with ``MC_GLUON`` on, the registered CUDA ops and ``paged_attention``
(what the trainer and the engine call) route the calls the rules give them to the Gluon kernels with those bits.  The
benchmarks check the same at their own shapes and time them; these cases are the edges.  Skipped without a Hopper
GPU (``wgmma``, TMA) or without Gluon.
"""

from __future__ import annotations

import pytest
import torch


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) CUDA GPU: the kernels use wgmma and TMA")]

if _hopper():
    gluon_tree = pytest.importorskip("megatron_consistent.kernels.triton.gluon_segment_tree",
                                     reason="Triton without Gluon")
    gluon_fp8 = pytest.importorskip("megatron_consistent.kernels.triton.gluon_fp8_gemm", reason="Triton without Gluon")
    gluon_attn = pytest.importorskip("megatron_consistent.kernels.triton.gluon_attention", reason="Triton without Gluon")
    from megatron_consistent.kernels.triton import attention as tattn
    from megatron_consistent.kernels.triton import paged_attention as tpa
    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels.dispatch import implementation
    from megatron_consistent.kernels.triton import fp8_linear as tf8
    from megatron_consistent.kernels.triton import segment_tree as tst

DEV = "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _where_they_differ(out: torch.Tensor, ref: torch.Tensor) -> str:
    """Where two results differ (which rows / columns, how far), for the assertion message: a wrong K order spreads
    over every element, a wrong zero fill or clip sits at the ragged edge, a wrong tree combine moves low bits."""
    if out.shape != ref.shape:
        return f"shapes {tuple(out.shape)} vs {tuple(ref.shape)}"
    bad = _bits(out) != _bits(ref)
    rows, cols = bad.any(1).nonzero().flatten(), bad.any(0).nonzero().flatten()
    span = lambda i: f"{i.numel()} ({int(i[0])}..{int(i[-1])})" if i.numel() else "0"  # noqa: E731
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; rows {span(rows)} of {out.shape[0]}, columns "
            f"{span(cols)} of {out.shape[1]}; max |diff| {(out.float() - ref.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("schedule", ["ws", "ws deep", "ws grouped"])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 4096), (4096, 2048, 2048), (300, 4096, 14336), (129, 2048, 8192)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gluon_tree_equals_the_committed_tree(schedule, m, n, k, with_bias):
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g) if with_bias else None
    ref = tst.segment_tree_gemm(x, w, 8, bias, torch.bfloat16)
    out = gluon_tree.gluon_segment_tree(x, w, 8, bias, torch.bfloat16, schedule)
    assert torch.equal(_bits(out), _bits(ref)), _where_they_differ(out, ref)
    for segments in (4, 2, 1):  # the float32 subtree of a rank at TP = 8 / segments
        xs, ws = x[:, : k * segments // 8].contiguous(), w[:, : k * segments // 8].contiguous()
        out = gluon_tree.gluon_segment_tree(xs, ws, segments, None, torch.float32, schedule)
        ref = tst.segment_tree_gemm(xs, ws, segments, None, torch.float32)
        assert torch.equal(_bits(out), _bits(ref)), f"{segments} segments: {_where_they_differ(out, ref)}"


# (N, K) splits: 8 (1000 x 4096), 4 of 28 groups, 2; Qwen3-30B-A3B's qkv: 3 uneven (6, 6, 4 groups: the last shorter)
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 4096), (4096, 4096, 14336), (300, 6144, 4096), (600, 5120, 2048)])
@pytest.mark.parametrize("block_rows", [128, 0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("schedule", ["ws", "ws grouped", "ws regs", "ws smem sums"])
def test_gluon_fp8_gemm_equals_the_committed_fp8_gemm(m, n, k, block_rows, with_bias, schedule):
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    wq, w_scales = fp8.quantize(torch.randn(n, k, device=DEV, generator=g) * 0.02, fp8.E4M3_WEIGHT_128)
    ws = fp8.weight_row_scales(w_scales, n).contiguous()
    xq, xs = tf8.quantize_activations(x)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g) if with_bias else None
    ref = tf8.fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16, w_block_rows=block_rows)
    out = gluon_fp8.gluon_fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16, tf8.fp8_config(n, k)["SPLIT_GROUPS"],
                                   w_block_rows=block_rows, schedule=schedule)
    assert torch.equal(_bits(out), _bits(ref)), _where_they_differ(out, ref)


def test_registered_ops_route_to_the_gluon_kernels_with_the_committed_bits(monkeypatch):
    """``MC_GLUON`` on: the CUDA ops the trainer and the engine call take the Gluon kernels where the rules say (and
    give the committed bits); below the rules' M they keep the committed kernels."""
    calls = []
    real_tree, real_fp8 = gluon_tree.gluon_segment_tree, gluon_fp8.gluon_fp8_gemm
    monkeypatch.setattr(gluon_tree, "gluon_segment_tree", lambda *a: calls.append("tree") or real_tree(*a))
    monkeypatch.setattr(gluon_fp8, "gluon_fp8_gemm", lambda *a: calls.append("fp8") or real_fp8(*a))
    monkeypatch.setattr(tst, "GLUON", True)
    monkeypatch.setattr(tf8, "GLUON", True)
    g = torch.Generator(device=DEV).manual_seed(7)
    for m in (tst.GLUON_TREE_MIN_M + 3, 64):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16, generator=g)
        w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
        out = implementation("linear_segment_tree", torch.device(DEV))(x, w, 8, None, torch.bfloat16)
        assert torch.equal(_bits(out), _bits(tst.segment_tree_gemm(x, w, 8, None, torch.bfloat16)))
    assert calls == ["tree"]
    for m in (tf8.GLUON_FP8_MIN_M + 5, 16):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16, generator=g)
        wq, w_scales = fp8.quantize(torch.randn(6144, 4096, device=DEV, generator=g) * 0.02, fp8.E4M3_WEIGHT_128)
        ws = fp8.weight_row_scales(w_scales, 6144).contiguous()
        out = implementation("fp8_linear", torch.device(DEV))(x, wq, ws, None, torch.bfloat16, w_block_rows=128)
        xq, xs = tf8.quantize_activations(x)
        assert torch.equal(_bits(out), _bits(tf8.fp8_gemm(xq, xs, wq, ws, None, torch.bfloat16, w_block_rows=128)))
    assert calls == ["tree", "fp8"]
    real_attn = gluon_attn.gluon_attention_fwd
    monkeypatch.setattr(gluon_attn, "gluon_attention_fwd",
                        lambda *a, **kw: calls.append("attention") or real_attn(*a, **kw))
    monkeypatch.setattr(tattn, "GLUON", True)
    for t in (300, 2):  # prefill, then decode-sized (the committed kernel)
        q, k, v, pos, kl = _attention_inputs(1, t, t, 32, 8, 128, 0, False, seed=t)
        out, lse = implementation("attention", torch.device(DEV))(q, k, v, pos, kl, 128 ** -0.5)
        ref_out, ref_lse = tattn.attention_fwd(q, k, v, pos, kl, 128 ** -0.5)
        assert torch.equal(_bits(out), _bits(ref_out)) and torch.equal(_bits(lse), _bits(ref_lse))
    assert calls == ["tree", "fp8", "attention"]


def _attention_inputs(b, tq, tk, hq, hkv, d, pad, fused, seed):
    """q, k, v (``fused``: strided views of one qkv projection, as a model makes them), positions (a chunk over a
    cached prefix when ``tq < tk``; the last sequence's last ``pad`` rows padding, its keys ``pad`` shorter)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if fused:
        assert tq == tk
        qkv = torch.randn(b, tq, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16, generator=g)
        q = qkv[..., : hq * d].unflatten(-1, (hq, d))
        k = qkv[..., hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d))
        v = qkv[..., (hq + hkv) * d:].unflatten(-1, (hkv, d))
    else:
        q = torch.randn(b, tq, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, tk, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, tk, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    pos = (tk - tq + torch.arange(tq, device=DEV)).repeat(b, 1)
    kl = torch.full((b,), tk, device=DEV)
    if pad:
        pos[-1, tq - pad:] = -1
        kl[-1] = tk - pad
    return q, k, v, pos, kl


# (B, Tq, Tk, Hq, Hkv, D, padding rows, fused qkv)
ATTENTION_CASES = [(1, 1000, 1000, 32, 8, 128, 0, False),  # two partitions, a ragged last block
                   (2, 777, 777, 8, 8, 64, 0, True),  # MHA, head dim 64, strided views, two sequences
                   (3, 300, 900, 16, 4, 128, 0, False),  # a chunk over a 600-token prefix
                   (2, 600, 600, 32, 8, 128, 37, True),  # keys shorter than Tk, padding rows
                   (1, 33, 33, 32, 8, 128, 0, False),  # 132 packed rows: a second tile of 4
                   (1, 4096, 4096, 32, 8, 128, 0, False)]  # eight partitions


GLUON_ATTENTION_SCHEDULES = ["ws", "ws lookahead", "ws q regs", "ws lookahead q regs", "ws lookahead pingpong"]


@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,pad,fused", ATTENTION_CASES)
@pytest.mark.parametrize("schedule", GLUON_ATTENTION_SCHEDULES)
def test_gluon_attention_equals_the_committed_attention(b, tq, tk, hq, hkv, d, pad, fused, schedule):
    q, k, v, pos, kl = _attention_inputs(b, tq, tk, hq, hkv, d, pad, fused, seed=tq + tk + d)
    ref_out, ref_lse = tattn.attention_fwd(q, k, v, pos, kl, d ** -0.5)
    out, lse = tattn.attention_fwd(q, k, v, pos, kl, d ** -0.5, gluon=schedule)
    assert torch.equal(_bits(out), _bits(ref_out)), _where_they_differ(out.reshape(-1, hq * d), ref_out.reshape(-1, hq * d))
    assert torch.equal(_bits(lse), _bits(ref_lse))


def test_gluon_attention_with_another_partition_is_caught(monkeypatch):
    """The comparison can fail: 256-key partitions (four blocks, not eight) merge at other keys and change bits."""
    q, k, v, pos, kl = _attention_inputs(1, 1000, 1000, 32, 8, 128, 0, False, seed=1)
    ref_out, _ = tattn.attention_fwd(q, k, v, pos, kl, 128 ** -0.5)
    monkeypatch.setattr(tattn, "PART_BLOCKS", 4)
    for schedule in gluon_attn.SCHEDULES:
        out, _ = tattn.attention_fwd(q, k, v, pos, kl, 128 ** -0.5, gluon=schedule)
        assert not torch.equal(_bits(out), _bits(ref_out)), schedule


def _paged_step(seqs, page, hq, hkv, d, seed):
    """One engine step in vLLM's layouts: ``seqs`` (cached, new) tokens each; a shuffled page cache ``[blocks, kv
    heads, page, 2 * D]`` seen as ``[blocks, page, kv heads, D]`` (vLLM's Triton-backend layout) holding every
    sequence's keys, its unwritten slots and unused pages NaN (the kernels must not let them into a row); q and the
    step's K / V token-major, K / V as strided views of one projection; three padding tokens."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = [c + n for c, n in seqs]
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages) + 2, generator=g, device=DEV)
    kv = torch.full((sum(pages) + 2, hkv, page, 2 * d), float("nan"), device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    table = torch.full((len(seqs), max(pages) + 1), int(perm[-1]), dtype=torch.int32, device=DEV)
    t_all = sum(n for _, n in seqs) + 3
    proj = torch.randn(t_all, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16, generator=g)
    q = proj[:, : hq * d].unflatten(-1, (hq, d))
    k_new = proj[:, hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d))
    v_new = proj[:, (hq + hkv) * d:].unflatten(-1, (hkv, d))
    first, tok = 0, 0
    for s, ((cached, new), n) in enumerate(zip(seqs, lens)):
        table[s, : pages[s]] = perm[first: first + pages[s]].to(torch.int32)
        first += pages[s]
        keys = torch.cat([torch.randn(cached, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g), k_new[tok: tok + new]])
        vals = torch.cat([torch.randn(cached, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g), v_new[tok: tok + new]])
        pos = torch.arange(n, device=DEV)
        slots = table[s, pos // page].to(torch.int64) * page + pos % page
        tpa.write_kv_cache(keys, vals, k_cache, v_cache, slots)
        tok += new
    qsl = torch.tensor([0] + [n for _, n in seqs], device=DEV).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, table, qsl, torch.tensor(lens, dtype=torch.int32, device=DEV), k_new, v_new


# (sequences as (cached, new), Hq, Hkv, D): fresh prefills; chunks over prefixes ending either side of a key block
# and a partition boundary; a chunk shorter than a block
PAGED_CASES = [([(0, 300), (37, 200), (500, 129), (64, 70)], 32, 8, 128),
               ([(0, 1000), (600, 65), (130, 2)], 8, 8, 64)]


@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
@pytest.mark.parametrize("schedule", ["ws", "ws lookahead pingpong"])  # the consumer's other knobs: the dense cases
def test_gluon_paged_attention_equals_the_committed_paged_attention(page, case, schedule):
    seqs, hq, hkv, d = PAGED_CASES[case]
    q, k_cache, v_cache, table, qsl, seq_lens, k_new, v_new = _paged_step(seqs, page, hq, hkv, d, seed=page + case)
    sizes = (max(n for _, n in seqs), max(c + n for c, n in seqs))
    ref = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.full_like(q, float("nan")),
                              *sizes, k_new=k_new, v_new=v_new)
    assert not torch.isnan(ref).any()
    for new_kv in (True, False):
        step = {"k_new": k_new, "v_new": v_new} if new_kv else {}
        out = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5,
                                  torch.full_like(q, float("nan")), *sizes, gluon=schedule, **step)
        assert torch.equal(_bits(out), _bits(ref)), f"new_kv={new_kv}: {_where_they_differ(out.flatten(1), ref.flatten(1))}"


@pytest.mark.parametrize("page", [16, 64])
def test_gluon_paged_attention_past_32_bit_element_offsets(page):
    """The step's pages at the top block ids of a cache in vLLM's layout with more than 2**32 elements (8.6 GB of
    bf16: what a large GPU's cache holds a layer), the table shifted to them: the Gluon kernel's TMA coordinates and
    the committed kernel's offsets reach them with the rows of the same pages at low ids
    (``tests/test_gpu_paged_attention.py`` has the committed kernel's own case, in the interpreter too)."""
    seqs, hq, hkv, d = PAGED_CASES[0]
    q, k_cache, v_cache, table, qsl, seq_lens, k_new, v_new = _paged_step(seqs, page, hq, hkv, d, seed=page)
    sizes = (max(n for _, n in seqs), max(c + n for c, n in seqs))
    ref = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.full_like(q, float("nan")),
                              *sizes, k_new=k_new, v_new=v_new)
    blocks = k_cache.shape[0]
    top = (1 << 32) // (hkv * page * 2 * d) + 1  # the first block id past 2**32 elements
    raw = torch.empty((top + blocks, hkv, page, 2 * d), device=DEV, dtype=torch.bfloat16)
    raw[top:, ..., :d], raw[top:, ..., d:] = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    big = raw.transpose(1, 2)
    for schedule in (None, "ws"):
        out = tpa.paged_attention(q, big[..., :d], big[..., d:], table + top, qsl, seq_lens, d ** -0.5,
                                  torch.full_like(q, float("nan")), *sizes, k_new=k_new, v_new=v_new, gluon=schedule)
        assert torch.equal(_bits(out), _bits(ref)), f"{schedule}: {_where_they_differ(out.flatten(1), ref.flatten(1))}"


def test_gluon_paged_attention_with_another_partition_is_caught(monkeypatch):
    seqs, hq, hkv, d = PAGED_CASES[1]
    q, k_cache, v_cache, table, qsl, seq_lens, k_new, v_new = _paged_step(seqs, 16, hq, hkv, d, seed=3)
    ref = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.zeros_like(q), 1000, 1000)
    monkeypatch.setattr(tattn, "PART_BLOCKS", 4)
    out = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.zeros_like(q), 1000, 1000,
                              gluon="ws")
    assert not torch.equal(_bits(out), _bits(ref))


def test_paged_attention_routes_prefill_steps_to_gluon(monkeypatch):
    """``MC_GLUON`` on: the sequences after a step's leading one-token ones (the engine's hint ``decode_requests``)
    take the Gluon kernel, the decodes the committed kernel in a launch of their own, with the committed bits and
    padding rows zero; a step of decodes only, or one read as unordered (-1), keeps the committed kernel; a wrong
    reading (a chunk counted as a decode) is caught."""
    calls = []
    real = gluon_attn.gluon_paged_attention
    monkeypatch.setattr(gluon_attn, "gluon_paged_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    seqs, hq, hkv, d = [(500, 1), (37, 1)] + PAGED_CASES[0][0], *PAGED_CASES[0][1:]
    q, k_cache, v_cache, table, qsl, seq_lens, k_new, v_new = _paged_step(seqs, 16, hq, hkv, d, seed=11)
    args = (q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5)
    ref = tpa.paged_attention(*args, torch.full_like(q, float("nan")), 300, 629, k_new=k_new, v_new=v_new)
    monkeypatch.setattr(tpa, "GLUON", True)
    t_all = q.shape[0]
    for hint, routed_rows in ((-1, None), (2, t_all - 2)):
        calls.clear()
        out = tpa.paged_attention(*args, torch.full_like(q, float("nan")), 300, 629, k_new=k_new, v_new=v_new,
                                  decode_requests=hint)
        assert torch.equal(_bits(out), _bits(ref)), hint
        assert calls == ([] if routed_rows is None else [routed_rows]), (hint, calls)
    out = tpa.paged_attention(*args, torch.full_like(q, float("nan")), 300, 629, k_new=k_new, v_new=v_new,
                              decode_requests=3)  # the 300-token chunk counted as a decode
    assert not torch.equal(_bits(out), _bits(ref))
    decodes = ([(500, 1), (37, 1), (64, 1)], hq, hkv, d)
    q, k_cache, v_cache, table, qsl, seq_lens, k_new, v_new = _paged_step(decodes[0], 16, hq, hkv, d, seed=12)
    ref = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.zeros_like(q), 1, 565)
    calls.clear()
    out = tpa.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, d ** -0.5, torch.zeros_like(q), 1, 565,
                              decode_requests=3)
    assert torch.equal(_bits(out), _bits(ref)) and calls == []
