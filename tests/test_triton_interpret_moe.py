"""The CUDA MoE kernels' logic in Triton's interpreter: the router (one program per token) against the CPU route's
torch ops, bit for bit; the counting sort of the (token, slot) pairs by expert; the grouped GEMM's tile table and its
row tiles.

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``), like
tests/test_triton_interpret_gemm.py.  The kernel uses only IEEE-exact operations (float64 ``+ - *``, ``floor``,
``div_rn``, bit casts, comparisons; no ``exp`` of the platform), which the interpreter evaluates with numpy exactly as
the GPU does, so here the bits must equal :func:`kernels.moe.select_experts` (weights and experts, ``torch.equal``):
softmax and sigmoid, selection bias, ``norm_topk_prob``, scaling, expert counts that are not powers of two, exact
ties (lowest index), NaN and infinite logits.  The counting sort gives a stable sort's order (several pair blocks,
expert counts not powers of two, experts with no pair).  The tile table (one launch) against its definition; the grouped GEMM
with every row tile (BM 16 / 32 / 64 / the config's) gives the same values (the interpreter's ``tl.dot`` is numpy's,
so this proves indices and masks; tests/test_gpu_moe.py checks the bits on the H200, as it does the router's).  The
engine's experts over TP ranks (other ranks' pairs as expert -1: no sorted row, no tile) sum to the one-rank pairs.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from megatron_consistent.kernels import moe as kmoe
from megatron_consistent.kernels import numerics
from megatron_consistent.kernels.triton import moe as tmoe
from megatron_consistent.kernels.triton import numerics as tnum


def _both(z, top_k, scoring="softmax", bias=None, norm=False, scaling=1.0):
    ours = tmoe.select_experts(z, top_k, scoring, bias, norm, 1, 1, scaling)
    ref = kmoe.select_experts(z, top_k, scoring, bias, norm, 1, 1, scaling)
    return ours, ref


def _assert_same(ours, ref):
    assert torch.equal(ours[1], ref[1]), "experts differ"
    assert torch.equal(ours[0].view(torch.int32), ref[0].view(torch.int32)), "weights differ in their bits"


@pytest.mark.parametrize("e,top_k", [(8, 1), (8, 2), (60, 4), (64, 6), (128, 8)])
@pytest.mark.parametrize("scoring,with_bias,norm,scaling", [("softmax", False, False, 1.0), ("softmax", False, True, 1.0),
                                                            ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0)])
def test_kernel_equals_the_cpu_route(e, top_k, scoring, with_bias, norm, scaling):
    g = torch.Generator().manual_seed(e * 10 + top_k)
    z = torch.randn(24, e, generator=g) * 3
    bias = torch.randn(e, generator=g) * 0.01 if with_bias else None
    ours, ref = _both(z, top_k, scoring, bias, norm, scaling)
    _assert_same(ours, ref)
    # a token alone == the token in the batch
    for t in (0, 13, 23):
        alone = tmoe.select_experts(z[t : t + 1], top_k, scoring, bias, norm, 1, 1, scaling)
        assert torch.equal(alone[1], ours[1][t : t + 1]) and torch.equal(alone[0], ours[0][t : t + 1])


def test_exact_ties_pick_the_lowest_index():
    z = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 2.0, 0.0],
                      [0.0] * 8,
                      [-1.0, 2.0, -1.0, 2.0, 5.0, -1.0, 2.0, 2.0]])
    ours, ref = _both(z, 4, norm=True)
    _assert_same(ours, ref)
    assert ours[1].tolist() == [[1, 2, 4, 5], [0, 1, 2, 3], [4, 1, 3, 6]]
    # sigmoid keys with a bias that makes keys equal: the lowest index again
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    _assert_same(*_both(z, 3, "sigmoid", bias=bias))


def test_nan_and_infinite_logits_sort_like_the_cpu():
    z = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    z[0, 5] = float("nan")
    z[1, 2] = float("inf")
    z[2, 7] = -float("inf")
    z[3, :] = -float("inf")
    for scoring in ("softmax", "sigmoid"):
        ours, ref = _both(z, 3, scoring, norm=True)
        assert torch.equal(ours[1], ref[1])
        assert torch.equal(ours[0].isnan(), ref[0].isnan())
        assert torch.equal(torch.nan_to_num(ours[0]), torch.nan_to_num(ref[0]))


def test_a_perturbed_exp_constant_is_caught(monkeypatch):
    """The comparison sees single bits: ln 2 rounded to float32 in the route's ``exp`` (``numerics.exp_f32``) changes
    some weights."""
    z = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) * 3
    good = tmoe.select_experts(z, 6, "softmax", None, True, 1, 1, 1.0)
    monkeypatch.setattr(tnum, "_LN2", tl.constexpr(torch.tensor(numerics.LN2, dtype=torch.float32).item()))
    bad = tmoe.select_experts(z, 6, "softmax", None, True, 1, 1, 1.0)
    assert torch.equal(good[1], bad[1])
    assert not torch.equal(good[0], bad[0])


def _table_reference(counts, bm, rows):
    entries = []
    start = 0
    for e, c in enumerate(counts):
        for r0 in range(start, start + c, bm):
            entries.append((e, r0, min(r0 + bm, start + c)))
        start += c
    length = -(-rows // bm) + len(counts)
    return entries + [(-1, 0, 0)] * (length - len(entries))


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("counts", [[3, 0, 300, 1, 129, 17], [0] * 7 + [5], [16] * 128, [0, 0, 2048] + [0] * 125])
def test_tile_table_is_its_definition(counts, bm):
    rows = sum(counts)
    bm_out, tile_e, r0, r1, length = tmoe.tile_table(torch.tensor(counts), bm, rows)
    assert bm_out == bm
    assert list(zip(tile_e.tolist(), r0.tolist(), r1.tolist())) == _table_reference(counts, bm, rows)
    assert length == len(_table_reference(counts, bm, rows))


def test_grouped_gemm_row_tiles_agree(monkeypatch):
    from megatron_consistent.kernels.triton import linear as tlin

    e_count, n, k = 5, 40, 100
    counts = torch.tensor([3, 0, 40, 1, 17])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(int(counts.sum()), k, generator=g)
    w = torch.randn(e_count, n, k, generator=g) * 0.1
    monkeypatch.setattr(tmoe, "config_for", lambda *a: tlin._cfg(128, 16, 16, 3, 4, 2))  # 3-step splits
    outs = {}
    for bm in (16, 32, 64, None):
        monkeypatch.setattr(tmoe, "GROUPED_ROW_TILES", () if bm is None else ((1e9, bm, 4),))
        outs[bm] = tmoe.grouped_gemm(x, w, counts)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            ref = x[r0 : r0 + c].double() @ w[e].double().T
            assert (outs[None][r0 : r0 + c].double() - ref).abs().max().item() < 1e-4, e
        r0 += c
    for bm in (16, 32, 64):
        assert torch.equal(outs[bm], outs[None]), bm


@pytest.mark.parametrize("t,k,e", [(1, 8, 128), (256, 8, 128), (1125, 8, 128), (300, 2, 60), (77, 6, 256), (5, 1, 8)])
def test_expert_sort_is_a_stable_sort(t, k, e):
    g = torch.Generator().manual_seed(t + k + e)
    # distinct experts per token (as top-k gives), skewed so some experts get none
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) % max(e - 3, 1)
    pair_of_row, counts = tmoe.expert_sort(experts, e)
    by_expert, order = torch.sort(experts.reshape(-1), stable=True)
    assert torch.equal(pair_of_row, order)
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=e))


@pytest.mark.parametrize("t,k,e", [(37, 2, 8), (300, 4, 16), (5, 8, 64)])
def test_pairs_of_expert_minus_one_get_no_row_and_no_tile(t, k, e):
    """Pairs of expert -1 (another TP rank's, not computed) are left out of the counting sort -- the other pairs' rows
    are a stable sort of them alone, the counts theirs -- and so the tile table has no tile for them (a sort that
    placed them, e.g. all at row 0 as an unmasked store would, fails the row check)."""
    g = torch.Generator().manual_seed(t * k + e)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    experts = torch.where(torch.rand(t, k, generator=g) < 0.5, experts, torch.full_like(experts, -1))
    flat = experts.reshape(-1)
    kept = (flat >= 0).nonzero()[:, 0]
    pair_of_row, counts = tmoe.expert_sort(experts, e)
    assert int(counts.sum()) == kept.numel()
    assert torch.equal(counts, torch.bincount(flat[kept], minlength=e))
    assert torch.equal(pair_of_row[: kept.numel()], kept[torch.sort(flat[kept], stable=True)[1]])
    bm = 16
    _, tile_e, r0, r1, _ = tmoe.tile_table(counts, bm, t * k)
    assert int((tile_e >= 0).sum()) == sum((c + bm - 1) // bm for c in counts.tolist())
    assert int(r1.max()) == kept.numel()


def test_grouped_gemm_gather_and_scatter_are_the_copies_they_replace():
    t, k, e_count, h, n = 23, 4, 6, 48, 40
    g = torch.Generator().manual_seed(11)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    hidden = torch.randn(t, h, generator=g)
    w = torch.randn(e_count, n, h, generator=g) * 0.1
    pair_of_row, counts = tmoe.expert_sort(experts, e_count)
    sorted_rows = hidden[pair_of_row // k]
    plain = tmoe.grouped_gemm(sorted_rows, w, counts)
    assert torch.equal(tmoe.grouped_gemm(hidden, w, counts, pair_of_row=pair_of_row, gather=True, slots=k), plain)
    by_pair = torch.empty_like(plain)
    by_pair[pair_of_row] = plain
    assert torch.equal(tmoe.grouped_gemm(sorted_rows, w, counts, pair_of_row=pair_of_row, scatter=True, slots=k),
                       by_pair)
    both = tmoe.grouped_gemm(hidden, w, counts, pair_of_row=pair_of_row, gather=True, scatter=True, slots=k)
    assert torch.equal(both, by_pair)
    # each (token, slot) row is its expert's product: the scatter put it where its pair is
    for pair in (0, 5, t * k - 1):
        ref = hidden[pair // k].double() @ w[experts.reshape(-1)[pair]].double().T
        assert (both[pair].double() - ref).abs().max().item() < 1e-4


def test_expert_outputs_values_and_gradients_match_the_cpu_path():
    """The CUDA expert path (counting sort, gathered / scattered grouped GEMMs) run on CPU tensors: the CPU path's
    values and gradients (float32; the interpreter's dot is numpy's, so within 1e-5 / 1e-4, not bitwise)."""
    t, k, e_count, h, inter = 19, 2, 5, 32, 24
    g = torch.Generator().manual_seed(13)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    leaves = [torch.randn(t, h, generator=g), torch.randn(e_count, 2 * inter, h, generator=g) * 0.2,
              torch.randn(e_count, h, inter, generator=g) * 0.2]
    ours = [x.clone().requires_grad_() for x in leaves]
    ref = [x.clone().requires_grad_() for x in leaves]
    y = tmoe._expert_outputs_cuda(ours[0], experts, ours[1], ours[2])
    y_ref = kmoe._expert_outputs_cpu(ref[0], experts, ref[1], ref[2])
    assert (y - y_ref).abs().max().item() < 1e-5
    probe = torch.randn(y.shape, generator=g)
    (y * probe).sum().backward()
    (y_ref * probe).sum().backward()
    for a, b in zip(ours, ref):
        assert ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() < 1e-4


@pytest.mark.parametrize("tp", [2, 4])
def test_the_engines_masked_rank_experts_sum_to_the_one_rank_pairs(tp, monkeypatch):
    """A TP rank's experts in the engine (``owned_expert_outputs(..., fixed_shapes=True)``: other ranks' pairs as
    expert -1, not computed, then masked to +0.0) on the CUDA kernels: the ranks' results summed are the one-rank
    ``[T, k, H]``, bit for bit (each pair's row is computed alone: which other rows share its tile does not matter),
    and each rank's non-owned pairs are exactly zero."""
    monkeypatch.setattr(kmoe, "expert_outputs", tmoe._expert_outputs_cuda)
    t, k, e_count, h, inter = 23, 2, 8, 32, 24
    g = torch.Generator().manual_seed(17)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    x = torch.randn(t, h, generator=g)
    w1, w2 = torch.randn(e_count, 2 * inter, h, generator=g) * 0.2, torch.randn(e_count, h, inter, generator=g) * 0.2
    one = tmoe._expert_outputs_cuda(x, experts, w1, w2)
    run = e_count // tp
    parts = [kmoe.owned_expert_outputs(x, experts, r * run, w1[r * run:(r + 1) * run], w2[r * run:(r + 1) * run],
                                       fixed_shapes=True) for r in range(tp)]
    for r, part in enumerate(parts):
        others = (experts < r * run) | (experts >= (r + 1) * run)
        assert torch.equal(part[others], torch.zeros_like(part[others]))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    assert torch.equal(total.view(torch.int32), one.view(torch.int32))


def _fp8_experts(e_count, n, k, seed):
    """Stacked E4M3 expert weights ``[E, N, K]`` and their per-row scales ``[E, N, ceil(K/128)]``."""
    from megatron_consistent.kernels import fp8

    g = torch.Generator().manual_seed(seed)
    qs = [fp8.quantize(torch.randn(n, k, generator=g) * 0.05, fp8.E4M3_WEIGHT_128) for _ in range(e_count)]
    return torch.stack([q for q, _ in qs]), torch.stack([fp8.weight_row_scales(s, n) for _, s in qs])


def _fp8_per_pair(x, experts, wq, wrows, out_dtype):
    """Every (token, slot) pair through ``fp8_gemm`` with its expert's weight alone: ``[T*k, N]`` in pair order."""
    from megatron_consistent.kernels.triton import fp8_linear as tf8

    k = experts.shape[1]
    rows = []
    for pair, e in enumerate(experts.reshape(-1).tolist()):
        xq, xs = tf8.quantize_activations(x[pair // k : pair // k + 1])
        rows.append(tf8.fp8_gemm(xq, xs, wq[e], wrows[e], None, out_dtype)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("t,k,e_count,n,kdim,dtype,flat,w_tma", [(1, 2, 3, 128, 384, torch.bfloat16, False, False),
                                                                (1, 2, 3, 128, 384, torch.bfloat16, False, True),
                                                                (5, 2, 3, 136, 1152, torch.float32, False, False),
                                                                (5, 2, 3, 136, 1152, torch.float32, True, False),
                                                                (5, 2, 3, 136, 1152, torch.float32, True, True)])
def test_fp8_grouped_gemm_rows_are_fp8_gemm_per_expert(t, k, e_count, n, kdim, dtype, flat, w_tma, monkeypatch):
    """The grouped FP8 GEMM (tokens gathered through the sorted pairs, or sorted rows scattered to pair order), row for
    row == ``fp8_gemm`` of that row alone with its expert's weight: one split, and two uneven splits (K = 1152: 9
    groups as 5 + 4) with a ragged N edge; ``flat``: the grouped GEMM walks the splits in one loop; ``w_tma``: the
    weights through a descriptor of the stacked experts (with N = 136 a tile's last rows are the next expert's)."""
    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels.triton import fp8_linear as tf8

    g = torch.Generator().manual_seed(t * 100 + n)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    x = torch.randn(t, kdim, generator=g).to(dtype)
    wq, wrows = _fp8_experts(e_count, n, kdim, seed=t)
    ref = _fp8_per_pair(x, experts, wq, wrows, dtype)
    pair_of_row, counts = tmoe.expert_sort(experts, e_count)
    xq, xs = tf8.quantize_activations(x)
    # the per-pair reference is the FP8 GEMM's value: the float64 product of the dequantized operands, within 1e-3 of
    # sum |x w| (tests/test_gpu_fp8.py's bound), so a wrong group, scale or split in the shared loop is seen here too
    # (float32 out only: the interpreter does not round to bfloat16 to nearest)
    xd = fp8.dequantize(xq, xs, fp8.E4M3_ACT_1x128).double()
    for pair, e in enumerate(experts.reshape(-1).tolist() if dtype == torch.float32 else []):
        wd = fp8.dequantize_rows(wq[e], wrows[e]).double()
        exact = xd[pair // k] @ wd.T
        assert ((ref[pair].double() - exact).abs() <= 1e-3 * (xd[pair // k].abs() @ wd.abs().T) + 1e-6).all()
    tiles = tmoe.tile_table(counts, tmoe.fp8_grouped_tiles(tf8.fp8_config(n, kdim), t * k, e_count)[0], t * k)
    monkeypatch.setattr(tmoe, "FP8_GROUPED_FLAT", flat)
    monkeypatch.setattr(tmoe, "FP8_GROUPED_W_TMA", w_tma)
    gathered = tmoe.fp8_grouped_gemm(xq, xs, wq, wrows, tiles, pair_of_row, dtype, gather=True, slots=k)
    assert torch.equal(gathered, ref[pair_of_row])
    scattered = tmoe.fp8_grouped_gemm(xq[pair_of_row // k], xs[pair_of_row // k], wq, wrows, tiles, pair_of_row,
                                      dtype, scatter=True, slots=k)
    assert torch.equal(scattered, ref)


def test_fp8_expert_outputs_are_the_per_expert_chain_and_a_changed_split_is_caught(monkeypatch):
    """The CUDA FP8 expert path (sort, quantize, grouped GEMM, ``silu_and_mul``, quantize, grouped GEMM) on CPU tensors
    == every pair through ``fp8_gemm`` -> ``silu_and_mul`` -> ``fp8_gemm`` alone (float32, where a changed summation
    order shows), with gate and up quantized one by one (64-row scale blocks); a grouped GEMM without
    ``fp8_config``'s split is caught, and so is one that takes one weight scale per 128-row tile."""
    from megatron_consistent.kernels import fp8, silu_and_mul
    from megatron_consistent.kernels.triton import fp8_linear as tf8

    t, k, e_count, h, inter = 4, 2, 3, 1024, 64
    g = torch.Generator().manual_seed(17)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    hidden = torch.randn(t, h, generator=g)
    # [gate; up] quantized part by part as an export does: 64-row scale blocks, so a 128-row tile has two scales
    gate_q, gate_rows = _fp8_experts(e_count, inter, h, seed=1)
    up_q, up_rows = _fp8_experts(e_count, inter, h, seed=3)
    fc1_q, fc1_rows = torch.cat([gate_q, up_q], dim=1), torch.cat([gate_rows, up_rows], dim=1)
    fc2_q, fc2_rows = _fp8_experts(e_count, 128, inter, seed=2)
    act = silu_and_mul(_fp8_per_pair(hidden, experts, fc1_q, fc1_rows, torch.float32))
    ref = torch.stack([tf8.fp8_gemm(*tf8.quantize_activations(act[p : p + 1]), fc2_q[e], fc2_rows[e], None,
                                    torch.float32)[0] for p, e in enumerate(experts.reshape(-1).tolist())])
    args = (hidden, experts, fc1_q, fc1_rows, fc2_q, fc2_rows, fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    assert tf8.fp8_config(2 * inter, h)["SPLIT_GROUPS"] < 8  # the first GEMM runs splits
    assert torch.equal(tmoe._fp8_expert_outputs_cuda(*args), ref.reshape(t, k, -1))
    with monkeypatch.context() as m:
        m.setattr(tmoe, "gate_up_block_rows", lambda rows, block_rows: block_rows)  # the format's block, wrongly
        assert tf8.fp8_config(2 * inter, h)["BN"] == 128
        assert not torch.equal(tmoe._fp8_expert_outputs_cuda(*args), ref.reshape(t, k, -1))
    monkeypatch.setattr(tmoe, "fp8_config", lambda n, kk: {**tf8.fp8_config(n, kk), "SPLIT_GROUPS": 8})
    assert not torch.equal(tmoe._fp8_expert_outputs_cuda(*args), ref.reshape(t, k, -1))
