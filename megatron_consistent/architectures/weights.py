"""One weight entry of an architecture family's table, and how it sits in the vLLM plugin's storage.

A :class:`WeightEntry` is one Megatron parameter and the HF tensors it is split into.
``layout`` names the split (Megatron tensor -> HF tensors, done by
:mod:`megatron_consistent.conversion.hf`):

==============  ==================================================================================
``copy``        one HF tensor, the same shape
``qkv``         q | k | v; Megatron groups the rows per KV head (its q heads, its k head, its v head)
``fc1``         gate | up: the first half of the rows, then the second
``experts_fc1`` a stack ``[E, 2I, H]``: per expert its gate rows then its up rows (``2E`` HF tensors)
``experts_fc2`` a stack ``[E, ...]``: one HF tensor per expert
==============  ==================================================================================

The vLLM plugin holds each entry in the parameter ``engine`` (an attribute path on its
model class) as the HF tensors in table order: concatenated along the rows (``qkv``,
``fc1``; q | k | v not grouped), per expert along the rows of the expert's slice
(``experts_fc1``), one index per expert (``experts_fc2``), or as is (``copy``).
:func:`engine_views` gives those views; the plugin copies checkpoints and refits into them.

Tensor parallelism (``shard``, read by the vLLM plugin at TP = t > 1; :func:`tp_part`): each HF
tensor of an entry is cut on its own, so the plugin's rank holds, in table order, the same
concatenation of its parts —

==============  ==================================================================================
``replicated``  every rank holds the whole tensor
``column``      rows (dim 0; output features) cut into t equal contiguous parts: rank r the r-th
``row``         the last dim (input features, K) cut into t equal contiguous parts: rank r the r-th
``vocab``       rows cut into parts of ``ceil(V / t)``; the last rank's part may be short (its
                storage is padded with zero rows that no HF tensor names)
``experts``     a stack of experts (``experts_fc1`` / ``experts_fc2``): the experts cut into t equal
                contiguous runs, rank r holds experts ``[r E/t, (r+1) E/t)`` — each of their HF
                tensors whole — and nothing of the other experts' (an empty part: ``(0, 0, 0)``)
``blocks``      rows made of consecutive sub-blocks (``WeightEntry.blocks``: the Mamba mixer's
                ``in_proj`` z | x | B | C | dt, ``conv1d`` x | B | C), each cut into t equal
                contiguous runs: rank r holds the r-th run of every block, in block order — whole
                heads and the groups they read (the trainer's ``partition_sections``: the trainer
                and the plugin both cut by :func:`block_part`)
==============  ==================================================================================

A part is ``(dim, start_0, stop_0, start_1, stop_1, ...)``: the runs ``[start_i, stop_i)`` of the HF tensor
along ``dim``, concatenated (:func:`take_part`; one run for every rule but ``blocks``); :func:`join_parts`
puts the ranks' pieces back together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "SHARD_RULES", "WeightEntry", "block_part", "engine_views", "join_parts", "take_part", "tp_held_shape",
           "tp_part"]

LAYOUTS = ("copy", "qkv", "fc1", "experts_fc1", "experts_fc2")
SHARD_RULES = ("replicated", "column", "row", "vocab", "experts", "blocks")


@dataclass(frozen=True)
class WeightEntry:
    """One Megatron parameter <-> its HF tensors <-> the vLLM plugin parameter holding them."""

    megatron: str                         # Megatron-Core parameter name
    hf: tuple[str, ...]                   # HF tensor names, in the order ``layout`` splits the Megatron tensor
    shape: tuple[int, ...]                # shape of the Megatron parameter
    hf_shapes: tuple[tuple[int, ...], ...]  # shape of each HF tensor
    dtype: str                            # dtype name of the HF tensors (a checkpoint's, a weight update's)
    layout: str                           # one of LAYOUTS
    engine: str                           # attribute path of the vLLM plugin parameter holding the HF tensors
    shard: str = "replicated"             # tensor-parallel rule (SHARD_RULES), see tp_part
    blocks: tuple[int, ...] = ()          # shard "blocks": the sizes of the consecutive sub-blocks along dim 0

    def __post_init__(self):
        stacked = self.layout in ("experts_fc1", "experts_fc2")
        if (self.layout not in LAYOUTS or self.shard not in SHARD_RULES or len(self.hf) != len(self.hf_shapes)
                or (self.shard == "experts" and not stacked)
                or (self.shard == "blocks") != bool(self.blocks)
                or (self.blocks and (self.layout != "copy" or sum(self.blocks) != self.hf_shapes[0][0]))):
            raise ValueError(f"malformed weight entry {self}")


def block_part(blocks: tuple[int, ...], rank: int, size: int, dim: int = 0) -> tuple[int, ...]:
    """The part (``(dim, start_0, stop_0, ...)``) that rank ``rank`` of ``size`` holds of a tensor whose ``dim`` is
    made of consecutive blocks of sizes ``blocks``: the ``rank``-th of ``size`` equal contiguous runs of every block,
    in block order.  One block: the plain ``rank``-th run.  A block ``size`` does not divide raises ``ValueError``."""
    part, start = [dim], 0
    for n in blocks:
        if n % size:
            raise ValueError(f"a block of {n} cannot be cut into {size} equal parts")
        part += [start + rank * n // size, start + (rank + 1) * n // size]
        start += n
    return tuple(part)


def _runs(part: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of a part."""
    return list(zip(part[1::2], part[2::2]))


def take_part(tensor: torch.Tensor, part: tuple[int, ...] | None) -> torch.Tensor:
    """The part ``part`` of ``tensor`` (``None``: all of it): its runs along the part's dim, concatenated (one run:
    a view; a 0-d tensor as its one-element vector)."""
    if part is None:
        return tensor
    if tensor.dim() == 0:  # a scalar (NVFP4's global scale of another rank's expert): its part of its one element
        tensor = tensor.reshape(1)
    pieces = [tensor.narrow(part[0], a, b - a) for a, b in _runs(part)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part[0])


def join_parts(pieces: list[torch.Tensor], parts: list[tuple[int, ...]]) -> torch.Tensor:
    """The whole tensor from ``pieces[i] = take_part(whole, parts[i])`` that together cover it once (the ranks'
    pieces): every run of every piece, concatenated in the order of where it starts (concatenation only)."""
    dim = parts[0][0]
    runs = []
    for piece, part in zip(pieces, parts):
        starts = _runs(part)
        runs += zip((a for a, _ in starts), piece.split([b - a for a, b in starts], dim=dim))
    return torch.cat([run for _, run in sorted(runs, key=lambda r: r[0])], dim=dim)


def tp_part(entry: WeightEntry, index: int, rank: int = 0, size: int = 1) -> tuple[int, ...] | None:
    """The part (``(dim, start, stop)``; ``blocks``: one run a block) of HF tensor ``entry.hf[index]`` that
    tensor-parallel rank ``rank`` of ``size`` holds (``None``: all of it; ``(0, 0, 0)``: nothing of it, another
    rank's expert).  A shape the rule cannot cut into ``size`` equal parts raises ``ValueError`` naming it."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside 0..{size - 1}")
    if size == 1 or entry.shard == "replicated":
        return None
    if entry.shard == "experts":
        per = _tensors_per_expert(entry)
        experts = len(entry.hf) // per
        if experts % size:
            raise ValueError(f"{entry.megatron}: {experts} experts cannot be cut into {size} equal runs")
        run = experts // size
        return None if rank * run <= index // per < (rank + 1) * run else (0, 0, 0)
    if entry.shard == "blocks":
        try:
            return block_part(entry.blocks, rank, size)
        except ValueError as e:
            raise ValueError(f"{entry.hf[index]}: the blocks {entry.blocks} of its rows: {e}") from None
    shape = entry.hf_shapes[index]
    dim = len(shape) - 1 if entry.shard == "row" else 0
    n = shape[dim]
    if entry.shard == "vocab":
        part = -(-n // size)
        return dim, min(rank * part, n), min((rank + 1) * part, n)
    if n % size:
        raise ValueError(f"{entry.hf[index]}: dim {dim} of {tuple(shape)} cannot be cut into {size} equal "
                         f"{entry.shard}-parallel parts")
    part = n // size
    return dim, rank * part, (rank + 1) * part


def _tensors_per_expert(entry: WeightEntry) -> int:
    """HF tensors per expert of a stacked-experts entry (``experts_fc1``: gate and up; ``experts_fc2``: one)."""
    return 2 if entry.layout == "experts_fc1" else 1


def _local_shape(entry: WeightEntry, index: int, size: int) -> tuple[int, ...]:
    """Shape of the storage a rank keeps for HF tensor ``index`` (a vocab part: padded to ``ceil(V / size)`` rows)."""
    shape = list(entry.hf_shapes[index])
    cut = tp_part(entry, index, 0, size)
    if cut is not None:
        shape[cut[0]] = sum(b - a for a, b in _runs(cut))
    return tuple(shape)


def tp_held_shape(entry: WeightEntry, size: int = 1) -> tuple[int, ...]:
    """Shape of the plugin parameter holding ``entry`` on one of ``size`` tensor-parallel ranks (``size`` 1: whole)."""
    local = [_local_shape(entry, i, size) for i in range(len(entry.hf))]
    if entry.layout == "copy":
        return local[0]
    if entry.layout in ("qkv", "fc1"):
        return (sum(s[0] for s in local), *local[0][1:])
    experts = len(local) // _tensors_per_expert(entry) // (size if entry.shard == "experts" else 1)
    if entry.layout == "experts_fc1":
        return (experts, 2 * local[0][0], *local[0][1:])
    return (experts, *local[0])


def engine_views(entry: WeightEntry, held: torch.Tensor, rank: int = 0, size: int = 1, packing: int = 1) -> list[torch.Tensor]:
    """Views of the plugin's parameter ``held``, one per HF tensor of ``entry`` (same order): at tensor-parallel
    rank ``rank`` of ``size``, each view holds that rank's part (:func:`tp_part`) of the HF tensor (an empty part:
    an empty view of ``held``, so copying the part copies nothing).  ``packing``: ``held`` stores that many values
    an element along its last dim (NVFP4 codes: 2 a byte)."""
    shape = (*held.shape[:-1], held.shape[-1] * packing) if held.dim() else tuple(held.shape)
    if size > 1 and tuple(shape) != tp_held_shape(entry, size):
        raise ValueError(f"{entry.engine}: held shape {tuple(shape)} != {tp_held_shape(entry, size)} "
                         f"(the weight table's {entry.shard}-parallel part at TP={size})")
    if entry.layout == "copy":
        views = [held]
    elif entry.layout in ("qkv", "fc1"):
        views = list(held.split([_local_shape(entry, i, size)[0] for i in range(len(entry.hf))], dim=0))
    elif entry.layout == "experts_fc1":
        inter = _local_shape(entry, 0, size)[0]
        views = [part for e in range(held.shape[0]) for part in held[e].split(inter, dim=0)]
    else:
        views = [held[e] for e in range(held.shape[0])]
    if entry.shard == "vocab":  # the last rank's padding rows are no HF tensor's
        views = [v[: cut[2] - cut[1]] if (cut := tp_part(entry, i, rank, size)) else v for i, v in enumerate(views)]
    if entry.shard == "experts":  # the rank's run of experts; another rank's expert: an empty view (its empty part)
        first = rank * len(views)
        views = [views[i - first] if 0 <= i - first < len(views) else views[0][:0] for i in range(len(entry.hf))]
    return views
