"""Architecture families and their weight tables: the one place the HF tensor names live.

Each family module (:mod:`.dense`, :mod:`.moe`, :mod:`.hybrid`) builds, for an
:class:`~megatron_consistent.config.ArchConfig`, the list of :class:`~.weights.WeightEntry`
(Megatron name, HF names, shapes, dtype, layout, vLLM plugin parameter, TP shard rule).
Generated from it: the HF conversion plan (:mod:`megatron_consistent.conversion.hf`), the
weight-update specs (:func:`megatron_consistent.sync.protocol.hf_tensor_specs`) and the vLLM
plugin's load / refit targets (``ConsistentForCausalLM.hf_targets``).

This package imports only :mod:`megatron_consistent.config` (and torch): the trainer layers,
the vLLM plugin, conversion and sync may all import it.  Adding an architecture:
``docs/architecture.md``.
"""

from __future__ import annotations

from ..config import ArchConfig
from .dense import dense_entries
from .hybrid import canonical_hf_name, hybrid_entries
from .moe import moe_entries, router_hf_modules
from .weights import LAYOUTS, SHARD_RULES, WeightEntry, block_part, engine_views, join_parts, take_part, tp_held_shape, tp_part

__all__ = ["LAYOUTS", "SHARD_RULES", "WeightEntry", "block_part", "canonical_hf_name", "engine_views", "family", "hf_names",
           "hf_tensor_specs", "join_parts", "router_hf_modules", "take_part", "tp_held_shape", "tp_part", "weight_entries"]

_FAMILIES = {"dense": dense_entries, "moe": moe_entries, "hybrid": hybrid_entries}


def family(arch: ArchConfig) -> str:
    """``hybrid``, ``moe`` or ``dense``."""
    return "hybrid" if arch.is_hybrid else "moe" if arch.is_moe else "dense"


def weight_entries(arch: ArchConfig) -> list[WeightEntry]:
    """The weight table of ``arch``'s family, in checkpoint order."""
    return _FAMILIES[family(arch)](arch)


def hf_tensor_specs(arch: ArchConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, dtype name) of a checkpoint of ``arch`` (what a full weight update must contain)."""
    return {n: (s, w.dtype) for w in weight_entries(arch) for n, s in zip(w.hf, w.hf_shapes)}


def hf_names(arch: ArchConfig) -> dict[str, tuple[str, ...]]:
    """Megatron parameter name -> its HF tensor names (in ``layout`` order), for ``arch``."""
    return {w.megatron: w.hf for w in weight_entries(arch)}
