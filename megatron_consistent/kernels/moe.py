"""Mixture-of-experts: router, top-k with a fixed tie-break, expert MLPs and the weighted combine.

Numerics contract (CPU), per token — nothing depends on the other tokens of the call:

* **router logits** ``z = linear(hidden, W_router, out_dtype=float32)`` — the
  batch-invariant linear's float32 accumulator, never rounded to the model dtype;
* **scores** ``softmax``: ``m = max(z)``, ``e = exp(z - m)`` (:func:`numerics.exp`),
  ``s = e / tree_sum(e)``; ``sigmoid``: ``s = 1 / (1 + exp(-z))``;
* **selection** key ``c = s + bias`` (``bias``: DeepSeek-style selection bias,
  float32, absent = 0); optional group limit (``n_group`` groups of experts, a
  group's score is the sum of its two best keys, ``topk_group`` best groups
  kept, the others' keys set to -inf);
* **top-k**: experts ordered by descending key with a *stable* sort, so among
  exactly equal keys the **lowest expert index wins**; slot ``j`` holds the
  ``j``-th best expert.  (``torch.topk``'s tie behaviour is not documented and
  is not used.)  NaN router scores are refused (the trainer's route; a rollout
  engine's :func:`select_experts` reads nothing on the host and does not refuse);
* **weights** ``w_j = s[e_j]`` (unbiased scores); ``norm_topk_prob``:
  ``w_j = w_j / tree_sum(w)``; then ``* routed_scaling_factor`` when != 1;
  all float32;
* **experts**: every (token, slot) pair runs
  ``linear(silu_and_mul(linear(x, W_gate_up[e])), W_down[e])`` in the model
  dtype (``activation="relu2"``: the non-gated Nemotron-H expert
  ``linear(relu_squared(linear(x, W_up[e])), W_down[e])``, ``W_up [E, I, H]``).
  Pairs are grouped by expert (ascending) into one call per expert;
  the linear is row-invariant, so an expert's result for a token does not
  depend on which other tokens share that expert;
* **experts over tensor-parallel ranks** (:func:`owned_expert_outputs`): a rank
  holding a run of the experts computes the pairs routed to them by the same
  expert calls and ``+0.0`` for the others; the ranks' ``[T, k, H]`` results,
  summed, are the one-rank outputs (one value and zeros per element);
* **combine**: ``acc = 0``; for ``j = 0..k-1``: ``acc = acc + w_j * float32(y_j)``;
  then, with a shared expert, ``acc = acc + g * float32(y_shared)`` where ``g`` is
  its sigmoid gate (float32, as above) or 1; the result is rounded once to
  the model dtype.

Backward (training only, need not be batch-invariant): router weights via the
closed-form softmax / sigmoid Jacobian in float32 (the selection itself is
piecewise constant and gets no gradient; the selection bias gets none);
expert weights and inputs through the linear / silu_and_mul backward; the
combine by its closed form.  Auxiliary load-balancing losses
(:func:`load_balancing_loss`) are computed from the router scores on the side
and never change forward values.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .linear import linear
from .numerics import exp, tree_sum
from .relu_squared import relu_squared
from .silu_and_mul import silu_and_mul

EXPERT_ACTIVATIONS = ("swiglu", "relu2")

SCORINGS = ("softmax", "sigmoid")


# ---------------------------------------------------------------------------------------------- scores / top-k
def _scores(z: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        e = exp(z - z.amax(-1, keepdim=True))
        return e / tree_sum(e)[..., None]
    if scoring == "sigmoid":
        return 1.0 / (1.0 + exp(-z))
    raise ValueError(f"unsupported router scoring {scoring!r}; supported: {', '.join(SCORINGS)}")


def stable_topk(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest keys per row, best first; exact ties: lowest index first."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[..., :k]


def _group_limit(keys: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    t, e = keys.shape
    if e % n_group:
        raise ValueError(f"num_experts {e} not divisible by n_group {n_group}")
    grouped = keys.reshape(t, n_group, e // n_group)
    best2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
    group_score = best2[..., 0] + best2[..., 1] if best2.shape[-1] == 2 else best2[..., 0]
    keep = stable_topk(group_score, topk_group)
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=keys.device).scatter_(1, keep, True)
    return torch.where(mask[..., None], grouped, torch.full_like(grouped, -torch.inf)).reshape(t, e)


@register("moe_route", "cpu")
def _route_cpu(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
    """:func:`select_experts`, refusing NaN router scores (a host read of the NaN test)."""
    return select_experts(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling, refuse_nan=True)


@register("moe_select_experts", "cpu")
def select_experts(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling, refuse_nan: bool = False):
    """(weights ``[T, k]`` float32, experts ``[T, k]`` int64) by the contract above.  ``refuse_nan=False``: device ops
    only, no host read and no data-dependent shape, so a CUDA-graph replay runs it as captured; a NaN score then sorts
    deterministically (PyTorch orders NaN above every number) and still yields valid expert indices.  The rollout
    engine's route is the device's ``moe_select_experts`` (this function on CPU; CUDA: one Triton kernel, the same
    bits)."""
    s = _scores(z, scoring)
    keys = s if bias is None else s + bias.to(torch.float32)
    if refuse_nan and torch.isnan(keys).any():
        raise ValueError("router scores contain NaN")
    if n_group > 1:
        keys = _group_limit(keys, n_group, topk_group)
    experts = stable_topk(keys, top_k)
    w = s.gather(-1, experts)
    if norm_topk_prob:
        w = w / tree_sum(w)[..., None]
    if scaling != 1.0:
        w = w * scaling
    return w, experts


class RouteWeightsFunction(torch.autograd.Function):
    """float32 logits ``[T, E]`` -> (weights ``[T, k]`` float32, experts ``[T, k]`` int64)."""

    @staticmethod
    def forward(ctx, z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
        w, experts = implementation("moe_route", z.device)(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling)
        ctx.save_for_backward(z, experts)
        ctx.opts = (scoring, norm_topk_prob, scaling)
        ctx.mark_non_differentiable(experts)
        return w, experts

    @staticmethod
    def backward(ctx, grad_w, _grad_experts):
        z, experts = ctx.saved_tensors
        scoring, norm, scaling = ctx.opts
        zf = z.to(torch.float32)
        s = torch.softmax(zf, -1) if scoring == "softmax" else torch.sigmoid(zf)
        g = grad_w.to(torch.float32) * scaling
        sel = s.gather(-1, experts)
        if norm:
            total = sel.sum(-1, keepdim=True)
            wn = sel / total
            g = (g - (g * wn).sum(-1, keepdim=True)) / total
        gs = torch.zeros_like(s).scatter_add_(-1, experts, g)  # dL/ds
        if scoring == "softmax":
            gz = s * (gs - (gs * s).sum(-1, keepdim=True))
        else:
            gz = gs * s * (1.0 - s)
        return gz.to(z.dtype), None, None, None, None, None, None, None


def router_logits(hidden: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """float32 router logits ``[T, E]`` by the batch-invariant linear (float32 accumulator kept)."""
    return linear(hidden, router_weight, out_dtype=torch.float32)


def route_logits(z: torch.Tensor, top_k: int, scoring: str = "softmax", bias: torch.Tensor | None = None,
                 norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route from float32 logits ``[T, E]``: (weights float32 ``[T, k]``, experts int64 ``[T, k]``)."""
    if z.dtype != torch.float32:
        raise ValueError(f"route: router logits must be float32, got {z.dtype}")
    if scoring not in SCORINGS:
        raise ValueError(f"unsupported router scoring {scoring!r}; supported: {', '.join(SCORINGS)}")
    if not 1 <= top_k <= z.shape[-1]:
        raise ValueError(f"route: top_k={top_k} must be in [1, num_experts={z.shape[-1]}]")
    return RouteWeightsFunction.apply(z, int(top_k), scoring, bias, bool(norm_topk_prob), int(n_group), int(topk_group),
                                      float(routed_scaling_factor))


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, scoring: str = "softmax",
          bias: torch.Tensor | None = None, norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of ``hidden [T, H]``: (weights float32 ``[T, k]``, experts int64 ``[T, k]``), contract above."""
    return route_logits(router_logits(hidden, router_weight), top_k, scoring, bias, norm_topk_prob, n_group, topk_group,
                        routed_scaling_factor)


# ---------------------------------------------------------------------------------------------- experts / combine
@register("moe_combine", "cpu")
def _combine_cpu(y, w, shared, gate):
    acc = torch.zeros(y.shape[0], y.shape[-1], dtype=torch.float32, device=y.device)
    for j in range(y.shape[1]):
        acc = acc + w[:, j : j + 1] * y[:, j].to(torch.float32)
    if shared is not None:
        acc = acc + (shared.to(torch.float32) if gate is None else gate * shared.to(torch.float32))
    return acc.to(y.dtype)


class CombineFunction(torch.autograd.Function):
    """``round(sum_j w_j * float32(y_j) [+ g * float32(y_shared)])`` in fixed slot order (the device's
    ``moe_combine``; CUDA: one Triton kernel, the same two roundings per slot — no fused multiply-add)."""

    @staticmethod
    def forward(ctx, y, w, shared, gate):
        ctx.save_for_backward(y, w, shared, gate)
        return implementation("moe_combine", y.device)(y, w, shared, gate)

    @staticmethod
    def backward(ctx, g):
        y, w, shared, gate = ctx.saved_tensors
        gf = g.to(torch.float32)
        gy = (gf[:, None, :] * w[..., None]).to(y.dtype)
        gw = (gf[:, None, :] * y.to(torch.float32)).sum(-1)
        gshared = ggate = None
        if shared is not None:
            gshared = (gf if gate is None else gf * gate).to(shared.dtype)
            if gate is not None:
                ggate = (gf * shared.to(torch.float32)).sum(-1, keepdim=True)
        return gy, gw, gshared, ggate


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """One SwiGLU expert: ``linear(silu_and_mul(linear(x, W_gate_up)), W_down)`` (gate rows first);
    ``activation="relu2"``: the non-gated ``linear(relu_squared(linear(x, W_up)), W_down)``."""
    if activation == "relu2":
        return linear(relu_squared(linear(x, w_gate_up)), w_down)
    if activation != "swiglu":
        raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(EXPERT_ACTIVATIONS)}")
    return linear(silu_and_mul(linear(x, w_gate_up)), w_down)


def expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   activation: str = "swiglu") -> torch.Tensor:
    """``[T, k, H]``: every (token, slot) pair through its expert — the device's ``moe_expert_outputs`` (CUDA: one
    grouped Triton GEMM over all experts with the Triton linear's per-row arithmetic, :mod:`.triton.moe`).  A pair
    whose expert is ``-1`` is not computed: its output row is unspecified (zeros on the CPU, left unwritten on CUDA),
    for a caller that masks it (:func:`owned_expert_outputs`); the other pairs' rows are the same bits either way."""
    return implementation("moe_expert_outputs", hidden.device)(hidden, experts, w_gate_up, w_down, activation)


@register("moe_expert_outputs", "cpu")
def _expert_outputs_cpu(hidden: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        activation: str = "swiglu") -> torch.Tensor:
    """One :func:`expert_mlp` call per expert (ascending index) on the pairs routed to it."""
    return per_expert_outputs(hidden, experts, w_down.shape[1],
                              lambda e, x: expert_mlp(x, w_gate_up[e], w_down[e], activation))


def per_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, out_features: int, expert_fn) -> torch.Tensor:
    """``[T, k, out_features]``: ``expert_fn(e, rows)`` once per routed expert ``e`` (ascending index) on the hidden
    rows of the (token, slot) pairs routed to it (pair order), scattered back to (token, slot) order; zeros when
    no pair is routed, and for the pairs of expert -1 (not computed)."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    token_of_pair = torch.arange(t * k, device=hidden.device) // k
    pieces, order = [], []
    for e in torch.unique(flat).tolist():  # sorted ascending
        pairs = (flat == e).nonzero()[:, 0]
        pieces.append(expert_fn(e, hidden[token_of_pair[pairs]]) if e >= 0 else hidden.new_zeros(len(pairs), out_features))
        order.append(pairs)
    if not pieces:
        return hidden.new_zeros(t, k, out_features)
    inverse = torch.empty(t * k, dtype=torch.int64, device=hidden.device)
    inverse[torch.cat(order)] = torch.arange(t * k, device=hidden.device)
    return torch.cat(pieces)[inverse].reshape(t, k, -1)


def owned_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, first: int, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, activation: str = "swiglu", fixed_shapes: bool = False) -> torch.Tensor:
    """``[T, k, H]``: the (token, slot) pairs routed to the experts ``[first, first + E_local)`` held in ``w_gate_up
    [E_local, ...]`` / ``w_down [E_local, H, I]`` (a TP rank's run of the experts), each through its expert by
    :func:`expert_outputs`; ``+0.0`` for every other pair (:func:`owned_pair_outputs`)."""
    return owned_pair_outputs(hidden, experts, first, w_gate_up.shape[0], w_down.shape[1],
                              lambda h, local: expert_outputs(h, local, w_gate_up, w_down, activation), fixed_shapes)


def owned_pair_outputs(hidden: torch.Tensor, experts: torch.Tensor, first: int, n_local: int, out_features: int,
                       outputs, fixed_shapes: bool = False) -> torch.Tensor:
    """``[T, k, out_features]``: the (token, slot) pairs routed to the experts ``[first, first + n_local)`` through
    ``outputs(hidden_rows [n, H], local_experts [n, k]) -> [n, k, out_features]`` (an expert computation of the
    :func:`expert_outputs` contract over the rank's experts -- model-dtype or block-FP8 -- that leaves the pairs of
    expert ``-1`` uncomputed); ``+0.0`` for every other pair.

    Numerics: the expert linear is row-invariant, so an owned pair's values are the bits ``outputs`` gives it with
    every expert held, whatever else the call computes.  Over the ranks holding the runs of all experts, each pair is
    non-zero on one rank at most, so the ranks' results summed in any order are the TP = 1 outputs (a ``-0.0`` may
    come back ``+0.0``, which :func:`combine_experts` cannot tell apart: ``w * y`` is added to an accumulator started
    at ``+0.0``).

    ``fixed_shapes=False``: only the owned pairs are computed (found by ``nonzero``: a host read, a shape that
    depends on the routes).  ``True`` (a rollout engine's CUDA graphs): another rank's pairs go to ``outputs`` as
    expert ``-1`` (not computed: no sorted row, no GEMM tile -- the expert work of the owned pairs only, in launches
    of fixed shapes), and a select keeps the owned pairs' values (``+0.0`` elsewhere, whatever the unspecified rows
    hold) — no host read; the same bits."""
    local = experts - first
    mine = (local >= 0) & (local < n_local)
    if fixed_shapes:
        y = outputs(hidden, torch.where(mine, local, torch.full_like(local, -1)))
        return torch.where(mine[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    token, slot = mine.nonzero(as_tuple=True)
    y = hidden.new_zeros(*experts.shape, out_features)
    if token.numel() == 0:
        return y
    pairs = outputs(hidden[token], local[token, slot][:, None])
    return y.index_put((token, slot), pairs[:, 0])


def shared_expert_gate(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """float32 ``sigmoid(linear(hidden, W_gate [1, H]))`` ``[T, 1]`` (deterministic exp)."""
    z = linear(hidden, gate_weight, out_dtype=torch.float32)
    return _SigmoidFunction.apply(z)


class _SigmoidFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        s = 1.0 / (1.0 + exp(-z))
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * s * (1.0 - s)


def moe_experts(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, shared: tuple | None = None, activation: str = "swiglu") -> torch.Tensor:
    """Routed experts plus optional shared expert, combined once: ``[T, H]`` in ``hidden.dtype``.

    ``w_gate_up [E, 2I, H]`` (gate rows first), ``w_down [E, H, I]``; ``shared`` =
    ``(W_gate_up [2Is, H], W_down [H, Is], W_gate [1, H] or None)``; ``activation="relu2"``: non-gated
    experts, ``W_up [E, I, H]`` / shared ``W_up [Is, H]`` in place of the gate+up weights.
    """
    if hidden.dim() != 2:
        raise ValueError(f"moe_experts: hidden must be [T, H], got {tuple(hidden.shape)}")
    return combine_experts(hidden, expert_outputs(hidden, experts, w_gate_up, w_down, activation), weights, shared,
                           activation)


def combine_experts(hidden: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared: tuple | None = None,
                    activation: str = "swiglu") -> torch.Tensor:
    """:func:`moe_experts`' combine of the routed experts' outputs ``y [T, k, H]`` (:func:`expert_outputs`'s, or the
    same values gathered from the ranks that hold the experts) with weights ``[T, k]`` float32, plus the optional
    shared expert of ``hidden``: ``[T, H]`` in ``hidden.dtype``."""
    if weights.dtype != torch.float32:
        raise ValueError(f"moe_experts: weights must be float32, got {weights.dtype}")
    ys = gate = None
    if shared is not None:
        s_gu, s_down, s_gate = shared
        ys = expert_mlp(hidden, s_gu, s_down, activation)
        gate = None if s_gate is None else shared_expert_gate(hidden, s_gate)
    return CombineFunction.apply(y, weights, ys, gate)


def load_balancing_loss(router_z: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss ``E * sum_e f_e * P_e`` (training only; never feeds the forward)."""
    probs = torch.softmax(router_z.to(torch.float32), -1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_z.device).scatter_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.float32, device=router_z.device))
    f = counts / experts.numel()
    return num_experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """Thin module: router + experts (+ shared expert) on ``[T, H]``; records the last routes in ``last_experts``."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = False, shared_intermediate_size: int = 0, shared_gate: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.top_k, self.scoring, self.norm_topk_prob = top_k, scoring, norm_topk_prob
        self.router = nn.Parameter(torch.randn(num_experts, hidden_size, dtype=torch.float32).mul_(0.02).to(dtype))
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, 2 * intermediate_size, hidden_size).mul_(0.02).to(dtype))
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size).mul_(0.02).to(dtype))
        self.shared = None
        if shared_intermediate_size:
            self.s_gate_up = nn.Parameter(torch.randn(2 * shared_intermediate_size, hidden_size).mul_(0.02).to(dtype))
            self.s_down = nn.Parameter(torch.randn(hidden_size, shared_intermediate_size).mul_(0.02).to(dtype))
            self.s_gate = nn.Parameter(torch.randn(1, hidden_size).mul_(0.02).to(dtype)) if shared_gate else None
        self.last_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, e = route(x, self.router, self.top_k, self.scoring, norm_topk_prob=self.norm_topk_prob)
        self.last_experts = e
        shared = (self.s_gate_up, self.s_down, self.s_gate) if hasattr(self, "s_gate_up") else None
        return moe_experts(x, e, w, self.w_gate_up, self.w_down, shared)
