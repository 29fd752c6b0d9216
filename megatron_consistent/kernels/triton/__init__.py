"""Triton (CUDA) forwards of the consistent ops.

Importing this package registers ``(op, "cuda")`` implementations with the same
signatures as the CPU ones (see :mod:`megatron_consistent.kernels.dispatch`).
GPU results are deterministic and batch-invariant on the GPU; they are not
bit-equal to the CPU contract (see each module's docstring and docs/benchmarks.md).
"""

from . import (  # noqa: F401  (registration; compile_log first: MC_LOG_SPECIALIZATIONS)
    compile_log,
    attention,
    attention_bwd,
    exp,
    fp8_linear,
    linear,
    log_softmax,
    moe,
    paged_attention,
    rms_norm,
    rope,
    segment_tree,
    silu_and_mul,
)
from .attention import KV_BLOCK_GPU, PART_KEYS, attention_fwd
from .linear import CONFIG_TABLE, config_for, gemm

__all__ = ["CONFIG_TABLE", "KV_BLOCK_GPU", "PART_KEYS", "attention_fwd", "config_for", "gemm"]
