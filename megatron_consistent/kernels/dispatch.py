"""The one dispatch point: (op name, device type) -> forward implementation.

CPU implementations are plain torch code living next to each op; CUDA
implementations are Triton kernels registered by ``kernels.triton`` when it is
imported (lazily, on the first CUDA tensor).  A missing implementation is an
error naming the op and device — never a silent fall-back to a non-invariant
path.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
_LAZY_BACKENDS = {"cuda": "megatron_consistent.kernels.triton"}


class NoConsistentKernelError(RuntimeError):
    """Raised when an op has no consistent implementation for a device."""


def register(op: str, device_type: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the forward of ``op`` on ``device_type``."""

    def wrap(fn: Callable) -> Callable:
        _IMPLEMENTATIONS[(op, device_type)] = fn
        return fn

    return wrap


def implementation(op: str, device: torch.device) -> Callable:
    """The registered forward of ``op`` for ``device``."""
    key = (op, device.type)
    if key not in _IMPLEMENTATIONS and device.type in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[device.type])
    try:
        return _IMPLEMENTATIONS[key]
    except KeyError:
        raise NoConsistentKernelError(
            f"megatron-consistent has no {device.type} implementation of '{op}'"
        ) from None
