"""MoE kernel gradients against a plain float64 torch reference (tolerance checks).

The routes (which experts) are piecewise constant and are taken from the kernel's
forward; the reference recomputes everything else in float64: router softmax /
sigmoid, the selected weights (optionally renormalised), SwiGLU experts, the
sigmoid-gated shared expert, and the weighted sum.  Inputs are float32 so the
only differences are float32 rounding in the kernels.
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.kernels import moe as kmoe
from megatron_consistent.verify.moe_reference import moe_experts_f64

# Relative Frobenius error of each float32 gradient vs float64: the chain is ~6 float32 ops, each a reduction over
# <= 128 terms (blocked / tree sums, error ~ log2(K) * u with u = 6e-8, i.e. ~4e-7 per op), so ~1e-6 expected;
# 1e-4 leaves ample headroom while a wrong Jacobian (missing renormalisation term, wrong slot) gives >= 1e-2.
GRAD_REL_TOL = 1e-4


@pytest.mark.parametrize("scoring, norm, top_k, shared", [("softmax", False, 1, False), ("softmax", True, 2, True),
                                                           ("softmax", False, 8, True), ("sigmoid", True, 3, False)])
def test_gradients_vs_float64(scoring, norm, top_k, shared):
    E, H, I, T = 16, 128, 32, 11
    g = torch.Generator().manual_seed(5)
    leaves = {
        "x": torch.randn(T, H, generator=g),
        "router": torch.randn(E, H, generator=g) * 0.1,
        "fc1": torch.randn(E, 2 * I, H, generator=g) * 0.05,
        "fc2": torch.randn(E, H, I, generator=g) * 0.05,
        "s_fc1": torch.randn(2 * I, H, generator=g) * 0.05,
        "s_fc2": torch.randn(H, I, generator=g) * 0.05,
        "s_gate": torch.randn(1, H, generator=g) * 0.1,
    }
    upstream = torch.randn(T, H, generator=g)
    ours = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
    ref = {k: v.double().requires_grad_(True) for k, v in leaves.items()}
    w, experts = kmoe.route(ours["x"], ours["router"], top_k, scoring, norm_topk_prob=norm)
    sh = (ours["s_fc1"], ours["s_fc2"], ours["s_gate"]) if shared else None
    y = kmoe.moe_experts(ours["x"], experts, w, ours["fc1"], ours["fc2"], sh)
    (y * upstream).sum().backward()
    rsh = (ref["s_fc1"], ref["s_fc2"], ref["s_gate"]) if shared else None
    y_ref = moe_experts_f64(ref["x"], ref["router"], ref["fc1"], ref["fc2"], rsh, experts, scoring, norm)
    (y_ref * upstream.double()).sum().backward()
    assert (y.double() - y_ref).norm() / y_ref.norm() <= GRAD_REL_TOL
    names = ["x", "router", "fc1", "fc2"] + (["s_fc1", "s_fc2", "s_gate"] if shared else [])
    for k in names:
        err = (ours[k].grad.double() - ref[k].grad).norm() / ref[k].grad.norm()
        assert err <= GRAD_REL_TOL, f"{k}: relative gradient error {err:.2e}"


def test_load_balancing_loss_gradient_reaches_router_only_through_scores():
    z = torch.randn(7, 8, generator=torch.Generator().manual_seed(6), requires_grad=True)
    experts = torch.topk(z.detach(), 2).indices
    loss = kmoe.load_balancing_loss(z, experts, 8)
    loss.backward()
    p = torch.softmax(z.detach().double(), -1)
    f = torch.bincount(experts.reshape(-1), minlength=8).double() / experts.numel()
    assert abs(loss.item() - 8 * (f * p.mean(0)).sum().item()) <= 1e-6  # float32 sum of 8 terms of size ~0.1
    assert z.grad is not None and torch.isfinite(z.grad).all()
