"""Tensor parallelism of the plugin's dense, MoE and hybrid models (issue #18): the same bits at every TP dividing S.

Placement comes from the weight table's ``shard`` rule (:func:`..architectures.tp_part`):

* ``column`` (q|k|v, gate|up, their biases): each output feature whole on one rank — a rank's
  attention heads and MLP columns are computed exactly as at TP = 1;
* ``row`` (o_proj, down): rank r holds K columns ``[r K/t, (r+1) K/t)``, i.e. segments
  ``r S/t .. (r+1) S/t - 1`` of the row-parallel contract (:mod:`..kernels.linear`; S =
  ``ArchConfig.row_parallel_segments``, the model's): it computes their float32 subtree
  (``inference_ops.linear_segment_tree(x, w, S // t)``), the t subtrees are
  **all-gathered** in rank order (never all-reduced: a reduction's order is the communicator's)
  and summed by ``adjacent_tree_sum`` — the top of the TP = 1 tree; bias in float32, one rounding;
* ``vocab`` (embedding, lm head): rows in parts of ``ceil(V / t)``.  The embedding: each rank
  looks up the ids it owns, the rows are all-gathered and each token takes its owner's row (a
  copy: exact, signed zeros included).  The lm head: each rank computes its float32 logit
  columns (every column is its own dot product), all-gathered along the vocabulary and trimmed
  to V — the full-vocabulary logits of TP = 1, on every rank, for the unchanged log-prob contract;
* ``replicated``: norms (and Qwen3 q/k norms), MoE routers and shared experts, whole on every rank;
* ``experts`` (the stacked MoE experts): rank r holds experts ``[r E/t, (r+1) E/t)`` whole and nothing of the
  others'.  Every rank routes all tokens (router replicated), computes the (token, slot) outputs of the pairs
  routed to its own experts with the one-rank expert MLP and ``+0.0`` for the others' pairs
  (``inference_ops.moe_owned_expert_outputs``: a masked computation over all pairs, no data-dependent shape);
  the ranks' ``[T, k, H]`` tensors are **all-gathered** in rank order and summed (:func:`sum_owned_slots`: one
  value and zeros per element, exact), then every rank combines them with the replicated shared expert in slot
  order (``inference_ops.moe_combine``) — the TP = 1 bits;
* ``blocks`` (a hybrid's Mamba ``in_proj`` z | x | B | C | dt and ``conv1d`` x | B | C): rank r holds the r-th of t
  runs of every block -- its heads and the groups they read, whose values it computes whole (:mod:`.mamba`).

Every collective is vLLM's ``tensor_model_parallel_all_gather`` (a registered custom op:
``torch.compile`` and CUDA-graph capture see one node).  Refused by name at TP > 1, before any
weight is read: TP not dividing the model's S, head / KV-head / MLP sizes, numbers of
experts and Mamba groups that TP does not divide (a hybrid's Mamba mixers: :mod:`.mamba`), and block-FP8 / NVFP4
layouts whose rank parts or row-parallel segments are not whole scale blocks (:func:`..conversion.fp8.fp8_tp_refusal`);
at every TP, a row-parallel weight whose K the model's S does not divide.

Block-FP8 / NVFP4 dense checkpoints at TP > 1 (:mod:`.fp8`): each rank holds its part of every quantized weight and of
its block-scale tensor (the same ``shard`` rule, scale rows / columns = weight rows / columns / the block); o_proj and down run
:func:`fp8_row_parallel_for` (the FP8 linear's float32 subtree of the rank's segments, all-gathered, the top of the
tree).  Block-FP8 / NVFP4 MoE checkpoints: the attention as above; a rank holds its whole experts with their whole
scales (the ``experts`` rule on both; NVFP4: each expert tensor's ``weight_scale_2`` too) and the shared expert
whole, and runs the ``experts`` steps above with the FP8 expert ops (``inference_ops.fp8_moe_owned_expert_outputs``,
:func:`sum_owned_slots`, ``fp8_moe_combine``).

This module imports vLLM only inside functions (``verify`` calls :func:`tp_refusal` before any engine starts).
"""

from __future__ import annotations

import torch

from ..architectures import tp_part, weight_entries
from ..config import ROW_PARALLEL_SEGMENTS_KEY, ArchConfig, UnsupportedConfigError, row_parallel_refusal
from ..conversion.fp8 import fp8_tp_refusal
from ..kernels import inference_ops
from ..kernels.numerics import adjacent_tree_sum


def tp_refusal(arch: ArchConfig, tp: int, quantized=None) -> str:
    """Why the plugin cannot run ``arch`` at tensor-parallel size ``tp`` ('' when it can); ``quantized``: the
    checkpoint's weight :class:`~..kernels.fp8.QuantFormat` (None: the model dtype)."""
    segments = arch.row_parallel_segments
    reason = row_parallel_refusal(segments, tp)
    if reason:
        return f"tensor_parallel_size={tp}: {reason}"
    name = f"{arch.architecture} at tensor_parallel_size={tp}"
    for entry in weight_entries(arch):
        if entry.shard == "row" and entry.shape[-1] % segments:
            return (f"{name}: {entry.megatron} K = {entry.shape[-1]} cannot be cut into {segments} row-parallel "
                    f"segments ({ROW_PARALLEL_SEGMENTS_KEY})")
    if tp == 1:
        return ""
    if arch.is_hybrid and arch.ssm.n_groups % tp:  # a rank holds whole groups and their heads (vllm_plugin/mamba.py)
        return f"{name}: Mamba groups (n_groups={arch.ssm.n_groups}) not divisible by {tp}"
    if quantized is not None and (reason := fp8_tp_refusal(arch, tp, quantized)):
        return f"{name}: {reason}"
    dense_mlp = any(not arch.layer_is_moe(i) for i in range(arch.num_layers))
    for what, n in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                    ("MLP intermediate size", arch.intermediate_size if dense_mlp else tp),
                    ("experts", arch.num_experts if arch.is_moe else tp)):
        if n % tp:
            return f"{name}: {what} ({n}) not divisible by {tp}"
    try:
        for entry in weight_entries(arch):
            for i in range(len(entry.hf)):
                tp_part(entry, i, 0, tp)
    except ValueError as e:
        return f"{name}: {e}"
    return ""


def check_tp(arch: ArchConfig, tp: int, quantized=None) -> None:
    """Raise :class:`UnsupportedConfigError` with :func:`tp_refusal`'s reason, if any."""
    reason = tp_refusal(arch, tp, quantized)
    if reason:
        raise UnsupportedConfigError(reason)


def tp_rank_size() -> tuple[int, int]:
    """(rank, size) of this process in vLLM's tensor-parallel group."""
    from .compat import tensor_parallel_rank_size

    return tensor_parallel_rank_size()


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    from .compat import tensor_parallel_all_gather

    return tensor_parallel_all_gather(x, dim)


def tree_top(partial: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' float32 subtrees ``partial [..., N]`` all-gathered in rank order, the top of the tree
    (``adjacent_tree_sum``), bias in float32, one rounding to ``dtype``: the full result, on every rank."""
    total = adjacent_tree_sum(_all_gather(partial.unsqueeze(0), 0), dim=0)  # [size, ..., N] in rank order -> tree top
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(dtype)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int,
                        size: int) -> torch.Tensor:
    """This rank's K shard ``weight [N, K/size]`` of a row-parallel linear whose tree has ``segments`` (the model's S)
    K segments; the full result, on every rank, in x.dtype."""
    return tree_top(inference_ops.linear_segment_tree(x, weight, segments // size), bias, x.dtype)


def row_parallel_for(segments: int, size: int):
    """The row-parallel linear ``f(x, w, b=None)`` of a layer at TP = ``size`` whose tree has ``segments`` (the model's
    S) K segments (TP = 1: the one-rank custom op; ``segments`` an int constant to ``torch.compile``)."""
    if size == 1:
        return lambda x, w, b=None: inference_ops.row_parallel_linear(x, w, segments, b)
    return lambda x, w, b=None: row_parallel_linear(x, w, b, segments, size)


def fp8_row_parallel_for(segments: int, size: int):
    """:func:`row_parallel_for` of an FP8 linear: ``f(x, w_q, row_scales, b, w_fmt, a_fmt, w_block_rows)`` -- at TP = 1
    the one-rank custom op ``fp8_row_parallel_linear``; at TP > 1 this rank's K shard (whole 128-wide activation
    groups and weight blocks: ``conversion.fp8.fp8_tp_refusal``) through ``fp8_linear_segment_tree`` (its float32
    subtree of ``segments // size`` segments), then :func:`tree_top`."""
    if size == 1:
        return lambda x, w_q, rows, b, w_fmt, a_fmt, block_rows: inference_ops.fp8_row_parallel_linear(
            x, w_q, rows, b, w_fmt, a_fmt, block_rows, segments)
    return lambda x, w_q, rows, b, w_fmt, a_fmt, block_rows: tree_top(
        inference_ops.fp8_linear_segment_tree(x, w_q, rows, w_fmt, a_fmt, block_rows, segments // size), b, x.dtype)


def sum_owned_slots(y: torch.Tensor) -> torch.Tensor:
    """The sum over the TP ranks of the MoE's (token, slot) outputs ``y [T, k, H]``, of which each element is non-zero
    on one rank at most (the rank holding the pair's expert; ``+0.0`` elsewhere): the ranks' tensors all-gathered in
    rank order, then added by the tree of neighbours.  Each element is one value plus zeros, so the sum is that value
    in any order (a ``-0.0`` may come back ``+0.0``, which the slot-order combine cannot tell apart).  All-gathered,
    not all-reduced: an all-gather only moves bytes, while vLLM's all-reduce is whichever communicator it picks
    (custom kernels, quantized or rewritten by its compile passes), whose arithmetic the plugin does not choose."""
    return adjacent_tree_sum(_all_gather(y.unsqueeze(0), 0), dim=0)


def vocab_parallel_embedding(ids: torch.Tensor, held: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows of the embedding for ``ids`` when each rank holds ``held`` = vocabulary rows ``[rank p, (rank+1) p)``."""
    part = held.shape[0]
    local = ids - rank * part
    mine = (local >= 0) & (local < part)
    rows = held[torch.where(mine, local, torch.zeros_like(local))]  # [T, H]; rows of ids this rank does not own: unused
    gathered = _all_gather(rows.unsqueeze(0), 0)  # [size, T, H]
    owner = torch.div(ids, part, rounding_mode="floor")
    return gathered[owner, torch.arange(ids.shape[0], device=ids.device)]


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits from each rank's columns ``[..., ceil(V / t)]`` (rank order), padding columns dropped."""
    return _all_gather(logits, -1)[..., :vocab_size]
