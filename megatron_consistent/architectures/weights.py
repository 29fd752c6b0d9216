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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "SHARD_RULES", "WeightEntry", "engine_views"]

LAYOUTS = ("copy", "qkv", "fc1", "experts_fc1", "experts_fc2")
SHARD_RULES = ("replicated", "column", "row", "vocab")


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
    shard: str = "replicated"             # tensor-parallel rule (SHARD_RULES); TP=1 everywhere today, not read yet

    def __post_init__(self):
        if self.layout not in LAYOUTS or self.shard not in SHARD_RULES or len(self.hf) != len(self.hf_shapes):
            raise ValueError(f"malformed weight entry {self}")


def engine_views(entry: WeightEntry, held: torch.Tensor) -> list[torch.Tensor]:
    """Views of the plugin's parameter ``held``, one per HF tensor of ``entry`` (same order)."""
    if entry.layout == "copy":
        return [held]
    if entry.layout in ("qkv", "fc1"):
        return list(held.split([s[0] for s in entry.hf_shapes], dim=0))
    if entry.layout == "experts_fc1":
        inter = entry.hf_shapes[0][0]
        return [part for e in range(held.shape[0]) for part in held[e].split(inter, dim=0)]
    return [held[e] for e in range(held.shape[0])]
