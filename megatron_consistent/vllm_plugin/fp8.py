"""Block-FP8 checkpoints in the consistent vLLM model (issue #9).

A checkpoint written by :func:`megatron_consistent.conversion.fp8.export_hf_fp8`
carries ``megatron_consistent_quantization`` in its ``config.json``;
:func:`quantization_of` reads it (the standard ``quantization_config`` is
written too, for other readers, but the plugin never hands the linears to
vLLM's FP8 methods: the model class holds raw parameters and ignores vLLM's
``quant_config`` object).

:class:`FP8DecoderLayer` stores each fused linear as E4M3 values
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` in
``float8_e4m3fn``) plus one block-scale parameter per HF tensor
(``q_proj_scale`` … ``down_proj_scale``, float32 ``[ceil(N/128), ceil(K/128)]``,
loaded from ``<name>.weight_scale_inv``); every call expands the block scales
to per-row scales in the fused row order and runs
:func:`megatron_consistent.kernels.fp8.fp8_linear` — the trainer's FP8 forward.
Refits send the same two tensors per linear.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ArchConfig, UnsupportedConfigError
from ..conversion.fp8 import QUANT_KEY, formats_from_entry
from ..kernels.fp8 import fp8_linear, weight_row_scales
from .model import ConsistentDecoderLayer

__all__ = ["FP8DecoderLayer", "quantization_of"]

# fused op -> (fused parameter, [(HF short name, HF tensor suffix)])
_FUSED = {
    "qkv": ("qkv_proj", [("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj")]),
    "o_proj": ("o_proj", [("o_proj", "self_attn.o_proj")]),
    "gate_up": ("gate_up_proj", [("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj")]),
    "down": ("down_proj", [("down_proj", "mlp.down_proj")]),
}


def quantization_of(hf: dict):
    """``(weight_format, activation_format)`` from an HF config dict, or None for an unquantized checkpoint."""
    entry = hf.get(QUANT_KEY)
    if entry is None:
        qc = hf.get("quantization_config")
        if qc:
            raise UnsupportedConfigError(
                f"checkpoint has quantization_config={qc} but no {QUANT_KEY}: the consistent plugin runs only block-FP8 "
                "checkpoints written by megatron_consistent.conversion.fp8.export_hf_fp8")
        return None
    return formats_from_entry(entry)


class FP8DecoderLayer(ConsistentDecoderLayer):
    """Dense decoder layer whose four linears are block-FP8 (E4M3 values + per-HF-tensor block scales)."""

    def __init__(self, arch: ArchConfig, cache_config, prefix: str, *, formats):
        super().__init__(arch, cache_config, prefix)
        self.w_fmt, self.a_fmt = formats
        br, bc = self.w_fmt.block
        self._rows: dict[str, list[int]] = {}
        sizes = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size, "o_proj": arch.hidden_size,
                 "gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size, "down_proj": arch.hidden_size}
        for op, (pname, parts) in _FUSED.items():
            old = getattr(self, pname)
            setattr(self, pname, nn.Parameter(torch.zeros(old.shape, dtype=self.w_fmt.storage_dtype), requires_grad=False))
            k = old.shape[1]
            for short, _ in parts:
                n = sizes[short]
                setattr(self, f"{short}_scale", nn.Parameter(torch.ones(-(-n // br), -(-k // bc), dtype=torch.float32), requires_grad=False))
            self._rows[op] = [sizes[s] for s, _ in parts]
            self.lin[op] = self._make_linear(op)

    def _make_linear(self, op: str):
        parts = _FUSED[op][1]

        def run(x, w_q, b=None):
            rows = torch.cat([weight_row_scales(getattr(self, f"{s}_scale"), n, self.w_fmt)
                              for (s, _), n in zip(parts, self._rows[op])])
            return fp8_linear(x, w_q, rows, b, w_fmt=self.w_fmt, a_fmt=self.a_fmt)

        return run

    def scale_targets(self, p: str) -> dict[str, torch.Tensor]:
        """HF ``weight_scale_inv`` names of this layer (prefix ``p``) -> its block-scale parameters."""
        return {p + f"{suffix}.weight_scale_inv": getattr(self, f"{short}_scale")
                for _, parts in _FUSED.values() for short, suffix in parts}


def layer_factory(arch: ArchConfig, formats):
    if arch.is_moe:
        raise UnsupportedConfigError(f"fp8 quantization: MoE architectures ({arch.architecture}) are not supported yet (dense only)")

    def make(a, cache_config, prefix):
        return FP8DecoderLayer(a, cache_config, prefix, formats=formats)

    return make
