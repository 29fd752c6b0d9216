"""Scheduling knobs of a kernel module set for a benchmark variant and restored after (``bench_gpu_attention.py``'s
split-path variants, ``bench_gpu_moe.py --fp8-variants``)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def module_knobs(module, settings: dict):
    """``module``'s attributes ``settings`` set inside the block, their previous values restored on leaving it."""
    saved = {key: getattr(module, key) for key in settings}
    for key, value in settings.items():
        setattr(module, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(module, key, value)
