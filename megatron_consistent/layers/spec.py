"""Megatron ModuleSpecs built from the consistent modules.

:class:`ConsistentSpecProvider` implements megatron-core's
``BackendSpecProvider`` protocol (``megatron/core/models/backends.py``), so a
spec builder that takes a backend can be pointed at the consistent kernels by
one argument.  Stock ``get_gpt_layer_local_spec`` hard-codes its provider, so
:func:`get_consistent_gpt_layer_spec` builds the TransformerLayer spec by hand
from the provider (the same layout as the local spec).  The layer spec works
with ``GPTModel`` (0.16) and with any block/model that builds
``TransformerLayer`` specs (0.19's HybridModel attention layers included).

Op order per layer (the contract the vLLM plugin follows):
``h = rms_norm(x)`` -> ``qkv = linear(h)`` -> [q/k rms_norm per head] ->
rope(q, k) -> attention -> ``linear_proj`` -> ``x = add_residual(o, x)`` ->
``h = rms_norm(x)`` -> ``linear_fc1`` -> silu_and_mul -> ``linear_fc2`` ->
``x = add_residual(o, x)``; after the last layer ``final rms_norm`` and
float32 logits.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..config import UnsupportedConfigError
from ..kernels import RopeConfig
from .attention import ConsistentCoreAttention, consistent_core_attention
from .linear import ConsistentColumnParallelLinear, ConsistentRowParallelLinear
from .mlp import ConsistentSiluAndMul, consistent_bias_dropout_add
from .norm import ConsistentRMSNorm

__all__ = ["ConsistentSpecProvider", "get_consistent_gpt_layer_spec", "get_consistent_gpt_block_spec"]


class ConsistentSpecProvider:
    """BackendSpecProvider for the consistent kernels (TP=1, RMSNorm, SwiGLU, causal RoPE attention; MoE layers:
    :func:`.moe_megatron.megatron_moe_layer_spec`, see :meth:`grouped_mlp_modules`).

    ``rope`` binds the RoPE table the core attention applies; without it the
    core attention class refuses to build (there is no safe default theta).
    """

    def __init__(self, rope: RopeConfig | None = None):
        self.rope = rope

    def column_parallel_linear(self) -> type:
        return ConsistentColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return ConsistentRowParallelLinear

    def linear(self) -> type:  # 0.19 optional slot
        return ConsistentColumnParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False, **unused) -> type:
        if not rms_norm and not for_qk:
            raise UnsupportedConfigError("LayerNorm is not supported by the consistent layers (RMSNorm only)")
        if has_residual:
            raise UnsupportedConfigError("norms with a fused residual are not used by the consistent spec")
        return ConsistentRMSNorm

    def core_attention(self) -> type:
        return consistent_core_attention(self.rope) if self.rope is not None else ConsistentCoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool = False, moe_use_legacy_grouped_gemm: bool = False,
                            **unused) -> Tuple[type, Optional[object]]:
        """MoE is supported, but not through this slot: the consistent experts (``moe_megatron.ConsistentExperts``)
        combine what the consistent router decided for the same forward, so they come with it in one layer spec."""
        raise UnsupportedConfigError(
            "the consistent MoE layer is Megatron's MoELayer with the consistent router, experts and shared experts, which "
            "share one routing context: build its spec with megatron_consistent.layers.megatron_moe_layer_spec (experts "
            "from a backend provider alone would run behind Megatron's stock router)")

    def activation_func(self) -> type:
        return ConsistentSiluAndMul

    def bias_dropout_add(self):
        return consistent_bias_dropout_add


def get_consistent_gpt_layer_spec(qk_layernorm: bool = False, *, rope: RopeConfig, provider: ConsistentSpecProvider | None = None):
    """TransformerLayer ModuleSpec with every numerics-bearing submodule from the consistent kernels.

    ``qk_layernorm`` adds per-head RMSNorm on q and k (Qwen3) before RoPE;
    q/k/v biases (Qwen2) come from ``TransformerConfig.add_qkv_bias`` and are
    added inside the qkv linear kernel.  The model using this spec must be
    built with ``position_embedding_type='none'`` and
    ``use_te_activation_func=True`` (see :func:`.model.build_consistent_model`).
    """
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    p = provider or ConsistentSpecProvider(rope)
    if p.rope is None:
        p.rope = rope
    norm = p.layer_norm(rms_norm=True)
    qk_norm = p.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else None
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=p.column_parallel_linear(),
                    core_attention=p.core_attention(),
                    linear_proj=p.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=p.bias_dropout_add(),
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=p.column_parallel_linear(),
                    linear_fc2=p.row_parallel_linear(),
                    activation_func=p.activation_func(),
                ),
            ),
            mlp_bda=p.bias_dropout_add(),
        ),
    )


def get_consistent_gpt_block_spec(num_layers: int, qk_layernorm: bool = False, *, rope: RopeConfig):
    """TransformerBlockSubmodules: ``num_layers`` consistent layers plus the consistent final RMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_consistent_gpt_layer_spec(qk_layernorm, rope=rope)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=ConsistentRMSNorm)
