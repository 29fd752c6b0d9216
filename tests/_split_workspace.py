"""The attention split path's workspace and tile counters, for its tests (GPU suite and Triton's interpreter)."""

from __future__ import annotations

import torch


def nan_workspace(rows: int, block_d: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stand-in for ``attention._workspace`` filled with NaN: a merge that reads a slot no partition program wrote
    shows in its output."""
    return tuple(torch.full(shape, float("nan"), device=dev) for shape in ((rows,), (rows,), (rows, block_d)))


def tile_counters_all_zero() -> bool:
    """Whether every counter the one-launch split path (``MC_ATTN_LAST_MERGES``) holds is 0 (each launch leaves them so)."""
    from megatron_consistent.kernels.triton import attention

    return all(bool((c == 0).all()) for held in attention._TILE_COUNTERS.values() for c in held)
