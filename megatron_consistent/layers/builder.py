"""What the GPT and the hybrid model builders share: ArchConfig from any config form, the Megatron
``TransformerConfig`` for an ArchConfig, the dtype / parallel-size checks, and the seeded build.

Both builders (:mod:`.model`, :mod:`.hybrid`) use ``use_cpu_initialization=True``, dropout 0, init std 0.02,
and a seeded RNG (the global RNG is restored afterwards), so the same seed gives the same weights.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ArchConfig, UnsupportedConfigError, load_hf_config
from .parallel import check_parallel_sizes, init_cpu_process_group

__all__ = ["CONSISTENT", "STOCK", "as_arch_config", "filter_kwargs", "make_transformer_config", "prepare_build", "seeded_build"]

CONSISTENT, STOCK = "consistent", "stock"  # values of a built model's ``consistent_kind``


def as_arch_config(hf_config) -> ArchConfig:
    """An :class:`ArchConfig` from an ArchConfig, an HF config dict, or a path (folder with config.json, or the file)."""
    if isinstance(hf_config, ArchConfig):
        return hf_config
    if isinstance(hf_config, (str, os.PathLike, Path)):
        hf_config = load_hf_config(hf_config)
    if not isinstance(hf_config, dict):
        raise TypeError(f"expected an HF config dict, an ArchConfig or a path, got {type(hf_config).__name__}")
    return ArchConfig.from_hf(hf_config)


def filter_kwargs(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def make_transformer_config(arch: ArchConfig, dtype: torch.dtype, *, consistent: bool, **parallel):
    """The Megatron ``TransformerConfig`` for ``arch`` (TP/PP/CP = 1, no dropout, no fusions, CPU init)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedConfigError(f"unsupported dtype {dtype}")
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_te_activation_func=consistent,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
    )
    kwargs.update(parallel)
    return TransformerConfig(**filter_kwargs(TransformerConfig, kwargs))


def prepare_build(hf_config, dtype, parallel: dict) -> tuple[ArchConfig, torch.dtype]:
    arch = as_arch_config(hf_config)  # validates: UnsupportedConfigError before anything is built
    check_parallel_sizes(
        parallel.get("tensor_model_parallel_size", 1),
        parallel.get("pipeline_model_parallel_size", 1),
        parallel.get("context_parallel_size", 1),
        parallel.get("sequence_parallel", False),
    )
    init_cpu_process_group()
    return arch, dtype or arch.torch_dtype


def seeded_build(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
