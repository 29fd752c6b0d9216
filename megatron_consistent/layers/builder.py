"""What the GPT and the hybrid model builders share: ArchConfig from any config form, the Megatron
``TransformerConfig`` for an ArchConfig, the dtype / parallel-size checks, and the seeded build.

Both builders (:mod:`.model`, :mod:`.hybrid`) use ``use_cpu_initialization=True``, dropout 0, init std 0.02,
and a seeded RNG (the global RNG is restored afterwards), so the same seed gives the same weights.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ROW_PARALLEL_SEGMENTS_KEY, ArchConfig, UnsupportedConfigError, load_hf_config, row_parallel_refusal
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
    """The keyword arguments ``fn`` accepts (a function, a class, or a dataclass: its fields): megatron-core's
    signatures differ between releases (0.16.1 on CPU, 0.19.x on the GPU), and unknown ones are dropped here."""
    if dataclasses.is_dataclass(fn):
        names = {f.name for f in dataclasses.fields(fn)}
        return {k: v for k, v in kwargs.items() if k in names}
    params = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def make_transformer_config(arch: ArchConfig, dtype: torch.dtype, *, consistent: bool, **parallel):
    """The Megatron ``TransformerConfig`` for ``arch`` (no dropout, no fusions, CPU init; TP/PP/CP = 1 unless
    ``parallel``), carrying the model's S as ``consistent_row_parallel_segments`` (read by the row-parallel layers)."""
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
    config = TransformerConfig(**filter_kwargs(TransformerConfig, kwargs))
    setattr(config, ROW_PARALLEL_SEGMENTS_KEY, arch.row_parallel_segments)
    return config


PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
                 "expert_model_parallel_size")


def prepare_build(hf_config, dtype, parallel: dict, *, feature: str | None = None) -> tuple[ArchConfig, torch.dtype]:
    """Validate the config and the parallel sizes (one named error before any work), then initialize the groups.

    ``feature``: a model kind without expert parallelism (hybrid): EP must be 1.
    """
    arch = as_arch_config(hf_config)  # validates: UnsupportedConfigError before anything is built
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    if unknown:
        raise UnsupportedConfigError(f"unknown parallel settings {unknown} (known: {', '.join(PARALLEL_KEYS)})")
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    ep = parallel.get("expert_model_parallel_size", 1)
    cp = parallel.get("context_parallel_size", 1)
    check_parallel_sizes(tp, pp, cp, parallel.get("sequence_parallel", False), ep, feature=feature)
    check_tp_shapes(arch, tp, pp, ep)
    init_cpu_process_group(tp, pp, cp, expert_model_parallel_size=ep, sequence_parallel=parallel.get("sequence_parallel", False))
    return arch, dtype or arch.torch_dtype


def check_tp_shapes(arch: ArchConfig, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse, by name, shapes a TP / PP / EP layout cannot split (heads, KV groups, FFN, vocabulary, layers,
    experts, the Mamba mixer's heads and groups, the row-parallel tree's S segments)."""
    if tp == 1 and pp == 1 and ep == 1:
        return
    problems = []
    if ep > 1 and not arch.is_moe:
        problems.append("expert parallelism on a model without experts")
    elif ep > 1 and arch.num_experts % ep:
        problems.append(f"num_experts={arch.num_experts} is not divisible by EP={ep} (the experts are sharded over the "
                        "EP ranks)")
    for name, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                    ("intermediate_size", arch.intermediate_size)):
        if n % tp:
            problems.append(f"{name}={n} is not divisible by TP={tp}")
    if arch.ssm is not None:  # a rank's Mamba heads and the groups their B / C / gated norm read: whole, its own
        for name, n in (("mamba_num_heads", arch.ssm.num_heads), ("n_groups", arch.ssm.n_groups)):
            if n % tp:
                problems.append(f"{name}={n} is not divisible by TP={tp} (the Mamba mixer's heads and groups are "
                                "sharded over the TP ranks)")
    if tp > 1 and ep == 1 and arch.is_moe and arch.num_experts % tp:
        problems.append(f"num_experts={arch.num_experts} is not divisible by TP={tp} (the trainer shards the experts "
                        "over the TP ranks)")
    reason = row_parallel_refusal(arch.row_parallel_segments, tp)
    if reason:
        problems.append(reason)
    if tp > 1 and arch.vocab_size % 8:
        problems.append(f"vocab_size={arch.vocab_size} is not divisible by 8 (the vocab-parallel log-softmax has 8 segments)")
    if arch.num_layers % pp:
        problems.append(f"num_hidden_layers={arch.num_layers} is not divisible by PP={pp}")
    if pp > 1 and arch.tie_word_embeddings and not torch.cuda.is_available():
        problems.append("tied word embeddings at PP > 1 without CUDA (Megatron's setup_embeddings_and_output_layer "
                        "synchronizes the first and last stage's copies on CUDA)")
    if problems:
        layout = f"TP={tp}, PP={pp}" + (f", EP={ep}" if ep > 1 else "")
        raise UnsupportedConfigError(f"{layout} cannot split {arch.architecture}: " + "; ".join(problems))


def seeded_build(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
