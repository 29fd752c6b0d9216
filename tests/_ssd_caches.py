"""The mixer's caches for the GPU tests of the in-place SSD decode-step kernels (``test_gpu_ssd_step.py``,
``test_gpu_ssd_end_state.py``): NaN in every row no kernel may read."""

from __future__ import annotations

import torch

NAN = float("nan")


def nan_filled_chunks(g: torch.Generator, n_slots: int, slots, pending, L: int, conv: int, nh: int, dtype,
                      dt_scale: float, dt_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xbc_cache [n_slots, L, conv] in dtype, dt_cache [n_slots, L, nh] float32)``: row ``i``'s slot holds random
    rows below ``pending[i]`` (``x | B | C`` normal, ``dt`` uniform in ``[dt_min, dt_min + dt_scale)``, drawn from
    ``g`` in that order), NaN in every other row and slot."""
    bsz = slots.shape[0]
    xbc_cache = torch.full((n_slots, L, conv), NAN, dtype=dtype)
    dt_cache = torch.full((n_slots, L, nh), NAN)
    rows = torch.arange(L)[None, :] < pending[:, None]  # [b, L]
    xbc_cache[slots] = torch.where(rows[..., None], torch.randn(bsz, L, conv, generator=g).to(dtype), NAN)
    dt_cache[slots] = torch.where(rows[..., None], torch.rand(bsz, L, nh, generator=g) * dt_scale + dt_min, NAN)
    return xbc_cache, dt_cache
