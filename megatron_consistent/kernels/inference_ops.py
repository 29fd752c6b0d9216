"""The inference forwards of the consistent ops as opaque torch custom ops.

An engine that compiles its model with ``torch.compile`` and replays it as CUDA
graphs must not trace into an op's launcher (Python that picks tiles, caches
workspaces, builds TMA descriptors): Dynamo would specialise on it or break the
graph.  Here each forward registered in :mod:`dispatch` is wrapped once as a
``torch.library`` custom op in the ``megatron_consistent`` namespace with a
shape-only fake implementation, so a compiler sees one opaque node per op and
runs exactly the registered forward at run time.

Numerics contract: an op here returns the bits of the registered forward for
the tensor's device — the same function the ``autograd.Function`` of each op
calls in training (``tests/test_inference_ops.py`` checks ``torch.equal``).
There is no backward: these are for rollout engines only.

Ops (``torch.ops.megatron_consistent.<name>``):

* ``linear(x, weight, bias)``: ``x [..., K]`` -> ``[..., N]`` in ``x.dtype``;
* ``row_parallel_linear(x, weight, segments, bias)``: the tree of ``segments`` (the model's S) K segments of
  :func:`..linear.row_parallel_linear` on one rank, in ``x.dtype``;
* ``linear_segment_tree(x, weight, segments)``: a rank's float32 subtree over
  ``segments`` K segments (``adjacent_tree_sum`` of ``linear_segments``), to
  be all-gathered and reduced by the top of the tree under tensor parallelism;
  both run the registered ``linear_segment_tree`` forward (one Triton launch on
  CUDA, the tree and the bias fused; bit-equal to the unfused definition);
* ``rms_norm(x, weight, eps)``: RMSNorm over the last dim (no residual);
* ``add_rms_norm(x, residual, weight, eps)``: ``(rms_norm(h), h)`` with ``h = add_residual(x, residual)``, one
  pass on CUDA (the bits of the unfused pair);
* ``rope(x, cos, sin, style)``: ``x [T, heads, head_dim]`` rotated by the
  float32 tables already gathered at each token's position, ``cos/sin [T, rot/2]``
  (``style``: ``kernels.rotary.ROPE_STYLES``);
* ``silu_and_mul(x)``: ``silu(x[..., :I]) * x[..., I:]``;
* ``relu_squared(x)``, ``mamba_dt(dt_raw, dt_bias, dt_min, dt_max)``, ``gated_rms_norm(y, z, weight, group_size,
  eps)``: the Nemotron-H / Mamba-2 elementwise and norm ops (their CUDA forwards are torch code: wrapped so that
  Inductor cannot fuse and re-round them);
* ``fp8_linear(x, w_q, w_row_scales, bias, w_fmt, a_fmt, w_block_rows)``: :func:`..fp8.fp8_linear` (block-FP8 /
  NVFP4 weights, ``x.dtype`` out); the formats as :attr:`..fp8.QuantFormat.spec` strings, ``a_fmt`` ``""`` for
  unquantized activations (W4A16), NVFP4 codes unpacked one per byte, ``w_block_rows`` the row scales' constant runs;
* ``fp8_row_parallel_linear(x, w_q, w_row_scales, bias, w_fmt, a_fmt, w_block_rows, segments)``: the FP8 linear's
  row-parallel tree of ``segments`` K segments on one rank (``kfp8.fp8_linear(..., segments=S)``), ``x.dtype`` out;
* ``fp8_linear_segment_tree(x, w_q, w_row_scales, w_fmt, a_fmt, w_block_rows, segments)``: a tensor-parallel rank's
  float32 subtree of it over its K shard's ``segments`` segments (all-gathered and topped by the caller);
* ``fp8_moe_experts(hidden, experts, weights, fc1_q, fc1_rows, fc2_q, fc2_rows, shared_fc1_q, shared_fc1_rows,
  shared_fc2_q, shared_fc2_rows, shared_gate, w_fmt, a_fmt)``: :func:`..fp8.fp8_moe_experts` without masters
  (E4M3 experts with per-row scales; CUDA: grouped FP8 GEMMs, no host read), ``[T, H]``;
* ``fp8_moe_owned_expert_outputs(hidden, experts, first, fc1_q, fc1_rows, fc2_q, fc2_rows, w_fmt, a_fmt)``:
  ``[T, k, H]``, :func:`..fp8.fp8_owned_expert_outputs` with ``fixed_shapes=True`` (a tensor-parallel rank's FP8
  experts, as ``moe_owned_expert_outputs``);
* ``fp8_moe_combine(hidden, y, weights, shared_fc1_q, shared_fc1_rows, shared_fc2_q, shared_fc2_rows, shared_gate,
  w_fmt, a_fmt)``: ``[T, H]``, :func:`..fp8.fp8_combine_experts` (the FP8 shared expert and the slot-order combine) --
  with ``fp8_moe_owned_expert_outputs`` the bits of ``fp8_moe_experts``;
* ``router_logits(x, weight)``: float32 ``[T, E]`` by the linear's float32 accumulator;
* ``moe_route(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling)``: (weights float32, experts
  int64) ``[T, k]`` by the device's ``moe_select_experts`` (:func:`..moe.select_experts`; CUDA: one Triton kernel
  with its bits) — the registered ``moe_route`` forward without its NaN refusal,
  which reads the host (a rollout engine's padded CUDA-graph rows may hold anything; a NaN in a real row shows in
  its log-prob);
* ``moe_experts(hidden, experts, weights, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, activation)``:
  :func:`..moe.moe_experts` (grouped experts, shared expert, slot-order combine), ``[T, H]``;
* ``moe_owned_expert_outputs(hidden, experts, first, w_gate_up, w_down, activation)``: ``[T, k, H]``,
  :func:`..moe.owned_expert_outputs` with ``fixed_shapes=True`` — a tensor-parallel rank's experts ``[first, first +
  E_local)``: every pair computed, the others' masked to ``+0.0`` by a select (no host read, no data-dependent shape);
* ``moe_combine(hidden, y, weights, shared_gate_up, shared_down, shared_gate, activation)``: ``[T, H]``,
  :func:`..moe.combine_experts` of the experts' outputs ``y [T, k, H]`` (summed over the ranks) and the shared
  expert — with ``moe_owned_expert_outputs`` the bits of ``moe_experts``.
"""

from __future__ import annotations

import torch

from . import fp8 as kfp8
from . import moe as kmoe
from .dispatch import implementation


@torch.library.custom_op("megatron_consistent::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = implementation("linear", x.device)(x.reshape(-1, x.shape[-1]), weight, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("megatron_consistent::linear_segment_tree", mutates_args=())
def linear_segment_tree(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    tree = implementation("linear_segment_tree", x.device)(x.reshape(-1, x.shape[-1]), weight, segments, None,
                                                           torch.float32)
    return tree.reshape(*x.shape[:-1], weight.shape[0])


@linear_segment_tree.register_fake
def _linear_segment_tree_fake(x, weight, segments):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("megatron_consistent::row_parallel_linear", mutates_args=())
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, segments: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    y = implementation("linear_segment_tree", x.device)(x.reshape(-1, x.shape[-1]), weight, segments, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@row_parallel_linear.register_fake
def _row_parallel_linear_fake(x, weight, segments, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("megatron_consistent::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return implementation("rms_norm", x.device)(x, weight, eps)[0]


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("megatron_consistent::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return implementation("add_rms_norm", x.device)(x, residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("megatron_consistent::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    return implementation("rope", x.device)(x, cos[:, None, :], sin[:, None, :], style)


@rope.register_fake
def _rope_fake(x, cos, sin, style):
    return torch.empty_like(x)


@torch.library.custom_op("megatron_consistent::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return implementation("silu_and_mul", x.device)(x)


@silu_and_mul.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("megatron_consistent::relu_squared", mutates_args=())
def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return implementation("relu_squared", x.device)(x)


@relu_squared.register_fake
def _relu_squared_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("megatron_consistent::mamba_dt", mutates_args=())
def mamba_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    return implementation("mamba_dt", dt_raw.device)(dt_raw, dt_bias, dt_min, dt_max)


@mamba_dt.register_fake
def _mamba_dt_fake(dt_raw, dt_bias, dt_min, dt_max):
    return torch.empty_like(dt_raw, dtype=torch.float32)


@torch.library.custom_op("megatron_consistent::gated_rms_norm", mutates_args=())
def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    return implementation("gated_rms_norm", y.device)(y, z, weight, group_size, eps)


@gated_rms_norm.register_fake
def _gated_rms_norm_fake(y, z, weight, group_size, eps):
    return torch.empty_like(y)


def _fp8_formats(w_fmt: str, a_fmt: str) -> dict:
    return {"w_fmt": kfp8.QuantFormat.from_spec(w_fmt), "a_fmt": kfp8.QuantFormat.from_spec(a_fmt) if a_fmt else None}


@torch.library.custom_op("megatron_consistent::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, bias: torch.Tensor | None, w_fmt: str,
               a_fmt: str, w_block_rows: int = 0) -> torch.Tensor:
    return kfp8.fp8_linear(x, w_q, w_row_scales, bias, w_block_rows=w_block_rows, **_fp8_formats(w_fmt, a_fmt))


@fp8_linear.register_fake
def _fp8_linear_fake(x, w_q, w_row_scales, bias, w_fmt, a_fmt, w_block_rows=0):
    return x.new_empty(*x.shape[:-1], w_q.shape[0])


@torch.library.custom_op("megatron_consistent::fp8_row_parallel_linear", mutates_args=())
def fp8_row_parallel_linear(x: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, bias: torch.Tensor | None,
                            w_fmt: str, a_fmt: str, w_block_rows: int, segments: int) -> torch.Tensor:
    return kfp8.fp8_linear(x, w_q, w_row_scales, bias, w_block_rows=w_block_rows, segments=segments,
                           **_fp8_formats(w_fmt, a_fmt))


@fp8_row_parallel_linear.register_fake
def _fp8_row_parallel_linear_fake(x, w_q, w_row_scales, bias, w_fmt, a_fmt, w_block_rows, segments):
    return x.new_empty(*x.shape[:-1], w_q.shape[0])


@torch.library.custom_op("megatron_consistent::fp8_linear_segment_tree", mutates_args=())
def fp8_linear_segment_tree(x: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, w_fmt: str, a_fmt: str,
                            w_block_rows: int, segments: int) -> torch.Tensor:
    return kfp8.fp8_linear(x, w_q, w_row_scales, None, torch.float32, w_block_rows=w_block_rows, segments=segments,
                           **_fp8_formats(w_fmt, a_fmt))


@fp8_linear_segment_tree.register_fake
def _fp8_linear_segment_tree_fake(x, w_q, w_row_scales, w_fmt, a_fmt, w_block_rows, segments):
    return x.new_empty(*x.shape[:-1], w_q.shape[0], dtype=torch.float32)


def _fp8_shared_expert(shared_fc1_q, shared_fc1_rows, shared_fc2_q, shared_fc2_rows, shared_gate, w_fmt: str):
    """The FP8 ops' shared-expert arguments as :func:`..fp8.fp8_combine_experts` takes them (None: no shared expert)."""
    if shared_fc1_q is None:
        return None
    br = kfp8.QuantFormat.from_spec(w_fmt).block[0]
    return (kfp8.FP8Weights(shared_fc1_q, shared_fc1_rows, block_rows=kfp8.gate_up_block_rows(shared_fc1_q.shape[0], br)),
            kfp8.FP8Weights(shared_fc2_q, shared_fc2_rows, block_rows=kfp8.row_block_of_parts((shared_fc2_q.shape[0],), br)),
            shared_gate)


@torch.library.custom_op("megatron_consistent::fp8_moe_experts", mutates_args=())
def fp8_moe_experts(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fc1_q: torch.Tensor,
                    fc1_rows: torch.Tensor, fc2_q: torch.Tensor, fc2_rows: torch.Tensor, shared_fc1_q: torch.Tensor | None,
                    shared_fc1_rows: torch.Tensor | None, shared_fc2_q: torch.Tensor | None,
                    shared_fc2_rows: torch.Tensor | None, shared_gate: torch.Tensor | None, w_fmt: str,
                    a_fmt: str) -> torch.Tensor:
    shared = _fp8_shared_expert(shared_fc1_q, shared_fc1_rows, shared_fc2_q, shared_fc2_rows, shared_gate, w_fmt)
    return kfp8.fp8_moe_experts(hidden, experts, weights, kfp8.FP8Weights(fc1_q, fc1_rows),
                                kfp8.FP8Weights(fc2_q, fc2_rows), shared, **_fp8_formats(w_fmt, a_fmt))


@fp8_moe_experts.register_fake
def _fp8_moe_experts_fake(hidden, experts, weights, fc1_q, fc1_rows, fc2_q, fc2_rows, shared_fc1_q, shared_fc1_rows,
                          shared_fc2_q, shared_fc2_rows, shared_gate, w_fmt, a_fmt):
    return torch.empty_like(hidden)


@torch.library.custom_op("megatron_consistent::fp8_moe_owned_expert_outputs", mutates_args=())
def fp8_moe_owned_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, first: int, fc1_q: torch.Tensor,
                                 fc1_rows: torch.Tensor, fc2_q: torch.Tensor, fc2_rows: torch.Tensor, w_fmt: str,
                                 a_fmt: str) -> torch.Tensor:
    return kfp8.fp8_owned_expert_outputs(hidden, experts, first, kfp8.FP8Weights(fc1_q, fc1_rows),
                                         kfp8.FP8Weights(fc2_q, fc2_rows), fixed_shapes=True, **_fp8_formats(w_fmt, a_fmt))


@fp8_moe_owned_expert_outputs.register_fake
def _fp8_moe_owned_expert_outputs_fake(hidden, experts, first, fc1_q, fc1_rows, fc2_q, fc2_rows, w_fmt, a_fmt):
    return hidden.new_empty(*experts.shape, fc2_q.shape[1])


@torch.library.custom_op("megatron_consistent::fp8_moe_combine", mutates_args=())
def fp8_moe_combine(hidden: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared_fc1_q: torch.Tensor | None,
                    shared_fc1_rows: torch.Tensor | None, shared_fc2_q: torch.Tensor | None,
                    shared_fc2_rows: torch.Tensor | None, shared_gate: torch.Tensor | None, w_fmt: str,
                    a_fmt: str) -> torch.Tensor:
    shared = _fp8_shared_expert(shared_fc1_q, shared_fc1_rows, shared_fc2_q, shared_fc2_rows, shared_gate, w_fmt)
    return kfp8.fp8_combine_experts(hidden, y, weights, shared, **_fp8_formats(w_fmt, a_fmt))


@fp8_moe_combine.register_fake
def _fp8_moe_combine_fake(hidden, y, weights, shared_fc1_q, shared_fc1_rows, shared_fc2_q, shared_fc2_rows, shared_gate,
                          w_fmt, a_fmt):
    return torch.empty_like(hidden)


@torch.library.custom_op("megatron_consistent::router_logits", mutates_args=())
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return implementation("linear", x.device)(x.reshape(-1, x.shape[-1]), weight, None, torch.float32)


@router_logits.register_fake
def _router_logits_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("megatron_consistent::moe_route", mutates_args=())
def moe_route(z: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None, norm_topk_prob: bool, n_group: int,
              topk_group: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return implementation("moe_select_experts", z.device)(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group,
                                                          scaling)


@moe_route.register_fake
def _moe_route_fake(z, top_k, scoring, bias, norm_topk_prob, n_group, topk_group, scaling):
    return z.new_empty(z.shape[0], top_k), z.new_empty(z.shape[0], top_k, dtype=torch.int64)


@torch.library.custom_op("megatron_consistent::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
                shared_gate: torch.Tensor | None, activation: str) -> torch.Tensor:
    shared = None if shared_gate_up is None else (shared_gate_up, shared_down, shared_gate)
    return kmoe.moe_experts(hidden, experts, weights, w_gate_up, w_down, shared, activation)


@moe_experts.register_fake
def _moe_experts_fake(hidden, experts, weights, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, activation):
    return torch.empty_like(hidden)


@torch.library.custom_op("megatron_consistent::moe_owned_expert_outputs", mutates_args=())
def moe_owned_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, first: int, w_gate_up: torch.Tensor,
                             w_down: torch.Tensor, activation: str) -> torch.Tensor:
    return kmoe.owned_expert_outputs(hidden, experts, first, w_gate_up, w_down, activation, fixed_shapes=True)


@moe_owned_expert_outputs.register_fake
def _moe_owned_expert_outputs_fake(hidden, experts, first, w_gate_up, w_down, activation):
    return hidden.new_empty(*experts.shape, w_down.shape[1])


@torch.library.custom_op("megatron_consistent::moe_combine", mutates_args=())
def moe_combine(hidden: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared_gate_up: torch.Tensor | None,
                shared_down: torch.Tensor | None, shared_gate: torch.Tensor | None, activation: str) -> torch.Tensor:
    shared = None if shared_gate_up is None else (shared_gate_up, shared_down, shared_gate)
    return kmoe.combine_experts(hidden, y, weights, shared, activation)


@moe_combine.register_fake
def _moe_combine_fake(hidden, y, weights, shared_gate_up, shared_down, shared_gate, activation):
    return torch.empty_like(hidden)
