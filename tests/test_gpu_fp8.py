"""FP8 Triton linear (issue #9 on CUDA): batch invariance (bitwise), quantizer equality, accuracy, STE.

Skipped without CUDA.  "Bitwise" means ``torch.equal`` on the raw bits.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton FP8 linear of issue #9)")]

if torch.cuda.is_available():
    from megatron_consistent.kernels.triton import fp8_linear as tf8

from _cuda_graphs import capture
from megatron_consistent.kernels import fp8
from megatron_consistent.kernels.dispatch import implementation

DEV = torch.device("cuda")
MS = [1, 7, 64, 300, 2048]
SHAPES = [(4096, 4096), (6144, 4096), (1000, 300), (256, 1024), (4096, 14336)]

# Accuracy bound vs the float64 value of the same dequantized math, relative to sum_k |xd_k * wd_k| of each
# output: Hopper's FP8 MMA keeps about 14 significant accumulator bits inside a 128-wide group (DeepSeek-V3
# report, sec. 3.3.2), i.e. ~2^-13 of the group's magnitude; the two scale roundings and the float32 group
# accumulation add ~2^-23 each.  1e-3 (~8x the expected 2^-13) still catches a wrong scale (>= 1e-1) or a
# dropped/duplicated group (~1/G of the magnitude).
REL_TOL = 1e-3


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _weight(n, k, seed=0, std=0.05):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * std
    q, s = fp8.quantize(w, fp8.E4M3_WEIGHT_128)
    return w, q, fp8.weight_row_scales(s, n)


def _acts(m, k, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g)
    x[:, : min(k, 5)] *= 40.0  # outlier channels: groups with very different scales
    return x.to(torch.bfloat16)


def test_activation_quantizer_triton_equals_torch_quantize():
    for m, k in [(300, 4096), (37, 300), (5, 128), (1, 1000)]:
        x = _acts(m, k)
        x[min(3, m - 1)] = 0  # a zero row: scale 1
        q, s = tf8.quantize_activations(x, backend="triton")
        q_ref, s_ref = fp8.quantize(x, fp8.E4M3_ACT_1x128)
        assert _bits_equal(s, s_ref), (m, k)
        assert _bits_equal(q, q_ref), (m, k, int((_bits(q) != _bits(q_ref)).sum()))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_row_alone_equals_row_in_batch(n, k, out_dtype):
    _, wq, rows = _weight(n, k)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    x = _acts(2048, k)
    full = fp8.fp8_linear(x, wq, rows, bias, out_dtype)
    for m in MS:
        for start in sorted({0, 2048 - m, (2048 - m) // 3}):
            part = fp8.fp8_linear(x[start : start + m], wq, rows, bias, out_dtype)
            assert _bits_equal(part, full[start : start + m]), f"M={m} rows {start}.. differ from the 2048-row batch"
    perm = torch.randperm(2048, device=DEV)[:300]
    assert _bits_equal(fp8.fp8_linear(x[perm], wq, rows, bias, out_dtype), full[perm])
    assert _bits_equal(fp8.fp8_linear(x, wq, rows, bias, out_dtype), full)  # repeatable


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 300)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_schedules_and_loads_bitwise_equal(n, k, m):
    """Split-parallel vs split-serial scheduling, TMA vs pointer loads, Triton vs torch quantizer: same bits."""
    _, wq, rows = _weight(n, k, seed=2)
    x = _acts(m, k, seed=3)
    outs = []
    for backend in ("triton", "torch"):
        xq, xs = tf8.quantize_activations(x, backend=backend)
        for path in ("serial", "parallel"):
            for tma in (True, False):
                if tma and not (tf8.tma_ok(xq) and tf8.tma_ok(wq)):
                    continue
                outs.append(tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, path=path, use_tma=tma))
    assert len(outs) >= 4
    for o in outs[1:]:
        assert _bits_equal(o, outs[0])


TILE_VARIANTS = [dict(BM=128, BN=128, W=8, S=4, P=1), dict(BM=64, BN=128, W=4, S=4, P=2), dict(BM=128, BN=64, W=4, S=4, P=3),
                 dict(BM=64, BN=128, W=4, S=3, P=8), dict(BM=128, BN=128, W=8, S=3, P=2)]


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1000, 300)])
def test_tile_shapes_bitwise_equal(n, k):
    """Tile shape, warps, stages and programs per SM only schedule the work."""
    _, wq, rows = _weight(n, k, seed=10)
    for m in (1, 64, 300):
        xq, xs = tf8.quantize_activations(_acts(m, k, seed=m))
        ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32)
        for cfg in TILE_VARIANTS:
            assert _bits_equal(tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=cfg), ref), (m, cfg)


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 300), (256, 14336)])
def test_fp8_linear_vs_float64_dequantized_reference(n, k):
    _, wq, rows = _weight(n, k, seed=4)
    x = _acts(64, k, seed=5)
    y = fp8.fp8_linear(x, wq, rows, None, torch.float32)
    xq, xs = fp8.quantize(x, fp8.E4M3_ACT_1x128)
    xd = fp8.dequantize(xq, xs, fp8.E4M3_ACT_1x128).double()
    wd = fp8.dequantize_rows(wq, rows).double()
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    rel = ((y.double() - ref).abs() / mag.clamp_min(1e-30)).max().item()
    assert rel <= REL_TOL, rel
    # and the CPU contract (float32 dequantize + blocked linear) agrees to the same tolerance
    cpu = fp8.fp8_linear(x[:8].cpu(), wq.cpu(), rows.cpu(), None, torch.float32).to(DEV)
    assert ((cpu.double() - y[:8].double()).abs() / mag[:8].clamp_min(1e-30)).max().item() <= REL_TOL


SWS_VARIANTS = [dict(BM=128, BN=64, W=4, S=4, P=3, SWS=True), dict(BM=64, BN=128, W=4, S=4, P=2, SWS=True),
                dict(BM=128, BN=128, W=8, S=4, P=1, SWS=True), dict(BM=256, BN=64, W=8, S=3, P=1, SWS=True),
                dict(BM=64, BN=64, W=4, S=6, P=4, SWS=True), dict(BM=64, BN=128, W=4, S=4, P=2, SWS=True, FLAT=True),
                dict(BM=128, BN=128, W=8, S=4, P=1, SWS=True, FLAT=True), dict(BM=128, BN=64, W=4, S=4, P=3, FLAT=True)]


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1000, 300), (4096, 14336)])
def test_scalar_weight_scale_tiles_bitwise_equal(n, k):
    """SWS (one weight scale per tile and group, 128-row weight blocks) gives the bits of the per-row scales, at
    every M and on both split schedules; a row alone equals the row in a 2048 batch."""
    _, wq, rows = _weight(n, k, seed=11)
    x = _acts(2048, k, seed=12)
    xq, xs = tf8.quantize_activations(x)
    ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32)
    for cfg in SWS_VARIANTS:
        for m in (1, 7, 64, 300, 2048):
            y = tf8.fp8_gemm(xq[:m], xs[:m], wq, rows, None, torch.float32, cfg=cfg, w_block_rows=128)
            assert _bits_equal(y, ref[:m]), (cfg, m)
        y = tf8.fp8_gemm(xq[1000:1001], xs[1000:1001], wq, rows, None, torch.float32, cfg=cfg, w_block_rows=128)
        assert _bits_equal(y, ref[1000:1001]), cfg
        for path in ("serial", "parallel"):
            y = tf8.fp8_gemm(xq[:16], xs[:16], wq, rows, None, torch.float32, cfg=cfg, w_block_rows=128, path=path)
            assert _bits_equal(y, ref[:16]), (cfg, path)


def test_scalar_weight_scale_needs_block_constant_scales():
    """The SWS shortcut is only exact when the row scales are constant over the block: with per-row scales that
    vary inside a block (a lie about ``w_block_rows``) the output changes -- the test above has teeth."""
    n, k = 1024, 1024
    _, wq, rows = _weight(n, k, seed=13)
    g = torch.Generator(device=DEV).manual_seed(14)
    rows = rows * (1 + 0.5 * torch.rand(rows.shape, device=DEV, generator=g))  # per-row, not per-block
    xq, xs = tf8.quantize_activations(_acts(64, k, seed=15))
    ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32)
    cfg = dict(BM=64, BN=128, W=4, S=4, P=2, SWS=True)
    assert not _bits_equal(tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=cfg, w_block_rows=128), ref)
    # without the block claim the config falls back to per-row scales: exact again
    assert _bits_equal(tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=cfg), ref)


@pytest.mark.parametrize("nk", (sorted(tf8._FP8_OVERRIDES) if torch.cuda.is_available() else []) or [None], ids=str)
def test_fp8_tile_overrides_rows_identical(nk):
    """Tiles adopted from the sweep (gemm_tables.FP8_TILE_OVERRIDES): row alone = row in batch, and the bits of the
    previous table tile."""
    if nk is None:
        pytest.skip("no FP8 tile overrides installed")
    n, k = nk
    _, wq, rows = _weight(n, k, seed=16)
    x = _acts(2048, k, seed=17)
    full = fp8.fp8_linear(x, wq, rows, None, torch.float32)
    for m in (1, 7, 64, 300):
        assert _bits_equal(fp8.fp8_linear(x[:m], wq, rows, None, torch.float32), full[:m]), m
    xq, xs = tf8.quantize_activations(x)
    base = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=dict(BM=64, BN=128, W=4, S=4, P=2))
    assert _bits_equal(full, base)


def test_broken_m_dependent_split_is_caught():
    """A split-K that depends on M (more splits for small M, as a naive decode kernel would do) changes bits."""
    n, k = 4096, 4096
    _, wq, rows = _weight(n, k, seed=6)
    x = _acts(2048, k, seed=7)

    def broken(xb):
        xq, xs = tf8.quantize_activations(xb)
        return tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, split_groups=1 if xb.shape[0] < 64 else 32)

    full = broken(x)
    assert any(not _bits_equal(broken(x[i : i + 1]), full[i : i + 1]) for i in range(0, 2048, 97))
    # the real kernel on the same rows passes
    good_full = fp8.fp8_linear(x, wq, rows, None, torch.float32)
    assert all(_bits_equal(fp8.fp8_linear(x[i : i + 1], wq, rows, None, torch.float32), good_full[i : i + 1])
               for i in range(0, 2048, 97))


def test_other_formats_take_the_dequantized_triton_linear():
    """Formats the FP8 kernel does not take (here 1x64 activation groups) run the CPU path's float32 dequantized
    operands through the Triton linear: bitwise that, and still batch-invariant."""
    _, wq, rows = _weight(256, 512)
    x = _acts(40, 512)
    a64 = fp8.QuantFormat("e4m3", (1, 64), "fp32")
    y = fp8.fp8_linear(x, wq, rows, a_fmt=a64)
    xq, xs = fp8.quantize(x, a64)
    ref = implementation("linear", DEV)(fp8.dequantize(xq, xs, a64), fp8.dequantize_rows(wq, rows), None, torch.bfloat16)
    assert _bits_equal(y, ref)
    assert _bits_equal(fp8.fp8_linear(x[7:8], wq, rows, a_fmt=a64), y[7:8])


def test_ste_forward_is_the_cuda_fp8_linear_and_backward_runs_on_cuda():
    n, k, m = 512, 1024, 96
    w, wq, rows = _weight(n, k, seed=8)
    master = w.to(torch.bfloat16).requires_grad_(True)
    bias = torch.zeros(n, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    x = _acts(m, k, seed=9).requires_grad_(True)
    y = fp8.fp8_linear_ste(x, master, bias, wq, rows)
    direct = implementation("fp8_linear", DEV)(x.detach(), wq, rows, bias.detach(), torch.bfloat16)
    assert _bits_equal(y.detach(), direct)  # trainer forward == engine forward on CUDA
    up = torch.randn(m, n, device=DEV)
    (y.float() * up).sum().backward()
    assert x.grad.is_cuda and master.grad.is_cuda and master.grad.dtype == torch.bfloat16
    xq, xs = fp8.quantize(x.detach(), fp8.E4M3_ACT_1x128)
    xd = fp8.dequantize(xq, xs, fp8.E4M3_ACT_1x128).double()
    wd = fp8.dequantize_rows(wq, rows).double()
    gx_ref, gw_ref = up.double() @ wd, up.double().T @ xd
    # bf16 tensor-core backward: operands rounded to bf16 (2^-9 relative each), float32 accumulation; 1e-2
    # relative Frobenius error leaves headroom while a transposed / wrong operand gives O(1)
    assert (x.grad.double() - gx_ref).norm() / gx_ref.norm() <= 1e-2
    assert (master.grad.double() - gw_ref).norm() / gw_ref.norm() <= 1e-2
    ref_b = up.sum(0)  # the bias gradient: a float32 column sum of the upstream gradient, rounded to bf16
    assert ((bias.grad.float() - ref_b).abs() <= 1e-1 + 1e-2 * ref_b.abs()).all()


def _fp8_experts(e_count, n, k, seed):
    qs = [_weight(n, k, seed=seed * 1000 + e)[1:] for e in range(e_count)]
    return torch.stack([q for q, _ in qs]), torch.stack([r for _, r in qs])


def _fp8_fc1(e_count, inter, h):
    """[gate; up] per expert, each quantized on its own as an export does (scale blocks restart at row ``inter``)."""
    (gq, gr), (uq, ur) = _fp8_experts(e_count, inter, h, seed=1), _fp8_experts(e_count, inter, h, seed=3)
    return torch.cat([gq, uq], dim=1), torch.cat([gr, ur], dim=1)


def _routes(t, k, e_count, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)]).to(DEV)


@pytest.mark.parametrize("t,k,e_count,h,inter", [(1, 8, 128, 2048, 768), (7, 8, 128, 2048, 768), (300, 8, 128, 2048, 768),
                                                 (64, 2, 8, 1024, 1000), (2048, 8, 32, 2048, 768), (64, 1, 8, 128, 64)])
def test_grouped_fp8_experts_equal_the_per_expert_fp8_linears(t, k, e_count, h, inter):
    """The engine's grouped FP8 experts (one FP8 GEMM launch per projection, rows gathered / scattered through the
    sorted pairs) == the trainer's per-expert ``fp8_linear`` calls, bitwise (both BM classes: 64-row tiles at few
    rows per expert, the config's at many; Qwen3-30B-A3B's shapes, a ragged one, and 64-row gate / up parts whose
    scale blocks split a 128-row tile); a token alone == in the batch."""
    from megatron_consistent.kernels.triton import moe as tmoe

    experts = _routes(t, k, e_count, seed=t)
    hidden = _acts(t, h, seed=t + 1)
    fc1_q, fc1_rows = _fp8_fc1(e_count, inter, h)
    fc2_q, fc2_rows = _fp8_experts(e_count, h, inter, seed=2)
    args = (fc1_q, fc1_rows, fc2_q, fc2_rows, fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    got = tmoe._fp8_expert_outputs_cuda(hidden, experts, *args)
    ref = fp8.per_expert_fp8_outputs(hidden, experts, *args)
    assert _bits_equal(got, ref), int((_bits(got) != _bits(ref)).sum())
    for i in sorted({0, t // 2, t - 1}):
        assert _bits_equal(tmoe._fp8_expert_outputs_cuda(hidden[i : i + 1], experts[i : i + 1], *args), got[i : i + 1])


@pytest.mark.parametrize("flat,tile,w_tma", [(True, "", False), (True, "", True), (False, "", True),
                                             (True, "64:64:4", True), (True, "64:128:8", False), (False, "64:64:4", False)])
@pytest.mark.parametrize("t", [1, 300, 2048])
def test_grouped_fp8_launch_shapes_and_flat_walk_keep_the_bits(t, flat, tile, w_tma, monkeypatch):
    """The grouped FP8 experts with the splits walked in one loop (``FLAT``), other (BM, BN, warps) launch shapes
    (``MC_FP8_GROUPED_TILE``) and the weights through a TMA descriptor (``FP8_GROUPED_W_TMA``) == the trainer's
    per-expert ``fp8_linear`` calls, bitwise, at Qwen3-30B-A3B's shapes (the gate/up projection runs 4 splits)."""
    from megatron_consistent.kernels.triton import moe as tmoe

    monkeypatch.setattr(tmoe, "FP8_GROUPED_FLAT", flat)
    monkeypatch.setattr(tmoe, "_FP8_GROUPED_TILE", tile)
    monkeypatch.setattr(tmoe, "FP8_GROUPED_W_TMA", w_tma)
    experts = _routes(t, 8, 128, seed=t)
    hidden = _acts(t, 2048, seed=t + 1)
    fc1_q, fc1_rows = _fp8_fc1(128, 768, 2048)
    fc2_q, fc2_rows = _fp8_experts(128, 2048, 768, seed=2)
    assert tf8.fp8_config(2 * 768, 2048)["SPLIT_GROUPS"] < 16
    args = (fc1_q, fc1_rows, fc2_q, fc2_rows, fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    got = tmoe._fp8_expert_outputs_cuda(hidden, experts, *args)
    ref = fp8.per_expert_fp8_outputs(hidden, experts, *args)
    assert _bits_equal(got, ref), int((_bits(got) != _bits(ref)).sum())


def test_engine_fp8_ops_replay_as_a_cuda_graph():
    """The engine's FP8 ops (the FP8 linear, router, route, grouped FP8 experts with a shared expert, combine) read
    nothing on the host: captured once in a CUDA graph, replayed on new tokens, they give the eager bits."""
    from megatron_consistent.kernels import inference_ops

    E, H, inter, T, k = 16, 1024, 512, 40, 4
    _, lin_q, lin_rows = _weight(H, H, seed=3)
    fc1_q, fc1_rows = _fp8_experts(E, 2 * inter, H, seed=4)
    fc2_q, fc2_rows = _fp8_experts(E, H, inter, seed=5)
    s1_q, s1_rows = _weight(2 * inter, H, seed=6)[1:]
    s2_q, s2_rows = _weight(H, inter, seed=7)[1:]
    router = (torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16)
    gate = (torch.randn(1, H, device=DEV) * 0.05).to(torch.bfloat16)
    specs = (fp8.E4M3_WEIGHT_128.spec, fp8.E4M3_ACT_1x128.spec)

    def block(x):
        x = inference_ops.fp8_linear(x, lin_q, lin_rows, None, *specs)
        w, e = inference_ops.moe_route(inference_ops.router_logits(x, router), k, "softmax", None, True, 1, 1, 1.0)
        return inference_ops.fp8_moe_experts(x, e, w, fc1_q, fc1_rows, fc2_q, fc2_rows, s1_q, s1_rows, s2_q, s2_rows,
                                             gate, *specs)

    static_x = _acts(T, H, seed=8)
    graph, static_out = capture(block, static_x)
    for seed in (9, 10):
        static_x.copy_(_acts(T, H, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert _bits_equal(static_out, block(static_x.clone()))


def test_fp8_owned_experts_over_two_ranks_equal_the_whole_block_and_replay():
    """The engine's FP8 MoE at TP 2 on one GPU: each "rank"'s whole experts through
    ``fp8_moe_owned_expert_outputs`` (the other rank's pairs as expert -1: no row in the grouped FP8 GEMMs, masked to
    ``+0.0``), summed, ``fp8_moe_combine`` with the shared expert = ``fp8_moe_experts`` with every expert, bitwise;
    the owned op captured in a CUDA graph replays with the eager bits."""
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels.numerics import adjacent_tree_sum

    E, H, inter, T, k = 16, 1024, 512, 40, 4
    fc1_q, fc1_rows = _fp8_experts(E, 2 * inter, H, seed=4)
    fc2_q, fc2_rows = _fp8_experts(E, H, inter, seed=5)
    sh = (*_weight(2 * inter, H, seed=6)[1:], *_weight(H, inter, seed=7)[1:], (torch.randn(1, H, device=DEV) * 0.05).to(torch.bfloat16))
    router = (torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16)
    specs = (fp8.E4M3_WEIGHT_128.spec, fp8.E4M3_ACT_1x128.spec)
    x = _acts(T, H, seed=8)
    w, e = inference_ops.moe_route(inference_ops.router_logits(x, router), k, "softmax", None, True, 1, 1, 1.0)
    one = inference_ops.fp8_moe_experts(x, e, w, fc1_q, fc1_rows, fc2_q, fc2_rows, *sh, *specs)
    run = E // 2

    def owned(x, e, r):
        cut = slice(r * run, (r + 1) * run)
        return inference_ops.fp8_moe_owned_expert_outputs(x, e, r * run, fc1_q[cut], fc1_rows[cut], fc2_q[cut],
                                                          fc2_rows[cut], *specs)

    ranks = [owned(x, e, r) for r in range(2)]
    assert _bits_equal(inference_ops.fp8_moe_combine(x, adjacent_tree_sum(torch.stack(ranks), dim=0), w, *sh, *specs), one)
    graph, static_out = capture(lambda xx: owned(xx, e, 1), x.clone())
    graph.replay()
    torch.cuda.synchronize()
    assert _bits_equal(static_out, ranks[1])


def test_nvfp4_linear_replays_as_a_cuda_graph():
    """NVFP4 (W4A16): codes unpacked and decoded on the device (no host table), so the linear captures too."""
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels.nvfp4 import nvfp4_effective_scales, nvfp4_quantize, pack_e2m1, unpack_e2m1

    q, sb, g = nvfp4_quantize(torch.randn(512, 1024, device=DEV) * 0.05)
    packed = pack_e2m1(q)

    def block(x):
        return inference_ops.fp8_linear(x, unpack_e2m1(packed), nvfp4_effective_scales(sb, g), None,
                                        fp8.NVFP4_WEIGHT.spec, "")

    static_x = _acts(24, 1024, seed=11)
    graph, static_out = capture(block, static_x)
    static_x.copy_(_acts(24, 1024, seed=12))
    graph.replay()
    torch.cuda.synchronize()
    assert _bits_equal(static_out, block(static_x.clone()))


def test_nvfp4_quantize_on_cuda_equals_the_cpu():
    """The trainer quantizes its NVFP4 weights on the GPU, the export on the CPU: codes, block scales and the global
    scale must be the same bits (session 18: ``amax / CPU scalar`` ran as a reciprocal multiply on CUDA and the check
    mismatched at every token); the device decode gives the grid."""
    from megatron_consistent.kernels.nvfp4 import E2M1_GRID, decode_e2m1, nvfp4_quantize

    g = torch.Generator().manual_seed(13)
    for rows, cols in [(512, 1024), (96, 40), (1, 7)]:
        w = torch.randn(rows, cols, generator=g) * 0.05
        got = nvfp4_quantize(w.to(DEV))
        ref = nvfp4_quantize(w)
        for a, b in zip(got, ref):
            assert _bits_equal(a.cpu(), b), (rows, cols)
    codes = torch.arange(16, dtype=torch.uint8, device=DEV)
    grid = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)], dtype=torch.float32)
    assert _bits_equal(decode_e2m1(codes).cpu(), grid)


# ------------------------------------------------------------------------------------------- row-parallel FP8 tree
def _segment_reference(x, q, rows, bias, segments, out_dtype):
    """Per K segment the CUDA ``fp8_linear`` of its slice (float32 out, no bias), ``adjacent_tree_sum``, bias, one
    rounding: the row-parallel FP8 contract, launch by launch."""
    from megatron_consistent.kernels.numerics import adjacent_tree_sum

    k = q.shape[1]
    seg, g = k // segments, k // segments // 128
    parts = torch.stack([implementation("fp8_linear", x.device)(x[:, s * seg:(s + 1) * seg].contiguous(),
                                                                q[:, s * seg:(s + 1) * seg].contiguous(),
                                                                rows[:, s * g:(s + 1) * g].contiguous(), None, torch.float32)
                         for s in range(segments)])
    total = adjacent_tree_sum(parts, dim=0)
    return (total if bias is None else total + bias.float()).to(out_dtype)


@pytest.mark.parametrize("n,k,segments", [(4096, 4096, 8), (4096, 14336, 8), (1024, 2048, 4), (256, 1024, 2), (512, 1024, 1)])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_fp8_row_parallel_tree_equals_the_per_segment_fp8_linears(n, k, segments, m):
    """``fp8_linear(..., segments=S)`` on CUDA (``fp8_linear_segment_tree``) = the per-segment reference, bitwise, in bf16
    with bias and as a float32 subtree; a rank's half (S/2 segments on its K shard) and the top of the tree give the
    same bits (TP 2); each row alone = in the batch."""
    _, q, rows = _weight(n, k, seed=2)
    x = _acts(m, k, seed=3)
    b = torch.randn(n, device=DEV).to(torch.bfloat16)
    want = _segment_reference(x, q, rows, b, segments, torch.bfloat16)
    got = fp8.fp8_linear(x, q, rows, b, segments=segments)
    assert _bits_equal(got, want)
    assert _bits_equal(fp8.fp8_linear(x, q, rows, None, torch.float32, segments=segments),
                       _segment_reference(x, q, rows, None, segments, torch.float32))
    if segments > 1:
        from megatron_consistent.kernels.numerics import adjacent_tree_sum

        h, gh = k // 2, k // 256
        halves = [fp8.fp8_linear(x[:, r * h:(r + 1) * h].contiguous(), q[:, r * h:(r + 1) * h].contiguous(),
                                 rows[:, r * gh:(r + 1) * gh].contiguous(), None, torch.float32, segments=segments // 2)
                  for r in range(2)]
        assert _bits_equal((adjacent_tree_sum(torch.stack(halves), dim=0) + b.float()).to(torch.bfloat16), got)
    for i in {0, m - 1}:
        assert _bits_equal(fp8.fp8_linear(x[i:i + 1], q, rows, b, segments=segments), got[i:i + 1])


def test_fp8_row_parallel_tree_small_segments_take_the_dequantized_tree():
    """Segments narrower than a 128-wide group (tiny models at TP 1): the dequantized operands through the CUDA
    ``linear_segment_tree`` -- the CPU path's arithmetic, not the FP8 GEMM."""
    _, q, rows = _weight(64, 128, seed=4)
    x = _acts(5, 128, seed=5)
    xd, wd = fp8._dequantized_operands(x, q, rows, fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    want = implementation("linear_segment_tree", DEV)(xd, wd, 8, None, torch.bfloat16)
    assert _bits_equal(fp8.fp8_linear(x, q, rows, segments=8), want)
