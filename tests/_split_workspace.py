"""The attention split path's workspace, for its tests."""

from __future__ import annotations

import torch


def nan_workspace(rows: int, block_d: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stand-in for ``attention._workspace`` filled with NaN: a merge that reads a slot no partition program wrote
    shows in its output."""
    return tuple(torch.full(shape, float("nan"), device=dev) for shape in ((rows,), (rows,), (rows, block_d)))
