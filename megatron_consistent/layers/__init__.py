"""Megatron-Core layers that call the consistent kernels (TP 1/2/4/8 and PP for dense GPT models; CPU or CUDA via
kernels.dispatch; tensor / pipeline parallelism: :mod:`.tensor_parallel`, :mod:`.distributed`, docs/parallel.md).

Nothing here imports vLLM or the vLLM plugin.  Entry points:
:class:`ConsistentSpecProvider`, :func:`get_consistent_gpt_layer_spec`,
:func:`build_consistent_model` (alias ``build_consistent_gpt_model``; hybrid Mamba-2 configs dispatch to
:func:`build_consistent_hybrid_model`; MoE layers: Megatron's ``MoELayer`` with the consistent
submodules, :func:`megatron_moe_layer_spec`), :func:`compute_token_logprobs` and the stock
baseline :func:`build_stock_gpt_model` / :func:`compute_stock_token_logprobs`.
"""

from .attention import ConsistentCoreAttention, consistent_core_attention
from .builder import as_arch_config, make_transformer_config
from .cpu_shims import apply_cpu_shims
from .distributed import (build_parallel_model, recompute_logprobs_parallel, spawn_ranks, stage_backward, stage_forward,
                          stage_logprobs)
from .hybrid import build_consistent_hybrid_model, get_consistent_hybrid_stack_spec
from .linear import ConsistentColumnParallelLinear, ConsistentRowParallelLinear
from .mlp import ConsistentSiluAndMul, consistent_bias_dropout_add
from .moe_megatron import ConsistentExperts, ConsistentSharedExperts, megatron_moe_layer_spec
from .model import (
    build_consistent_gpt_model,
    build_consistent_model,
    build_stock_gpt_model,
    compute_stock_token_logprobs,
    compute_token_logprobs,
)
from .norm import ConsistentRMSNorm
from .output import ConsistentOutputLayer
from .parallel import check_parallel_sizes, init_cpu_process_group
from .spec import ConsistentSpecProvider, get_consistent_gpt_block_spec, get_consistent_gpt_layer_spec
from .tensor_parallel import vocab_parallel_logprobs

__all__ = [
    "apply_cpu_shims", "as_arch_config", "build_parallel_model", "recompute_logprobs_parallel", "spawn_ranks",
    "stage_backward", "stage_forward", "stage_logprobs", "vocab_parallel_logprobs", "build_consistent_gpt_model", "build_consistent_hybrid_model",
    "build_consistent_model", "build_stock_gpt_model", "check_parallel_sizes", "compute_stock_token_logprobs",
    "compute_token_logprobs", "consistent_bias_dropout_add", "consistent_core_attention",
    "ConsistentColumnParallelLinear", "ConsistentCoreAttention", "ConsistentExperts", "ConsistentOutputLayer",
    "ConsistentRMSNorm", "ConsistentRowParallelLinear", "ConsistentSharedExperts", "ConsistentSiluAndMul",
    "ConsistentSpecProvider", "get_consistent_gpt_block_spec", "get_consistent_gpt_layer_spec",
    "get_consistent_hybrid_stack_spec", "init_cpu_process_group", "make_transformer_config",
    "megatron_moe_layer_spec",
]
