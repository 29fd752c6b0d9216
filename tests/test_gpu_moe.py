"""MoE on CUDA (issue #7): token alone == token in batch (bitwise), grouped expert GEMM == the Triton linear
per expert (bitwise), exact router ties -> lowest index, gradients vs a float64 reference.

Skipped without CUDA.  "Bitwise" means ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton MoE of issue #7)")]

if torch.cuda.is_available():
    from megatron_consistent.kernels.triton import moe as tmoe

from _cuda_graphs import capture
from megatron_consistent.kernels import linear
from megatron_consistent.kernels import moe as kmoe
from megatron_consistent.kernels.dispatch import implementation
from megatron_consistent.verify.moe_reference import moe_experts_f64

DEV = torch.device("cuda")


def _weights(E, H, I, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.05: (torch.randn(*s, generator=g) * std).to(dtype).to(DEV)  # noqa: E731
    return r(E, H, std=0.1), r(E, 2 * I, H), r(E, H, I), (r(2 * I, H), r(H, I), r(1, H))


@pytest.mark.parametrize("bm", [16, 32, 64, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_equals_triton_linear_per_expert(dtype, bm, monkeypatch):
    """Every row tile of the grouped GEMM (BM 16 / 32 on mma.sync, 64 / the config's 128 on wgmma; forced here, chosen
    by rows per expert in use) gives the Triton linear's bits, per expert and for a row alone."""
    monkeypatch.setattr(tmoe, "GROUPED_ROW_TILES", () if bm is None else ((1e9, bm, 4),))
    E, N, K = 6, 384, 320
    counts = torch.tensor([3, 0, 300, 1, 129, 17], device=DEV)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(E, N, K, generator=g) * 0.05).to(dtype).to(DEV)
    y = tmoe.grouped_gemm(x, w, counts)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            assert torch.equal(y[r0 : r0 + c], linear(x[r0 : r0 + c], w[e])), f"expert {e}"
            assert torch.equal(y[r0 : r0 + 1], linear(x[r0 : r0 + 1], w[e])), f"expert {e}, its first row alone"
        r0 += c


@pytest.mark.parametrize("bm", [16, 64, None])
def test_grouped_gemm_gather_and_scatter_keep_the_bits(bm, monkeypatch):
    """The fused gather (operand rows read from the tokens) and scatter (results written in (token, slot) order) give
    the bits of the plain grouped GEMM on explicitly gathered rows, put back by the same permutation."""
    monkeypatch.setattr(tmoe, "GROUPED_ROW_TILES", () if bm is None else ((1e9, bm, 4),))
    t, k, e_count, h, n = 150, 4, 12, 320, 384
    g = torch.Generator().manual_seed(9)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)]).to(DEV)
    hidden = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(e_count, n, h, generator=g) * 0.05).to(torch.bfloat16).to(DEV)
    pair_of_row, counts = tmoe.expert_sort(experts, e_count)
    assert torch.equal(pair_of_row, torch.sort(experts.reshape(-1), stable=True).indices)
    plain = tmoe.grouped_gemm(hidden[pair_of_row // k], w, counts)
    by_pair = torch.empty_like(plain)
    by_pair[pair_of_row] = plain
    assert torch.equal(tmoe.grouped_gemm(hidden, w, counts, pair_of_row=pair_of_row, gather=True, slots=k), plain)
    assert torch.equal(tmoe.grouped_gemm(hidden[pair_of_row // k], w,
                                         counts, pair_of_row=pair_of_row, scatter=True, slots=k), by_pair)


@pytest.mark.parametrize("e, top_k", [(128, 8), (60, 4), (8, 1)])
@pytest.mark.parametrize("scoring, norm, with_bias", [("softmax", True, False), ("softmax", False, False),
                                                      ("sigmoid", True, True)])
def test_router_kernel_equals_the_cpu_route(e, top_k, scoring, norm, with_bias):
    """The one-launch Triton router (``moe_select_experts``) gives the CPU route's bits on the same float32 logits,
    also with exact ties and NaN / infinite logits."""
    g = torch.Generator().manual_seed(e + top_k)
    z = torch.randn(512, e, generator=g) * 3
    z[:64] = torch.round(z[:64])  # many exact ties
    z[64, 3], z[65, 1], z[66, :] = float("nan"), float("inf"), -float("inf")
    bias = torch.randn(e, generator=g) * 0.01 if with_bias else None
    w, ex = implementation("moe_select_experts", DEV)(z.to(DEV), top_k, scoring, None if bias is None else bias.to(DEV),
                                                      norm, 1, 1, 1.0)
    wc, ec = kmoe.select_experts(z, top_k, scoring, bias, norm, 1, 1, 1.0)
    assert torch.equal(ex.cpu(), ec)
    nan = wc.isnan()  # NaN payloads differ between devices (x86: 0xffc00000); their positions may not
    assert torch.equal(w.cpu().isnan(), nan)
    assert torch.equal(w.cpu()[~nan].view(torch.int32), wc[~nan].view(torch.int32))


@pytest.mark.parametrize("scoring, norm, top_k, shared", [("softmax", True, 2, True), ("sigmoid", True, 4, False),
                                                           ("softmax", False, 8, False)])
def test_token_alone_equals_token_in_batch(scoring, norm, top_k, shared):
    E, H, I, T = 16, 256, 96, 300
    router, fc1, fc2, sh = _weights(E, H, I)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    bias = torch.linspace(-0.01, 0.01, E, device=DEV) if scoring == "sigmoid" else None
    sh = sh if shared else None

    def run(xb):
        w, e = kmoe.route(xb, router, top_k, scoring, bias=bias, norm_topk_prob=norm)
        return w, e, kmoe.moe_experts(xb, e, w, fc1, fc2, sh)

    w, e, y = run(x)
    assert y.is_cuda and y.dtype == torch.bfloat16 and e.dtype == torch.int64
    for t in [0, 1, 150, 299]:
        w1, e1, y1 = run(x[t : t + 1])
        assert torch.equal(e1, e[t : t + 1]) and torch.equal(w1, w[t : t + 1]) and torch.equal(y1, y[t : t + 1]), t
    for sl in [slice(0, 7), slice(64, 128), slice(17, 300)]:
        assert torch.equal(run(x[sl])[2], y[sl]), sl
    perm = torch.randperm(T, device=DEV)
    assert torch.equal(run(x[perm])[2], y[perm])
    # same routes and weights as the CPU route on the same float32 logits (per-row torch ops, fixed order)
    z = kmoe.router_logits(x, router)
    wc, ec = kmoe.route_logits(z.cpu(), top_k, scoring, None if bias is None else bias.cpu(), norm)
    assert torch.equal(ec.to(DEV), e) and torch.equal(wc.to(DEV), w)


@pytest.mark.parametrize("shared, gate", [(False, False), (True, False), (True, True)])
def test_combine_kernel_equals_torch_combine(shared, gate):
    """The Triton combine is bitwise the CPU combine's torch ops (run here on the GPU): no fused multiply-add."""
    g = torch.Generator().manual_seed(4)
    t, k, h = 300, 8, 1000
    y = torch.randn(t, k, h, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    sh = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV) if shared else None
    gt = torch.rand(t, 1, generator=g).to(DEV) if gate else None
    out = implementation("moe_combine", DEV)(y, w, sh, gt)
    assert torch.equal(out, kmoe._combine_cpu(y, w, sh, gt))
    assert torch.equal(implementation("moe_combine", DEV)(y[5:6], w[5:6], None if sh is None else sh[5:6],
                                                          None if gt is None else gt[5:6]), out[5:6])


def test_exact_ties_pick_lowest_index_on_cuda():
    E, H = 8, 128
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    w, e = kmoe.route(x, torch.zeros(E, H, dtype=torch.bfloat16, device=DEV), 3)
    assert torch.equal(e.cpu(), torch.tensor([[0, 1, 2]] * 5))
    router = torch.zeros(E, H, dtype=torch.bfloat16, device=DEV)
    router[[3, 5, 6]] = x[0].sign() * 0.5
    w, e = kmoe.route(x[:1], router, 3)
    assert torch.equal(e.cpu(), torch.tensor([[3, 5, 6]])) and w[0, 0] == w[0, 1] == w[0, 2]
    router[5] = 0
    router[7] = router[3]
    w, e = kmoe.route(x[:1], router, 2)
    assert torch.equal(e.cpu(), torch.tensor([[3, 6]]))
    w, e = kmoe.route(x[:2], torch.zeros(E, H, dtype=torch.bfloat16, device=DEV), 2, "sigmoid", n_group=4, topk_group=1)
    assert torch.equal(e.cpu(), torch.tensor([[0, 1], [0, 1]]))


# float32 kernels vs float64: every op is a float32 reduction over <= 256 terms (error ~ log2(K) u ~ 5e-7 for
# the fixed-order sums, K u ~ 2e-5 worst case for a sequential chain), ~6 ops deep; 1e-4 relative Frobenius
# error leaves headroom while a wrong Jacobian / slot / expert gives >= 1e-2 (as tests/test_moe_reference.py).
GRAD_REL_TOL = 1e-4


@pytest.mark.parametrize("norm, top_k, shared", [(True, 2, True), (False, 4, False)])
def test_gradients_vs_float64(norm, top_k, shared):
    E, H, I, T = 16, 256, 64, 40
    g = torch.Generator().manual_seed(5)
    leaves = {"x": torch.randn(T, H, generator=g), "router": torch.randn(E, H, generator=g) * 0.1,
              "fc1": torch.randn(E, 2 * I, H, generator=g) * 0.05, "fc2": torch.randn(E, H, I, generator=g) * 0.05,
              "s_fc1": torch.randn(2 * I, H, generator=g) * 0.05, "s_fc2": torch.randn(H, I, generator=g) * 0.05,
              "s_gate": torch.randn(1, H, generator=g) * 0.1}
    upstream = torch.randn(T, H, generator=g)
    ours = {k: v.to(DEV).requires_grad_(True) for k, v in leaves.items()}
    ref = {k: v.double().requires_grad_(True) for k, v in leaves.items()}
    w, experts = kmoe.route(ours["x"], ours["router"], top_k, "softmax", norm_topk_prob=norm)
    sh = (ours["s_fc1"], ours["s_fc2"], ours["s_gate"]) if shared else None
    y = kmoe.moe_experts(ours["x"], experts, w, ours["fc1"], ours["fc2"], sh)
    (y * upstream.to(DEV)).sum().backward()
    rsh = (ref["s_fc1"], ref["s_fc2"], ref["s_gate"]) if shared else None
    y_ref = moe_experts_f64(ref["x"], ref["router"], ref["fc1"], ref["fc2"], rsh, experts.cpu(), "softmax", norm)
    (y_ref * upstream.double()).sum().backward()
    assert (y.cpu().double() - y_ref).norm() / y_ref.norm() <= GRAD_REL_TOL
    for k in ["x", "router", "fc1", "fc2"] + (["s_fc1", "s_fc2", "s_gate"] if shared else []):
        err = (ours[k].grad.cpu().double() - ref[k].grad).norm() / ref[k].grad.norm()
        assert err <= GRAD_REL_TOL, f"{k}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("top_k", [1, 2])
def test_engine_moe_ops_replay_as_a_cuda_graph(top_k):
    """The engine's MoE ops (router logits, route, grouped experts + shared expert + combine) read nothing on the
    host: captured once in a CUDA graph (a host read would fail the capture), replayed on new tokens, they give the
    bits of the eager ops on those tokens."""
    from megatron_consistent.kernels import inference_ops

    E, H, inter, T = 8, 128, 64, 48
    router, fc1, fc2, (s1, s2, sg) = _weights(E, H, inter, seed=3)

    def block(x):
        w, e = inference_ops.moe_route(inference_ops.router_logits(x, router), top_k, "softmax", None, True, 1, 1, 1.0)
        return inference_ops.moe_experts(x, e, w, fc1, fc2, s1, s2, sg, "swiglu")

    g = torch.Generator().manual_seed(4)
    static_x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV)
    graph, static_out = capture(block, static_x)
    for seed in (5, 6):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, block(x))
