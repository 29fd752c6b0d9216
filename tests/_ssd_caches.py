"""The mixer's caches for the tests of the in-place SSD decode-step kernels (``test_gpu_ssd_step.py``,
``test_gpu_ssd_end_state.py``: NaN in every row no kernel may read; the interpreter files: slots past 32-bit
offsets)."""

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


CACHE_SLOTS_PAST_32_BITS = 1 << 20  # a slot id from which a slot stride of 4 096 elements passes 2**32


def at_slots_past_32_bits(case: dict) -> dict:
    """``case`` (a decode step's keyword arguments) with its xbc / dt / state caches' slots moved to slot ids
    ``CACHE_SLOTS_PAST_32_BITS + slot`` of caches whose slot stride (4 096 elements, or a slot's size if larger) puts
    those slots past 2**32 elements -- as in a state cache that fills a large GPU.  The caches' storage is virtual
    memory on the CPU: only the moved slots are written."""
    top, out = CACHE_SLOTS_PAST_32_BITS, dict(case)
    for name in ("xbc_cache", "dt_cache", "state_cache"):
        small = case[name]
        stride = max(small[0].numel(), -(-(1 << 32) // top))
        storage = torch.empty((top + small.shape[0]) * stride, dtype=small.dtype, device=small.device)
        big = storage.as_strided((top + small.shape[0], *small.shape[1:]), (stride, *small[0].stride()))
        big[top:] = small
        out[name] = big
    out["slots"] = case["slots"] + top
    return out
