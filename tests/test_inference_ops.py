"""The custom-op inference forwards (kernels/inference_ops.py) give the bits of the training path, and compile whole.

The vLLM plugin's models call these ops so that vLLM can compile them and replay
CUDA graphs; the trainer calls the ``autograd.Function`` of each op.  Both must run
the same registered forward.  A deliberately different forward is caught.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_consistent.kernels import RopeConfig, apply_rope, inference_ops, linear, rms_norm, rope_cache, silu_and_mul

DTYPES = [torch.bfloat16, torch.float32]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 130), n=st.integers(1, 70), bias=st.booleans(), dt=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_linear_equals_training_path(m, k, n, bias, dt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dt).to(_device())
    w = torch.randn(n, k, generator=g).to(dt).to(_device())
    b = torch.randn(n, generator=g).to(dt).to(_device()) if bias else None
    assert torch.equal(inference_ops.linear(x, w, b), linear(x, w, b))
    assert torch.equal(inference_ops.linear(x[None], w, b)[0], linear(x, w, b))  # leading dims are rows


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), j=st.integers(1, 24), n=st.integers(1, 70), bias=st.booleans(), dt=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_row_parallel_equals_training_path(m, j, n, bias, dt, seed):
    """The fused ``row_parallel_linear`` op = the trainer's ``row_parallel_linear`` (segment partials, torch tree,
    bias, rounding); ``linear_segment_tree`` = ``adjacent_tree_sum(linear_segments)`` for every segment count, and
    the TP = t split of the segments reduced by the top of the tree = TP 1."""
    from megatron_consistent.kernels import linear_segments, row_parallel_linear
    from megatron_consistent.kernels.numerics import adjacent_tree_sum

    k = 8 * j
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dt).to(_device())
    w = torch.randn(n, k, generator=g).to(dt).to(_device())
    b = torch.randn(n, generator=g).to(dt).to(_device()) if bias else None
    with torch.no_grad():
        assert torch.equal(inference_ops.row_parallel_linear(x, w, 8, b), row_parallel_linear(x, w, 8, b))
        assert torch.equal(inference_ops.row_parallel_linear(x[None], w, 8, b)[0], row_parallel_linear(x, w, 8, b))
        tp1 = inference_ops.linear_segment_tree(x, w, 8)
        for segments in (1, 2, 4, 8):
            assert torch.equal(inference_ops.linear_segment_tree(x, w, segments),
                               adjacent_tree_sum(linear_segments(x, w, segments), dim=0))
            t, kl = 8 // segments, k * segments // 8
            ranks = [inference_ops.linear_segment_tree(x[:, r * kl:(r + 1) * kl].contiguous(),
                                                       w[:, r * kl:(r + 1) * kl].contiguous(), segments) for r in range(t)]
            assert torch.equal(adjacent_tree_sum(torch.stack(ranks), dim=0), tp1)


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 33), h=st.integers(1, 200), heads=st.integers(1, 4), dt=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_rms_norm_and_silu_equal_training_path(t, h, heads, dt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, 2 * h, generator=g).to(dt).to(_device())
    w = torch.randn(2 * h, generator=g).to(dt).to(_device())
    assert torch.equal(inference_ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    assert torch.equal(inference_ops.silu_and_mul(x), silu_and_mul(x))


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 33), h=st.integers(1, 300), dt=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_add_rms_norm_equals_add_then_norm(t, h, dt, seed):
    """The fused residual add + RMSNorm of the engine = the training path's add, then its norm; a row alone = in a batch."""
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(t, h, generator=g).mul(4).to(dt).to(_device()) for _ in range(2))
    w = torch.randn(h, generator=g).to(dt).to(_device())
    y, hs = inference_ops.add_rms_norm(x, r, w, 1e-5)
    y_ref, h_ref = rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(hs, h_ref) and torch.equal(y, y_ref)
    y1, h1 = inference_ops.add_rms_norm(x[-1:], r[-1:], w, 1e-5)
    assert torch.equal(y1, y[-1:]) and torch.equal(h1, hs[-1:])


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
def test_rope_equals_training_path(style, rot_frac):
    head_dim = 32
    cfg = RopeConfig(rotary_dim=int(head_dim * rot_frac), max_positions=256, base=10000.0, style=style)
    g = torch.Generator().manual_seed(0)
    dev = torch.device(_device())
    x = torch.randn(19, 3, head_dim, generator=g).to(torch.bfloat16).to(dev)
    pos = torch.randint(0, 256, (19,), generator=g).to(dev)
    cos, sin = rope_cache(cfg, dev)
    assert torch.equal(inference_ops.rope(x, cos[pos], sin[pos], style), apply_rope(x, pos, cfg))


def test_a_different_forward_is_caught():
    """A plain float32 matmul is not the contract's linear: the comparison used above must see it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1000, generator=g)
    w = torch.randn(64, 1000, generator=g)
    plain = x @ w.t()
    assert not torch.equal(plain, inference_ops.linear(x, w))


@pytest.mark.slow
def test_ops_compile_without_graph_breaks():
    """Dynamo treats each op as one opaque node: a layer-like function compiles with fullgraph=True."""
    cfg = RopeConfig(rotary_dim=16, max_positions=64)
    cos, sin = rope_cache(cfg)
    g = torch.Generator().manual_seed(2)
    w_qkv = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    w_norm = torch.randn(32, generator=g).to(torch.bfloat16)

    def block(h, positions):
        x = inference_ops.rms_norm(h, w_norm, 1e-5)
        q = inference_ops.linear(x, w_qkv).reshape(h.shape[0], 3, 16)
        q = inference_ops.rope(q, cos[positions], sin[positions], "neox")
        return inference_ops.silu_and_mul(q.reshape(h.shape[0], 48)[:, :32])

    h = torch.randn(7, 32, generator=g).to(torch.bfloat16)
    pos = torch.arange(7)
    compiled = torch.compile(block, fullgraph=True, backend="eager", dynamic=True)
    assert torch.equal(compiled(h, pos), block(h, pos))


@pytest.mark.parametrize("scoring, shared, activation", [("softmax", "gated", "swiglu"), ("sigmoid", "ungated", "relu2"),
                                                         ("softmax", None, "swiglu")])
def test_moe_ops_equal_training_path(scoring, shared, activation):
    """Router logits, route (incl. selection bias and group limit) and the expert block: the trainer's bits."""
    from megatron_consistent.kernels import moe as kmoe

    g = torch.Generator().manual_seed(5)
    dev, dt, E, H, inter, k = _device(), torch.bfloat16, 8, 32, 16, 2
    x = torch.randn(13, H, generator=g).to(dt).to(dev)
    router = (torch.randn(E, H, generator=g) * 0.2).to(dt).to(dev)
    rows = 2 * inter if activation == "swiglu" else inter
    up = (torch.randn(E, rows, H, generator=g) * 0.1).to(dt).to(dev)
    down = (torch.randn(E, H, inter, generator=g) * 0.1).to(dt).to(dev)
    s_up = (torch.randn(rows, H, generator=g) * 0.1).to(dt).to(dev) if shared else None
    s_down = (torch.randn(H, inter, generator=g) * 0.1).to(dt).to(dev) if shared else None
    s_gate = torch.randn(1, H, generator=g).to(dt).to(dev) if shared == "gated" else None
    bias = torch.randn(E, generator=g).to(dev) if scoring == "sigmoid" else None
    n_group, topk_group, scaling = (4, 2, 2.5) if scoring == "sigmoid" else (1, 1, 1.0)
    with torch.no_grad():
        z = inference_ops.router_logits(x, router)
        assert torch.equal(z, kmoe.router_logits(x, router))
        w, e = inference_ops.moe_route(z, k, scoring, bias, True, n_group, topk_group, scaling)
        w2, e2 = kmoe.route_logits(z, k, scoring, bias, True, n_group, topk_group, scaling)
        assert torch.equal(w, w2) and torch.equal(e, e2)
        out = inference_ops.moe_experts(x, e, w, up, down, s_up, s_down, s_gate, activation)
        ref = kmoe.moe_experts(x, e, w, up, down, None if shared is None else (s_up, s_down, s_gate), activation)
        assert torch.equal(out, ref)


def test_engine_route_has_no_nan_refusal():
    """The trainer's route refuses NaN scores (a host read); the engine's op must not read the host: it routes a NaN
    row to valid experts and leaves the other rows' bits alone."""
    from megatron_consistent.kernels import moe as kmoe

    z = torch.tensor([[0.5, float("nan"), 0.1, 0.2], [0.3, 0.1, 0.9, 0.2]], device=_device())
    with pytest.raises(ValueError, match="NaN"):
        kmoe.route_logits(z, 2)
    w, e = inference_ops.moe_route(z, 2, "softmax", None, False, 1, 1, 1.0)
    assert bool(((e >= 0) & (e < 4)).all())
    w1, e1 = kmoe.route_logits(z[1:], 2)
    assert torch.equal(w[1:], w1) and torch.equal(e[1:], e1)


def test_mamba_elementwise_ops_equal_training_path():
    import math

    from megatron_consistent.kernels import gated_rms_norm, mamba_dt, relu_squared

    g = torch.Generator().manual_seed(6)
    dev = _device()
    x = torch.randn(9, 32, generator=g).to(torch.bfloat16).to(dev)
    z = torch.randn(9, 32, generator=g).to(torch.bfloat16).to(dev)
    b = torch.randn(32, generator=g).to(dev)
    with torch.no_grad():
        assert torch.equal(inference_ops.relu_squared(x), relu_squared(x))
        assert torch.equal(inference_ops.mamba_dt(x, b, 0.001, math.inf), mamba_dt(x, b, 0.001, math.inf))
        assert torch.equal(inference_ops.gated_rms_norm(x, z, b, 8, 1e-5), gated_rms_norm(x, z, b, 8, 1e-5))


@pytest.mark.slow
def test_moe_and_mamba_ops_compile_without_graph_breaks():
    """The MoE block (one-rank and TP-sharded) and the Mamba layer's elementwise ops are opaque nodes too:
    fullgraph=True compiles them."""
    g = torch.Generator().manual_seed(7)
    E, H, inter = 4, 32, 8
    router = (torch.randn(E, H, generator=g) * 0.2).to(torch.bfloat16)
    up = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, H, inter, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.randn(H, generator=g)

    def block(h):
        w, e = inference_ops.moe_route(inference_ops.router_logits(h, router), 2, "softmax", None, True, 1, 1, 1.0)
        m = inference_ops.moe_experts(h, e, w, up, down, None, None, None, "swiglu")
        # the TP = 2 experts of both ranks in one process (the engine all-gathers them): rank 0's run, rank 1's run
        owned = [inference_ops.moe_owned_expert_outputs(h, e, r * 2, up[r * 2:(r + 1) * 2], down[r * 2:(r + 1) * 2],
                                                        "swiglu") for r in (0, 1)]
        sharded = inference_ops.moe_combine(h, owned[0] + owned[1], w, None, None, None, "swiglu")
        dt = inference_ops.mamba_dt(m, bias, 0.0, float("inf"))
        return inference_ops.gated_rms_norm(inference_ops.relu_squared(m), h, bias, 8, 1e-5), dt, m, sharded

    h = torch.randn(7, H, generator=g).to(torch.bfloat16)
    got = torch.compile(block, fullgraph=True, backend="eager", dynamic=True)(h)
    for a, b in zip(got, block(h)):
        assert torch.equal(a, b)
    assert torch.equal(got[3], got[2])  # the sharded experts: the bits of the one-rank block


def _fp8_weight(n, k, g, fmt):
    """``(codes, per-row scales)`` of a random ``[n, k]`` weight in ``fmt`` (NVFP4: codes one per byte)."""
    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels.nvfp4 import nvfp4_effective_scales, nvfp4_quantize

    w = torch.randn(n, k, generator=g) * 0.05
    if fmt.name == "e2m1":
        q, sb, gs = nvfp4_quantize(w)
        return q, nvfp4_effective_scales(sb, gs)
    q, s = fp8.quantize(w, fmt)
    return q, fp8.weight_row_scales(s, n, fmt)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_fp8_linear_op_equals_training_path_and_a_wrong_format_is_caught(quant):
    """The custom op (formats passed as spec strings) = :func:`kernels.fp8.fp8_linear` with the format objects, bias and
    leading dims included; the spec round-trips; the same codes read in the other activation format differ."""
    from megatron_consistent.kernels import fp8

    w_fmt, a_fmt = (fp8.NVFP4_WEIGHT, None) if quant == "nvfp4" else (fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128)
    assert fp8.QuantFormat.from_spec(w_fmt.spec) == w_fmt
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 256, generator=g).to(torch.bfloat16).to(_device())
    q, rows = (t.to(_device()) for t in _fp8_weight(96, 256, g, w_fmt))
    b = torch.randn(96, generator=g).to(torch.bfloat16).to(_device())
    a_spec = a_fmt.spec if a_fmt is not None else ""
    with torch.no_grad():
        got = inference_ops.fp8_linear(x, q, rows, b, w_fmt.spec, a_spec)
        assert torch.equal(got, fp8.fp8_linear(x, q, rows, b, w_fmt=w_fmt, a_fmt=a_fmt))
        assert torch.equal(inference_ops.fp8_linear(x[1, 4:5], q, rows, b, w_fmt.spec, a_spec), got[1, 4:5])
        if quant == "fp8":  # weight-only reading of the same codes: not the contract's activation quantization
            assert not torch.equal(inference_ops.fp8_linear(x, q, rows, b, w_fmt.spec, ""), got)


@pytest.mark.parametrize("shared", [False, True])
def test_fp8_moe_op_equals_training_path(shared):
    """The FP8 expert block as one custom op = :func:`kernels.fp8.fp8_moe_experts` (without masters: the device's
    ``fp8_moe_expert_outputs``) and = the per-expert calls the trainer makes with masters; a token alone = in the batch."""
    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels import moe as kmoe

    g = torch.Generator().manual_seed(8)
    dev, E, H, inter, k, t = _device(), 4, 256, 128, 2, 11
    w_fmt, a_fmt = fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128
    x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(dev)
    fc1 = [_fp8_weight(2 * inter, H, g, w_fmt) for _ in range(E)]
    fc2 = [_fp8_weight(H, inter, g, w_fmt) for _ in range(E)]
    fc1_q, fc1_rows, fc2_q, fc2_rows = (torch.stack([p[i] for p in ws]).to(dev) for ws, i in ((fc1, 0), (fc1, 1), (fc2, 0), (fc2, 1)))
    sh = [t_.to(dev) for t_ in (*_fp8_weight(2 * inter, H, g, w_fmt), *_fp8_weight(H, inter, g, w_fmt))] if shared else [None] * 4
    gate = torch.randn(1, H, generator=g).to(torch.bfloat16).to(dev) if shared else None
    w, e = kmoe.route_logits(kmoe.router_logits(x, (torch.randn(E, H, generator=g) * 0.2).to(torch.bfloat16).to(dev)), k)
    specs = (w_fmt.spec, a_fmt.spec)
    shared_w = (fp8.FP8Weights(sh[0], sh[1]), fp8.FP8Weights(sh[2], sh[3]), gate) if shared else None
    with torch.no_grad():
        got = inference_ops.fp8_moe_experts(x, e, w, fc1_q, fc1_rows, fc2_q, fc2_rows, *sh, gate, *specs)
        assert torch.equal(got, fp8.fp8_moe_experts(x, e, w, fp8.FP8Weights(fc1_q, fc1_rows), fp8.FP8Weights(fc2_q, fc2_rows),
                                                    shared_w, w_fmt=w_fmt, a_fmt=a_fmt))
        masters = fp8.fp8_moe_experts(x, e, w, fp8.FP8Weights(fc1_q, fc1_rows, fc1_q.to(torch.bfloat16)),
                                      fp8.FP8Weights(fc2_q, fc2_rows, fc2_q.to(torch.bfloat16)), shared_w, w_fmt=w_fmt, a_fmt=a_fmt)
        assert torch.equal(got, masters)
        alone = inference_ops.fp8_moe_experts(x[5:6], e[5:6], w[5:6], fc1_q, fc1_rows, fc2_q, fc2_rows, *sh, gate, *specs)
        assert torch.equal(alone, got[5:6])


@pytest.mark.slow
def test_fp8_ops_compile_without_graph_breaks():
    """An FP8 layer-like function (block scales expanded to rows, the FP8 linear, the FP8 expert block) compiles with
    fullgraph=True and gives the eager bits; NVFP4 (codes unpacked, effective scales) too."""
    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels.nvfp4 import nvfp4_quantize, pack_e2m1, unpack_e2m1

    g = torch.Generator().manual_seed(9)
    E, H, inter, k = 3, 256, 128, 2
    w_fmt, a_fmt = fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128
    q_lin, s_lin = fp8.quantize(torch.randn(H, H, generator=g) * 0.05, w_fmt)
    fc1 = [fp8.quantize(torch.randn(2 * inter, H, generator=g) * 0.05, w_fmt) for _ in range(E)]
    fc2 = [fp8.quantize(torch.randn(H, inter, generator=g) * 0.05, w_fmt) for _ in range(E)]
    fc1_q, fc1_s = torch.stack([q for q, _ in fc1]), torch.stack([s for _, s in fc1])
    fc2_q, fc2_s = torch.stack([q for q, _ in fc2]), torch.stack([s for _, s in fc2])
    router = (torch.randn(E, H, generator=g) * 0.2).to(torch.bfloat16)
    nv_q, nv_sb, nv_g = nvfp4_quantize(torch.randn(H, H, generator=g) * 0.05)
    nv_packed = pack_e2m1(nv_q)
    specs, nv_spec = (w_fmt.spec, a_fmt.spec), fp8.NVFP4_WEIGHT.spec  # strings made once, as the plugin's layers do

    def block(h):
        x = inference_ops.fp8_linear(h, q_lin, fp8.weight_row_scales(s_lin, H), None, *specs)
        w, e = inference_ops.moe_route(inference_ops.router_logits(x, router), k, "softmax", None, True, 1, 1, 1.0)
        y = inference_ops.fp8_moe_experts(x, e, w, fc1_q, fp8.weight_row_scales(fc1_s, 2 * inter), fc2_q,
                                          fp8.weight_row_scales(fc2_s, H), None, None, None, None, None, *specs)
        rows = nv_sb.to(torch.float32) * nv_g
        return inference_ops.fp8_linear(y, unpack_e2m1(nv_packed), rows, None, nv_spec, "")

    h = torch.randn(6, H, generator=g).to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        assert torch.equal(compiled(h), block(h))
