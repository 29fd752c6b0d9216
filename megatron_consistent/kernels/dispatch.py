"""The one dispatch point: (op name, device type) -> forward implementation.

CPU implementations are plain torch code living next to each op; CUDA
implementations are registered by the modules of :data:`LAZY_BACKENDS` when they
are imported (lazily, on the first CUDA tensor): the Triton kernels of
``kernels.triton`` and the deterministic torch code of ``kernels.cuda_torch_ops``.  A missing implementation is an
error naming the op and device — never a silent fall-back to a non-invariant
path.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
LAZY_BACKENDS = {"cuda": ("megatron_consistent.kernels.triton", "megatron_consistent.kernels.cuda_torch_ops")}


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
    if key not in _IMPLEMENTATIONS and device.type in LAZY_BACKENDS:
        for module in LAZY_BACKENDS[device.type]:
            importlib.import_module(module)
    try:
        return _IMPLEMENTATIONS[key]
    except KeyError:
        raise NoConsistentKernelError(
            f"megatron-consistent has no {device.type} implementation of '{op}'"
        ) from None


def registered(op: str, device: torch.device) -> Callable | None:
    """The registered forward of ``op`` for ``device``, or None (for an optional faster evaluation of the same
    contract: the caller keeps its own code otherwise)."""
    try:
        return implementation(op, device)
    except NoConsistentKernelError:
        return None


def env_switch(variable: str, default: bool = False) -> bool:
    """An on / off switch between evaluations of the same contract, from the environment: ``"1"`` on, ``"0"`` off,
    unset ``default``; anything else is refused by name (``MC_GLUON``, ``MC_HYBRID_DECODE_GRAPHS``; docs/gpu.md)."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}={value!r}: expected 0 or 1")
    return default if value == "" else value == "1"
