"""Fused SwiGLU activation and residual bias-dropout-add for Megatron's spec slots.

* :class:`ConsistentSiluAndMul` plugs into ``MLPSubmodules(activation_func=...)``
  (active with ``config.use_te_activation_func=True``): ``fc1`` output
  ``[..., 2I] = [gate | up]`` -> :func:`kernels.silu_and_mul` (float32
  ``silu(g) * u``, one rounding).  Megatron's MLP adds no bias and does no GLU
  itself on this path.
* :func:`consistent_bias_dropout_add` replaces ``get_bias_dropout_add`` for
  ``self_attn_bda`` / ``mlp_bda``: ``(out, bias), residual, p`` ->
  :func:`kernels.add_residual` ``(out, residual)`` = ``round(float32(out) +
  float32(residual))`` in out's dtype — the same add the vLLM plugin fuses
  into its next RMSNorm.  A non-None bias or dropout p > 0 is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import UnsupportedConfigError

__all__ = ["ConsistentSiluAndMul", "consistent_bias_dropout_add"]


class ConsistentSiluAndMul(nn.Module):
    """``forward(x [..., 2I]) -> [..., I]`` = ``silu(gate) * up`` by :func:`kernels.silu_and_mul`."""

    def __init__(self, config=None, **unused):
        super().__init__()
        if config is not None and not getattr(config, "gated_linear_unit", True):
            raise UnsupportedConfigError("ConsistentSiluAndMul needs gated_linear_unit=True (SwiGLU)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters; Megatron's MLP asks every child for one


def _residual_add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    x, bias = x_with_bias
    if bias is not None:
        raise UnsupportedConfigError("unsupported feature: a bias in the residual bias-dropout-add (add_bias_linear)")
    if prob:
        raise UnsupportedConfigError(f"unsupported feature: hidden dropout p={prob} in the residual add (must be 0)")
    return kernels.add_residual(x, residual)


def consistent_bias_dropout_add(training: bool, fused: bool):
    """Megatron's ``bda(training, fused)`` builder signature; returns ``f((out, bias), residual, p)``."""
    return _residual_add
