"""The single source of numerics: every op that shapes a logit, in both engines.

Each op module holds a forward (registered per device in :mod:`dispatch`), an
``autograd.Function`` with its own backward, and a thin ``nn.Module``.  Kernels
know nothing of Megatron or vLLM.
"""

from . import inference_ops
from .attention import CUDA_MAX_HEAD_DIM, KV_BLOCK, attention, causal_positions
from .causal_conv1d import CausalConv1d, causal_conv1d
from .dispatch import NoConsistentKernelError, implementation, register
from .gated_rms_norm import GatedRMSNorm, gated_rms_norm
from .linear import K_BLOCK, Linear, linear, linear_segments, row_parallel_linear
from .logprobs import VOCAB_SEGMENTS, compute_logits, gather_logprobs, log_softmax, sum_exp_subtree, token_logprobs
from .paged_kv import gather_kv, write_kv
from .relu_squared import ReluSquared, relu_squared
from .rms_norm import RMSNorm, add_residual, rms_norm
from .rotary import RopeConfig, RotaryEmbedding, apply_rope, rope_cache, rope_scaling_items
from .silu_and_mul import SiluAndMul, silu_and_mul
from .ssd import (mamba_dt, ssd_chunk_end_state, ssd_continue, ssd_outputs_at, ssd_scan, ssd_step_end_states,
                  ssd_step_outputs, ssm_decay_rate)

__all__ = [
    "CUDA_MAX_HEAD_DIM", "KV_BLOCK", "K_BLOCK", "Linear", "NoConsistentKernelError", "RMSNorm", "RopeConfig", "RotaryEmbedding",
    "SiluAndMul", "add_residual", "apply_rope", "attention", "causal_positions", "compute_logits", "gather_kv", "gather_logprobs",
    "implementation", "inference_ops", "linear", "linear_segments", "row_parallel_linear",
    "log_softmax", "register", "rms_norm", "rope_cache", "rope_scaling_items",
    "silu_and_mul", "sum_exp_subtree", "token_logprobs", "VOCAB_SEGMENTS", "write_kv",
    "CausalConv1d", "GatedRMSNorm", "ReluSquared", "causal_conv1d", "gated_rms_norm", "mamba_dt", "relu_squared",
    "ssd_chunk_end_state", "ssd_continue", "ssd_outputs_at", "ssd_scan", "ssd_step_end_states", "ssd_step_outputs",
    "ssm_decay_rate",
]
