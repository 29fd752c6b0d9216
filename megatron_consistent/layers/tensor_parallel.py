"""Tensor-parallel communication of the consistent layers (gloo ranks on CPU, NCCL ranks on GPUs), in a fixed order.

Contract (``docs/parallel.md``):

* **Column-parallel** linear (``linear_qkv``, ``linear_fc1``; Megatron's
  sharding: output rows split, ``linear_fc1`` as gate shard | up shard): each
  output feature is one independent dot product, so the local forward is
  :func:`kernels.linear` on the rank's rows — no communication.  Backward:
  :func:`copy_to_tp` all-reduces ``grad_x`` (SUM, any order: gradients are held
  to the float64-reference tolerance, not to bits).
* **Row-parallel** linear (``linear_proj``, ``linear_fc2``; input columns split):
  rank r holds K columns ``[r K/t, (r+1) K/t)`` = segments ``r S/t ... (r+1) S/t - 1``
  of the :func:`kernels.row_parallel_linear` tree (S: the model's segment count,
  ``ArchConfig.row_parallel_segments``, which t divides); it computes its float32
  subtree, :func:`gather_tree` all-gathers the t subtree values **in rank order**
  (``all_gather``, never ``all_reduce``, whose order is not ours) and reduces them
  by ``adjacent_tree_sum``; bias in float32; one rounding.  Bits = TP=1.
  Backward: the gathered sum's gradient is the output gradient itself on every
  rank, so ``grad_x`` is the rank's local K slice (no communication).
* **Sequence parallelism** (``sequence_parallel=True``, TP > 1): outside the
  linears the activations are sequence shards ``[s/t, b, H]`` (norms, residual
  adds: row-wise ops, unchanged bits).  A column-parallel input (and the LM head's)
  is all-gathered along the sequence (:func:`gather_sequence`: concatenation, exact;
  backward: all-reduce + own chunk = Megatron's reduce-scatter of ``grad_x``).  A
  row-parallel output, Megatron's reduce-scatter, is
  :func:`gather_tree_scatter_sequence`: the float32 subtrees of all ranks are
  all-gathered in rank order, the top of the tree is computed over the whole
  sequence and the rank keeps its chunk — the same bits as TP=1 (t times the
  bytes of a reduce-scatter; the order of a reduce-scatter is not ours).  The
  embedding's reduce-scatter adds one value and zeros: exact, as below; on CPU
  Megatron's reduce-scatter allocates on CUDA, so :func:`sequence_parallel_embedding`
  replaces it by the embedding's all-reduce (exact) and :func:`scatter_sequence`
  (the rank's chunk: slicing).
* **Vocab-parallel embedding** (Megatron's stock ``VocabParallelEmbedding``): a
  rank looks up the tokens of its vocabulary shard and writes zeros for the
  others; the all-reduce SUM then adds, per element, one looked-up value and
  t-1 zeros.  ``x + 0 = x`` exactly in IEEE arithmetic for every x but -0.0 (and
  any order of adding zeros gives x), so the embedding is exact at any TP; an
  entry equal to -0.0 comes back as +0.0, a difference no later op sees (norms and
  residual adds are row-wise; every linear's accumulator starts at +0.0, which
  erases the sign of a zero), so logits and log-probs keep their bits.
* **Expert parallelism** (EP = e > 1; the MoE layer's experts sharded over the EP group, whose ranks hold different
  tokens: other replicas' batches, or at TP > 1 their sequence-parallel chunks): :func:`exchange_rows` sends rows
  grouped by destination rank and returns what the ranks sent this one, in rank order (one all-to-all: bytes only,
  exact; its backward sends each gradient back the way its row came) -- a (token, slot) pair's row to its expert's
  rank and the output back, or a product to its token's owner; :func:`gather_rows` concatenates the ranks' rows in
  rank order (their counts may differ) with it.
* **Vocab-parallel log-probs** (:func:`vocab_parallel_logprobs`): the LM head
  gives the rank's float32 logits shard; global max by all-reduce MAX (exact);
  the rank's subtree of the 8-segment sum-exp tree
  (:func:`kernels.sum_exp_subtree`), float32 all-gather in rank order, top of the
  tree, ``kernels.logprobs.log_softmax_normalise`` -- the dispatched ops that
  :func:`kernels.log_softmax` composes at TP = 1, on CPU and on CUDA; the target
  token's log-prob is all-gathered from the rank that owns it (a selection, no
  arithmetic).  Bits = TP=1 (:func:`kernels.log_softmax`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..architectures import block_part, join_parts, take_part
from ..kernels.logprobs import VOCAB_SEGMENTS, log_softmax_normalise, scale_by_temperature, sum_exp_subtree
from ..kernels.numerics import adjacent_tree_sum

__all__ = ["copy_to_tp", "ep_group", "exchange_rows", "gather_rows", "gather_sequence", "gather_tree", "gather_tree_scatter_sequence",
           "incoming_counts", "row_counts", "row_parallel_forward", "scatter_sequence", "sequence_parallel_embedding", "shard_like",
           "sum_owned_slots", "tp_group", "tp_rank", "tp_size", "unshard_like",
           "vocab_parallel_logprobs"]


def tp_group(group=None):
    """``group`` or Megatron's tensor-model-parallel group (``None`` when Megatron is not initialized)."""
    if group is not None:
        return group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def tp_size(group=None) -> int:
    g = tp_group(group)
    return 1 if g is None else dist.get_world_size(g)


def tp_rank(group=None) -> int:
    g = tp_group(group)
    return 0 if g is None else dist.get_rank(g)


def ep_group():
    """Megatron's expert-model-parallel group when it has more than one rank, else ``None``."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_expert_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_expert_model_parallel_group()


def _expert_data_group():
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_group()


class _CopyToTP(torch.autograd.Function):
    """Forward identity; backward all-reduce SUM of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """The input of a column-parallel linear (identity forward, all-reduced ``grad_x`` backward)."""
    if group is None or dist.get_world_size(group) == 1 or not torch.is_grad_enabled():
        return x
    return _CopyToTP.apply(x, group)


class _SumOwnedSlots(torch.autograd.Function):
    """Forward: all-reduce SUM of tensors in which each element is non-zero on one rank at most (the MoE's
    (token, slot) outputs, each formed by the rank holding its expert; zeros elsewhere).  Exact in any order:
    ``x + 0 = x``; a ``-0.0`` may come back ``+0.0``, which the combine's ``w * y`` added to an accumulator started at
    ``+0.0`` cannot tell apart.  Backward: without sequence parallelism every rank computes the same combine, so
    its gradient is already whole on each rank (identity); with it each rank's covers its own tokens (all-reduce)."""

    @staticmethod
    def forward(ctx, y, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        if ctx.sequence_parallel:
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.group)
        return g, None, None


def sum_owned_slots(y: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """The sum over the TP ranks of ``y``, whose every element one rank at most holds non-zero (exact; see
    :class:`_SumOwnedSlots`): the MoE's expert outputs from the ranks that hold the experts."""
    if group is None or dist.get_world_size(group) == 1:
        return y
    return _SumOwnedSlots.apply(y, group, sequence_parallel)


def row_counts(rows: int, group, device=None) -> list[int]:
    """Every rank's row count in rank order (an all-gather of one integer)."""
    return [int(n) for n in _all_gather(torch.tensor([rows], dtype=torch.int64, device=device), group)[:, 0]]


def incoming_counts(send: torch.Tensor, group) -> list[int]:
    """What every rank sends this one, in rank order, given what this one sends each (``send [e]`` int64): the
    ``recv`` of :func:`exchange_rows` (an all-gather of the ranks' ``send``)."""
    return _all_gather(send, group)[:, dist.get_rank(group)].tolist()


def _exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``[sum(recv), ...]``: the rows every rank sent this one, in rank order; ``x``'s rows go out grouped by
    destination, ``send[r]`` to rank r (one all-to-all: bytes only)."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _RowsToRanks(torch.autograd.Function):
    """:func:`_exchange_rows`; backward: the gradients sent back the way the rows came."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _exchange_rows(g, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """The rows the ranks send this one (``recv[r]`` from rank r), in rank order; ``x`` holds this rank's outgoing
    rows grouped by destination (``send[r]`` to rank r).  Pure data movement, exact.  Differentiable (backward: each
    row's gradient goes back to the rank that sent it)."""
    return _exchange_differentiable(x, send, recv, group)


def _exchange_differentiable(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _RowsToRanks.apply(x, send, recv, group)
    return _exchange_rows(x, send, recv, group)


def gather_rows(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """``[sum(counts), ...]``: the ranks' rows (rank r holds ``counts[r]``: :func:`row_counts`) in rank order --
    concatenation, exact (every rank sends its rows to every rank: :func:`exchange_rows`).  Differentiable (backward:
    the sum over the ranks of the gradients of this rank's rows)."""
    e = len(counts)
    return _exchange_differentiable(x.repeat(e, *([1] * (x.dim() - 1))), [x.shape[0]] * e, counts, group)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[t, *x.shape]``: every rank's ``x`` in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class _GatherTree(torch.autograd.Function):
    """Forward: all-gather of the ranks' float32 subtree values in rank order, reduced by ``adjacent_tree_sum``.

    Backward: the output is the sum of the ranks' values, so each rank's value gets the output gradient (the same
    tensor on every rank, since every rank computes the same replicated output).
    """

    @staticmethod
    def forward(ctx, partial, group):
        return adjacent_tree_sum(_all_gather(partial, group), dim=0)

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_tree(partial: torch.Tensor, group) -> torch.Tensor:
    """Top of the tree: the t ranks' float32 ``partial`` values, in rank order, by ``adjacent_tree_sum``."""
    if group is None or dist.get_world_size(group) == 1:
        return partial
    return _GatherTree.apply(partial, group)


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather of the ranks' sequence chunks (dim 0) in rank order; backward: SUM of the ranks'
    gradients, this rank's chunk (Megatron's reduce-scatter; gradients in any order)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.cat(list(_all_gather(x, group)), dim=0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.chunk(dist.get_world_size(ctx.group), dim=0)[dist.get_rank(ctx.group)].contiguous(), None


class _ScatterSequence(torch.autograd.Function):
    """Forward: this rank's sequence chunk (dim 0); backward: all-gather of the chunk gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        return torch.cat(list(_all_gather(g, ctx.group)), dim=0), None


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, ...]`` -> this rank's chunk ``[s/t, ...]`` (slicing; backward all-gathers)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _ScatterSequence.apply(x, group)


def sequence_parallel_embedding(embedding) -> None:
    """Make Megatron's ``LanguageModelEmbedding`` (sequence parallel) all-reduce its vocabulary shards (exact: one
    value plus zeros) and keep this rank's sequence chunk, in place of its reduce-scatter (CUDA-only on CPU jobs)."""
    import types

    if getattr(embedding, "add_position_embedding", False) or getattr(embedding, "tokentype_embeddings", None) is not None:
        from ..config import UnsupportedConfigError

        raise UnsupportedConfigError("sequence parallelism with learned position / token-type embeddings is not supported")
    embedding.word_embeddings.reduce_scatter_embeddings = False
    embedding.reduce_scatter_embeddings = False
    group = tp_group()

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        if tokentype_ids is not None:
            from ..config import UnsupportedConfigError

            raise UnsupportedConfigError("token-type ids are not supported by the consistent embedding")
        emb = self.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, H], all-reduced shards
        if self.config.fp32_residual_connection:
            emb = emb.float()
        return scatter_sequence(emb, group)

    embedding.forward = types.MethodType(forward, embedding)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/t, ...]`` sequence chunks -> ``[s, ...]`` (sequence parallelism: a column-parallel input)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


class _GatherTreeScatterSequence(torch.autograd.Function):
    """Forward: ``adjacent_tree_sum`` of the ranks' float32 subtrees ``[s, ...]`` (all-gathered in rank order), this
    rank's sequence chunk.  Backward: the subtree feeds every chunk, so its gradient is the all-gathered chunk
    gradients (concatenation)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        total = adjacent_tree_sum(_all_gather(partial, group), dim=0)
        return total.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        return torch.cat(list(_all_gather(g, ctx.group)), dim=0), None


def gather_tree_scatter_sequence(partial: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism's reduce-scatter of a row-parallel output, as a gather + the tree's top + own chunk."""
    if group is None or dist.get_world_size(group) == 1:
        return partial
    return _GatherTreeScatterSequence.apply(partial, group)


def row_parallel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, segments: int,
                         out_dtype: torch.dtype | None = None, sequence_parallel: bool = False,
                         subtree=None) -> torch.Tensor:
    """Row-parallel linear on this rank's K shard ``weight [N, K/t]`` (x: the matching K slice) of a tree of
    ``segments`` (the model's S, which t divides) K segments; bits of TP=1.
    ``sequence_parallel``: return this rank's sequence chunk (dim 0) of the result.  ``subtree(x, weight, n)``: the
    float32 subtree of the rank's ``n`` segments (default the linear's: ``adjacent_tree_sum(linear_segments)``; the
    FP8 forward passes its own, layers/fp8.py), at every t."""
    t = 1 if group is None else dist.get_world_size(group)
    if t == 1 and subtree is None:
        return kernels.row_parallel_linear(x, weight, segments, bias, out_dtype)
    partial = (adjacent_tree_sum(kernels.linear_segments(x, weight, segments // t), dim=0) if subtree is None
               else subtree(x, weight, segments // t))
    total = gather_tree_scatter_sequence(partial, group) if sequence_parallel else gather_tree(partial, group)
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(out_dtype or x.dtype)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        z = scale_by_temperature(logits, temperature)
        m = z.amax(-1, keepdim=True).contiguous()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # exact in any order
        total = adjacent_tree_sum(_all_gather(sum_exp_subtree(z, m, VOCAB_SEGMENTS // t), group), dim=0)
        lp = log_softmax_normalise(z, m, total)
        v_local = logits.shape[-1]
        local = tokens - r * v_local
        mine = (local >= 0) & (local < v_local)
        idx = torch.where(mine, local, torch.zeros_like(local))
        picked = torch.where(mine, lp.gather(-1, idx[..., None])[..., 0], torch.zeros_like(lp[..., 0]))
        owner = torch.div(tokens, v_local, rounding_mode="floor")
        gathered = _all_gather(picked, group)  # [t, ...]: select the owner's value, no arithmetic
        out = gathered.gather(0, owner[None])[0]
        ctx.save_for_backward(lp, idx, mine)
        ctx.temperature = temperature if temperature > 0 else 1.0
        return out

    @staticmethod
    def backward(ctx, grad):
        lp, idx, mine = ctx.saved_tensors
        dz = -torch.exp(lp) * grad[..., None]
        dz.scatter_add_(-1, idx[..., None], torch.where(mine, grad, torch.zeros_like(grad))[..., None])
        return dz / ctx.temperature, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, group=None) -> torch.Tensor:
    """Token log-probs from this rank's float32 logits shard ``[..., V/t]`` (tokens: global ids); bits of
    :func:`kernels.gather_logprobs` on the whole vocabulary.  Differentiable (the gradient of the local shard)."""
    group = tp_group(group)
    if group is None or dist.get_world_size(group) == 1:
        return kernels.gather_logprobs(logits, tokens, temperature)
    if logits.dtype != torch.float32:
        raise ValueError(f"vocab_parallel_logprobs: logits must be float32, got {logits.dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_logprobs: tokens {tuple(tokens.shape)} do not match logits {tuple(logits.shape[:-1])}")
    return _VocabParallelLogprobs.apply(logits, tokens.to(torch.int64), float(temperature), group)


def _split_axis(param: torch.nn.Parameter):
    """``(dim, group)`` of a parameter split over ranks (``group``: Megatron's, ``None`` before it is
    initialized), ``None`` for a whole one.  Megatron's marks: an expert weight under expert parallelism
    (``allreduce=False``) is split along dim 0 over the EP group; a tensor-parallel one (``tensor_model_parallel``)
    along ``partition_dim`` over the TP group."""
    if not getattr(param, "allreduce", True):
        return 0, ep_group()
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, tp_group()
    return None


def _sections(param: torch.nn.Parameter, full_size: int) -> list[int]:
    """The full-size sub-blocks along the split axis that are split over the ranks each on its own:
    ``partition_sections`` (the Mamba ``in_proj`` z | x | B | C | dt, ``conv1d`` x | B | C: each rank holds its piece
    of every block, in block order), else ``partition_stride`` equal blocks (Megatron's stride: ``linear_fc1`` of a
    GLU = gate | up)."""
    sections = getattr(param, "partition_sections", None)
    if sections is not None:
        return list(sections)
    stride = getattr(param, "partition_stride", 1)
    return [full_size // stride] * stride


def shard_like(full: torch.Tensor, param: torch.nn.Parameter, rank: int | None = None, size: int | None = None) -> torch.Tensor:
    """This rank's piece of the full (TP=1) tensor ``full`` for ``param``, as Megatron splits it.

    Reads Megatron's attributes: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` (stride 2 =
    ``linear_fc1`` of a GLU: each rank holds its gate shard then its up shard) — the split of Megatron's
    ``_initialize_affine_weight_cpu`` — our ``partition_sections`` (unequal sub-blocks, each split over the ranks:
    the Mamba mixer's ``in_proj`` / ``conv1d``, as Megatron's mixer holds them), and ``allreduce=False`` (an expert
    weight: split along the expert axis over the EP group).  ``rank`` / ``size``: default this rank's place in the
    parameter's group.
    """
    split = _split_axis(param)
    if split is None or tuple(full.shape) == tuple(param.shape):
        return full
    dim, group = split
    if rank is None or size is None:
        if group is None:
            return full
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return full
    return take_part(full, block_part(_sections(param, full.shape[dim]), rank, size, dim))


def unshard_like(local: torch.Tensor, param: torch.nn.Parameter, group=None) -> torch.Tensor:
    """The full (TP=1) tensor from every rank's ``local`` piece for ``param`` (all-gather over ``group``, default the
    parameter's: TP, or EP for an expert weight): the inverse of :func:`shard_like` (concatenation only, no
    arithmetic)."""
    split = _split_axis(param)
    if split is None:
        return local
    dim, own = split
    group = own if group is None else group
    if group is None or dist.get_world_size(group) == 1:
        return local
    size = dist.get_world_size(group)
    pieces = [torch.empty_like(local.contiguous()) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    sections = _sections(param, local.shape[dim] * size)
    return join_parts(pieces, [block_part(sections, r, size, dim) for r in range(size)])


def expert_sharded_tensor(tensor: torch.Tensor, key: str, sharded_offsets=()):
    """Megatron's ``ShardedTensor`` of an expert stack ``[E/e, ...]`` split over the EP group (axis 0, global offset
    ``rank E/e``), replicated over the expert-data-parallel ranks -- the offsets Megatron's own experts save with."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    return make_tp_sharded_tensor_for_checkpoint(tensor, key, 0, prepend_offsets=sharded_offsets, tp_group=ep_group(),
                                                 dp_cp_group=_expert_data_group())
