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
* ``row_parallel_linear(x, weight, bias)``: the K-segment tree of
  :func:`..linear.row_parallel_linear` on one rank, in ``x.dtype``;
* ``linear_segment_tree(x, weight, segments)``: a rank's float32 subtree over
  ``segments`` K segments (``adjacent_tree_sum`` of ``linear_segments``), to
  be all-gathered and reduced by the top of the tree under tensor parallelism;
  both run the registered ``linear_segment_tree`` forward (one Triton launch on
  CUDA, the tree and the bias fused; bit-equal to the unfused definition);
* ``rms_norm(x, weight, eps)``: RMSNorm over the last dim (no residual);
* ``rope(x, cos, sin, style)``: ``x [T, heads, head_dim]`` rotated by the
  float32 tables already gathered at each token's position, ``cos/sin [T, rot/2]``
  (``style``: ``kernels.rotary.ROPE_STYLES``);
* ``silu_and_mul(x)``: ``silu(x[..., :I]) * x[..., I:]``.
"""

from __future__ import annotations

import torch

from .dispatch import implementation
from .linear import ROW_PARALLEL_SEGMENTS


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
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = implementation("linear_segment_tree", x.device)(x.reshape(-1, x.shape[-1]), weight, ROW_PARALLEL_SEGMENTS,
                                                        bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@row_parallel_linear.register_fake
def _row_parallel_linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("megatron_consistent::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return implementation("rms_norm", x.device)(x, weight, eps)[0]


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


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
