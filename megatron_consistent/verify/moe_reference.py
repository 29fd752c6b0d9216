"""Float64 plain-torch MoE block on HF-named weights (Qwen3-MoE / Qwen2-MoE / Mixtral), for the reference checks.

Softmax router over all experts, ``torch.topk`` selection (the reference does
not need a tie rule: its inputs have no ties), optional renormalisation of the
selected weights, SwiGLU experts, Qwen2-MoE's sigmoid-gated shared expert.
:func:`moe_experts_f64` is the same block on kernel-layout tensors with the routes given, for gradient checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..architectures import hf_names


def moe_mlp_f64(w: dict[str, torch.Tensor], arch, layer: int, h: torch.Tensor) -> torch.Tensor:
    """MoE MLP output of ``h [..., H]`` (float64) for MoE layer ``layer`` of ``arch``, weights ``w`` by HF name."""
    names = hf_names(arch)
    m = f"decoder.layers.{layer}.mlp."
    fc1, fc2 = names[m + "experts.linear_fc1.weight"], names[m + "experts.linear_fc2.weight"]
    x = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(x @ w[names[m + "router.weight"][0]].T, dim=-1)
    top_w, top_e = torch.topk(probs, arch.num_experts_per_tok, dim=-1)
    if arch.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(arch.num_experts):
        rows, slot = (top_e == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = x[rows]
        ye = (F.silu(xe @ w[fc1[2 * e]].T) * (xe @ w[fc1[2 * e + 1]].T)) @ w[fc2[e]].T
        out = out.index_add(0, rows, ye * top_w[rows, slot, None])
    if arch.shared_expert_intermediate_size:
        (s_gate, s_up), (s_down,) = names[m + "shared_experts.linear_fc1.weight"], names[m + "shared_experts.linear_fc2.weight"]
        ys = (F.silu(x @ w[s_gate].T) * (x @ w[s_up].T)) @ w[s_down].T
        out = out + torch.sigmoid(x @ w[names[m + "shared_experts.gate_weight"][0]].T) * ys
    return out.reshape(h.shape)


def moe_experts_f64(x, router, fc1, fc2, shared, experts, scoring: str = "softmax", norm: bool = False) -> torch.Tensor:
    """MoE output of ``x [T, H]`` for given routes ``experts [T, k]`` on kernel-layout weights (``router [E, H]``,
    ``fc1 [E, 2I, H]`` gate rows then up rows, ``fc2 [E, H, I]``, ``shared = (s_fc1, s_fc2, s_gate)`` or None), in
    the dtype of the inputs (float64 for the gradient checks): softmax / sigmoid scores, the selected weights
    (optionally renormalised), SwiGLU experts, the sigmoid-gated shared expert, the weighted sum."""
    z = x @ router.T
    s = torch.softmax(z, -1) if scoring == "softmax" else torch.sigmoid(z)
    w = s.gather(-1, experts)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    inter = fc1.shape[1] // 2
    out = torch.zeros_like(x)
    for j in range(experts.shape[1]):
        e = experts[:, j]
        gate = torch.einsum("th,tih->ti", x, fc1[e, :inter])
        up = torch.einsum("th,tih->ti", x, fc1[e, inter:])
        out = out + w[:, j : j + 1] * torch.einsum("ti,thi->th", F.silu(gate) * up, fc2[e])
    if shared is not None:
        s_fc1, s_fc2, s_gate = shared
        n = s_fc1.shape[0] // 2
        ys = (F.silu(x @ s_fc1[:n].T) * (x @ s_fc1[n:].T)) @ s_fc2.T
        out = out + torch.sigmoid(x @ s_gate.T) * ys
    return out
