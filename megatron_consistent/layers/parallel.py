"""Megatron process groups for the consistent CPU path: one process, world size 1.

The consistent layers implement tensor-parallel size 1 only.  Tensor
parallelism (TP > 1), sequence parallelism, context parallelism and pipeline
parallelism are refused by name (:class:`UnsupportedConfigError`) — a split
GEMM or a split attention would change the reduction order and with it the
bits.

Initialization uses gloo over an in-process ``HashStore`` (no TCP port, no
file), so concurrent pytest processes never collide; it runs once per process
and is a no-op when ``torch.distributed`` and Megatron's ``parallel_state`` are
already initialized (e.g. by a launcher), provided the sizes are 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import UnsupportedConfigError

__all__ = ["check_parallel_sizes", "check_parallel_config", "init_cpu_process_group"]


def check_parallel_sizes(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    expert_model_parallel_size: int = 1,
) -> None:
    """Refuse every parallelism the consistent layers do not implement, naming it."""
    refused = []
    if tensor_model_parallel_size != 1:
        refused.append(f"tensor parallelism (tensor_model_parallel_size={tensor_model_parallel_size})")
    if pipeline_model_parallel_size != 1:
        refused.append(f"pipeline parallelism (pipeline_model_parallel_size={pipeline_model_parallel_size})")
    if context_parallel_size != 1:
        refused.append(f"context parallelism (context_parallel_size={context_parallel_size})")
    if sequence_parallel:
        refused.append("sequence parallelism (sequence_parallel=True)")
    if expert_model_parallel_size != 1:
        refused.append(f"expert parallelism (expert_model_parallel_size={expert_model_parallel_size})")
    if refused:
        raise UnsupportedConfigError("the consistent Megatron layers support none of: " + "; ".join(refused) + " — only size 1")


def check_parallel_config(config) -> None:
    """:func:`check_parallel_sizes` on a Megatron ``TransformerConfig`` / ``ModelParallelConfig``."""
    check_parallel_sizes(
        getattr(config, "tensor_model_parallel_size", 1),
        getattr(config, "pipeline_model_parallel_size", 1),
        getattr(config, "context_parallel_size", 1),
        bool(getattr(config, "sequence_parallel", False)),
        getattr(config, "expert_model_parallel_size", 1),
    )


def init_cpu_process_group(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> None:
    """Initialize ``torch.distributed`` (gloo, world size 1) and Megatron model parallel (all sizes 1), once."""
    check_parallel_sizes(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size)
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise UnsupportedConfigError(
            f"torch.distributed is initialized with world size {dist.get_world_size()}; the consistent CPU path needs world size 1"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        if torch.cuda.is_available():  # Megatron's stock core attention forks the model-parallel CUDA RNG state on GPU
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        check_parallel_sizes(
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
