"""RMSNorm for Megatron's spec slots, calling :func:`kernels.rms_norm`.

Used for ``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm`` /
``k_layernorm`` (``hidden_size = head_dim``, applied per head over the last
axis, before RoPE — Qwen3 order) and the block's ``final_layernorm``.

Numerics contract: ``y = kernels.rms_norm(x, weight, eps)`` — float32
fixed-tree mean square, IEEE ``1/sqrt``, one rounding to x's dtype.  The
residual add that precedes a norm in the vLLM fused form is done here by the
bias-dropout-add (:mod:`.mlp`) with :func:`kernels.add_residual`; the fused and
unfused forms are bitwise identical by the kernel's contract.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import UnsupportedConfigError

__all__ = ["ConsistentRMSNorm"]


class ConsistentRMSNorm(nn.Module):
    """``forward(x [..., hidden]) -> Tensor``; parameter ``weight`` (ones at init)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        normalization = getattr(config, "normalization", "RMSNorm")
        if normalization != "RMSNorm":
            raise UnsupportedConfigError(f"unsupported normalization {normalization!r} (the consistent layers implement RMSNorm)")
        if getattr(config, "zero_centered_gamma", False):
            raise UnsupportedConfigError("unsupported feature: zero_centered_gamma")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # sequence parallelism: each TP rank sees its sequence chunk, so the weight's gradient is partial there;
        # Megatron's finalize_model_grads all-reduces the parameters marked so over the TP group
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
