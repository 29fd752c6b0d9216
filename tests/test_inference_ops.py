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
        assert torch.equal(inference_ops.row_parallel_linear(x, w, b), row_parallel_linear(x, w, b))
        assert torch.equal(inference_ops.row_parallel_linear(x[None], w, b)[0], row_parallel_linear(x, w, b))
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
