"""Context parallelism (CP = c ∈ {2, 4}) of the consistent layers: each sequence's tokens over the c ranks of
Megatron's context-parallel group, with the bits of CP = 1 (``docs/parallel.md``, "Context parallelism").

Layout (Megatron's, ``megatron.core.utils.get_batch_on_this_cp_rank``): a sequence of s tokens (2c divides s) is cut
into 2c chunks of s / 2c; CP rank r holds chunks r and 2c - 1 - r, in that order (:func:`cp_share`), so every rank
has the same causal work.  Its tokens' absolute positions (:func:`cp_positions`) are what the rotary embedding and
the causal mask use.

Every op but attention is per token (embedding, norms, the linears and their row-parallel tree, the MLP, the MoE
router and experts, the LM head, the log-softmax), so a rank computes its tokens' CP = 1 bits from its tokens alone.  Attention
(:func:`cp_attention`): a query row's output under ``kernels.attention``'s contract depends only on that row's q,
its absolute position p and the keys / values at positions 0 .. p (key blocks aligned at position 0, visited in
increasing order, blocks with no visible key leaving the state bitwise unchanged) -- never on the other query rows of
the call.  So each rank rotates its q and k at their absolute positions (rotation per token: the CP = 1 values of
its rows), all-gathers the ranks' rotated k and v **in position order** (bytes moved, no arithmetic:
:class:`_GatherKeysValues`), and attends its query rows at their absolute positions over the whole sequence's k / v:
the CP = 1 bits of its rows.

Per-token outputs come back in the original token order by the same position-order all-gather
(:func:`gather_cp_sequence`, :func:`sequence_token_logprobs`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import kernels
from ..config import UnsupportedConfigError
from .tensor_parallel import _all_gather, vocab_parallel_logprobs

__all__ = ["cp_attention", "cp_group", "cp_positions", "cp_rank", "cp_share", "cp_size", "gather_cp_rows", "gather_cp_sequence",
           "sequence_length_refusal", "sequence_multiple", "sequence_token_logprobs"]


def cp_group():
    """Megatron's context-parallel group when it has more than one rank, else ``None``."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def cp_size() -> int:
    g = cp_group()
    return 1 if g is None else dist.get_world_size(g)


def cp_rank() -> int:
    g = cp_group()
    return 0 if g is None else dist.get_rank(g)


def sequence_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What a sequence length must be a multiple of at CP = ``cp`` (2 chunks a CP rank) and, with sequence
    parallelism, TP = ``tp`` (the rank's s / c tokens split over the TP ranks)."""
    t = tp if sequence_parallel else 1
    return t if cp == 1 else cp * math.lcm(2, t)


def sequence_length_refusal(length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> str:
    """Why sequences of ``length`` tokens cannot be split at CP = ``cp`` (TP = ``tp``, sequence parallelism); ""
    when they can."""
    m = sequence_multiple(cp, tp, sequence_parallel)
    if length % m == 0:
        return ""
    if cp == 1:
        return f"sequence parallelism: sequence length {length} is not divisible by TP={tp}"
    return (f"context parallelism CP={cp}: sequence length {length} is not divisible by {m} (2 x CP chunks"
            + (f", each CP rank's tokens over TP={tp}" if sequence_parallel and tp > 1 else "") + ")")


def _chunk_ids(rank: int, c: int) -> tuple[int, int]:
    return rank, 2 * c - 1 - rank


def _share(x: torch.Tensor, dim: int, rank: int, c: int) -> torch.Tensor:
    """Rank ``rank``'s chunks of 2c along ``dim`` (slicing)."""
    parts = x.chunk(2 * c, dim=dim)
    return torch.cat([parts[i] for i in _chunk_ids(rank, c)], dim=dim)


def cp_share(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of whole sequences along ``dim``: chunks r and 2c - 1 - r of 2c (slicing; ``x`` itself
    at CP = 1)."""
    c = cp_size()
    if c == 1:
        return x
    reason = sequence_length_refusal(x.shape[dim], c)
    if reason:
        raise UnsupportedConfigError(reason)
    return _share(x, dim, cp_rank(), c)


def cp_positions(batch: int, local_length: int, device=None) -> torch.Tensor:
    """``[batch, local_length]``: the absolute positions of this CP rank's tokens (``kernels.causal_positions`` at
    CP = 1)."""
    c = cp_size()
    if c == 1:
        return kernels.causal_positions(batch, local_length, device=device)
    half = local_length // 2
    pos = torch.cat([i * half + torch.arange(half, device=device) for i in _chunk_ids(cp_rank(), c)])
    return pos.expand(batch, local_length)


def _in_position_order(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' shares (each [.., 2 chunks, ..] along ``dim``) all-gathered and laid out in position order
    (concatenation: bytes only)."""
    c = dist.get_world_size(group)
    chunks = [None] * (2 * c)
    for r, share in enumerate(_all_gather(x, group)):
        for i, part in zip(_chunk_ids(r, c), share.chunk(2, dim=dim)):
            chunks[i] = part
    return torch.cat(chunks, dim=dim)


class _GatherSequence(torch.autograd.Function):
    """Forward: the ranks' shares of per-token values all-gathered in position order (exact: bytes).  Backward: the
    rank's share of the gradient (every CP rank computes the same function of the gathered values, e.g. the loss over
    all tokens, so each backpropagates its own tokens' part; Megatron's DDP sums the weights' gradients over the CP
    ranks)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _in_position_order(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _share(g, ctx.dim, dist.get_rank(ctx.group), dist.get_world_size(ctx.group)), None, None


class _GatherKeysValues(_GatherSequence):
    """Forward: :class:`_GatherSequence`'s, for k (or v).  Backward: every rank's
    queries contribute to every position's dk / dv; the ranks' float32 contributions to the whole sequence are
    all-gathered and summed in rank order (a fixed order, unlike a reduce-scatter's), and the rank keeps its share."""

    @staticmethod
    def backward(ctx, g):
        total = None
        for part in _all_gather(g.to(torch.float32), ctx.group):  # rank order
            total = part if total is None else total + part
        share = _share(total, ctx.dim, dist.get_rank(ctx.group), dist.get_world_size(ctx.group))
        return share.to(g.dtype), None, None


def gather_cp_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Whole sequences along ``dim`` in token order from the CP ranks' shares (``x`` itself at CP = 1)."""
    group = cp_group()
    return x if group is None else _GatherSequence.apply(x, dim, group)


def gather_cp_rows(x: torch.Tensor, local_length: int) -> torch.Tensor:
    """``[s*b, ...]`` rows of the whole sequences in Megatron's ``[s, b]`` token order from the rank's
    ``[local_length*b, ...]`` rows (its share, same order): :func:`gather_cp_sequence` along the sequence axis."""
    return gather_cp_sequence(x.view(local_length, -1, *x.shape[1:]), 0).flatten(0, 1)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float | None):
    """Causal attention of this CP rank's query rows over the whole sequence.

    ``q [B, T, Hq, D]``, ``k / v [B, T, Hkv, D]``: the rank's T = s / c tokens (rotated at their absolute
    ``positions [B, T]``, :func:`cp_positions`).  Numerics contract: k and v of the c ranks are all-gathered in
    position order (:class:`_GatherKeysValues`: bytes) into the sequence's ``[B, s, Hkv, D]``, and
    ``kernels.attention(q, k_all, v_all, positions)`` attends each row to the keys at positions 0 .. its own -- a
    row's output is its CP = 1 bits (a row never depends on the other query rows of the call).  Backward: dq from
    the kernel's backward; dk / dv: the ranks' float32 contributions summed in rank order (gradients are held to the
    float64 bound, not to bits).  At CP = 1 it is ``kernels.attention(q, k, v, positions)``.
    """
    group = cp_group()
    if group is not None:
        k, v = _GatherKeysValues.apply(k, 1, group), _GatherKeysValues.apply(v, 1, group)
    return kernels.attention(q, k, v, positions, scale=scale)


def sequence_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 ``[b, s-1]`` log p(input_ids[:, t+1] | input_ids[:, :t+1]) in token order from the rank's logits
    (``[b, s/c, V/TP]``, its CP share; vocab-parallel at TP > 1) and the whole sequences ``input_ids [b, s]``.  At
    CP > 1 each rank takes the log-probs of its tokens' next tokens (row-wise: the CP = 1 bits; the last position has
    none: a placeholder target, dropped) and the shares are gathered in token order (:func:`gather_cp_sequence`).
    Differentiable."""
    if cp_group() is None:
        return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    following = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    return gather_cp_sequence(vocab_parallel_logprobs(logits, cp_share(following), temperature))[:, :-1]
