"""vLLM CUDA attention backend on the consistent Triton attention.

The trainer's causal attention on CUDA (``kernels/triton/attention.py``) and
this backend run one per-row recurrence: KV blocks of 64 keys aligned at
absolute position 0, fixed KV partitions merged in order, the same online
softmax.  Here the kernel reads K/V **directly from vLLM's paged cache
through the block table** (no gather copy; key blocks of the step's new tokens
from the step's key / value tensors, the same values), so a query row gets the bits of
the training forward in a whole prefill, a prefill chunk over a cached
prefix, a prefix-cache hit and a decode step, in any batch.

The KV cache keeps vLLM's Triton-backend layout (logical
``[blocks, kv_heads, block_size, 2 * head_size]``, physical NHD), so vLLM's
allocator, hybrid page sharing and prefix caching work unchanged; K/V are
written by a Triton kernel (``write_kv_cache``), in the model dtype or as
E4M3 with the fixed scale of :data:`kernels.fp8.KV_SCALE` (the trainer
reproduces that round trip).

No launch path synchronises with the host, so vLLM captures the whole
forward of uniform decode batches as one CUDA graph and the rest piecewise.
Manager blocks that are no multiple of a page the kernel serves are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder, AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from ..config import UnsupportedConfigError
from ..kernels.fp8 import KV_SCALE
from ..kernels.triton._common import GLUON
from ..kernels.triton.paged_attention import PAGE_SIZES, leading_decodes, paged_attention, write_kv_cache

BACKEND_NAME = "CUSTOM"  # the AttentionBackendEnum member the plugin registers this backend over


@dataclass
class ConsistentCudaAttentionMetadata:
    """What one step's attention needs; the tensors are vLLM's persistent per-step buffers."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int  # an upper bound (the engine's max_model_len): fixed under CUDA-graph capture
    decode_requests: int  # the leading one-token requests (-1: not read, MC_GLUON=0): those after may take Gluon
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class ConsistentCudaAttentionMetadataBuilder(AttentionMetadataBuilder[ConsistentCudaAttentionMetadata]):
    """Passes vLLM's common metadata through; the kernel finds each query tile's sequence itself."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # vLLM puts a step's one-token requests first: with the Gluon kernels on (the default) the ones after them take the Gluon prefill kernel
    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> ConsistentCudaAttentionMetadata:
        m = common_attn_metadata
        if not isinstance(m.causal, bool) or not m.causal:
            raise UnsupportedConfigError("megatron-consistent attention supports causal decoder attention only")
        decode_requests = -1
        if GLUON and m.num_reqs:  # read on the host, from vLLM's host copy of the query starts
            qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
            decode_requests = leading_decodes((qsl[1:] - qsl[:-1]).tolist())
        return ConsistentCudaAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len, max_seq_len=self.max_model_len,
            decode_requests=decode_requests,
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping)


class ConsistentCudaAttentionImpl(AttentionImpl):
    """Triton KV write + the consistent paged attention."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **extra):
        refused = {
            "alibi_slopes": alibi_slopes is not None,
            f"sliding_window={sliding_window}": sliding_window is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype not in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"),
            "logits_soft_cap": bool(logits_soft_cap),
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            "kv_sharing": kv_sharing_target_layer_name is not None,
            "attention sinks": sinks is not None,
            f"extra attention arguments {sorted(extra)}": bool(extra),
        }
        bad = [name for name, hit in refused.items() if hit]
        if bad:
            raise UnsupportedConfigError(f"megatron-consistent attention does not support: {', '.join(bad)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_kv = kv_cache_dtype.startswith("fp8")
        self.attn_type = attn_type

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views ``[blocks, block_size, kv_heads, head_size]`` of vLLM's logical ``[blocks, kv_heads, block, 2*hs]``."""
        if kv_cache.shape[2] not in PAGE_SIZES:
            raise UnsupportedConfigError(
                f"megatron-consistent attention serves block sizes {PAGE_SIZES}, not {kv_cache.shape[2]}")
        if self.fp8_kv and kv_cache.dtype != torch.float8_e4m3fn:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        k, v = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return k, v

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_cache, v_cache = self._caches(kv_cache)
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, kv_scale=KV_SCALE if self.fp8_kv else None)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedConfigError("megatron-consistent attention does not fuse output quantization")
        if attn_metadata is None:  # profiling / dummy run: defined output, never uninitialised memory
            return output.zero_()
        m = attn_metadata
        k_cache, v_cache = self._caches(kv_cache)
        step_kv = key is not None and value is not None  # the values just written: new-token blocks read from them
        paged_attention(query, k_cache, v_cache, m.block_table, m.query_start_loc, m.seq_lens, self.scale, output,
                        max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, decode_requests=m.decode_requests,
                        kv_scale=KV_SCALE if self.fp8_kv else None,
                        k_new=key if step_kv else None, v_new=value if step_kv else None)
        return output


class ConsistentCudaAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton-backend KV layout; the consistent builder and implementation; decoder self-attention only."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return ConsistentCudaAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ConsistentCudaAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(PAGE_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """vLLM's KV-manager block: any multiple of a page the kernel serves.  vLLM's runner cuts a manager block
        into kernel pages of the largest :meth:`get_supported_kernel_block_sizes` entry that divides it, which is
        how hybrid models run: their attention block is raised to hold a Mamba state's page (hundreds of tokens at
        Nemotron-H 8B's widths).  The page size does not enter a row's bits (the kernel walks absolute key blocks)."""
        return block_size is None or any(block_size % page == 0 for page in PAGE_SIZES)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
