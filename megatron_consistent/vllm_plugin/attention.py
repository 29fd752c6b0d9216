"""vLLM CPU attention backend that calls the consistent ``attention`` kernel.

Registered over vLLM's ``CPU_ATTN`` enum member (vLLM's CPU platform always
selects that member), keeping vLLM's block manager, block tables and slot
mappings.  K/V are written into the paged cache with :func:`kernels.write_kv`
(our layout inside vLLM's ``[blocks, kv_heads, block_size, 2*head_dim]``
allocation); every forward — prefill, chunked prefill, prefix-cache hit,
decode — gathers each request's K/V from its pages with
:func:`kernels.gather_kv` and calls the same :func:`kernels.attention` the
trainer uses, with each query's absolute position.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..config import UnsupportedConfigError
from ..kernels import attention, gather_kv, write_kv

POISON_ENV = "MEGATRON_CONSISTENT_POISON_ATTN_OUTPUT"


class ConsistentAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata without the CPU kernel's scheduler metadata (unused here)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        m = common_attn_metadata
        if not isinstance(m.causal, bool) or not m.causal:
            raise UnsupportedConfigError("megatron-consistent attention supports causal decoder attention only")
        return CPUAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            scheduler_metadata=None,
            causal=True,
        )


class ConsistentAttentionImpl(CPUAttentionBackendImpl):
    """Paged-cache write and gather around the consistent attention kernel."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, sinks=None):
        refused = {
            "alibi_slopes": alibi_slopes is not None,
            f"sliding_window={sliding_window}": sliding_window is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"),
            "logits_soft_cap": bool(logits_soft_cap),
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            "kv_sharing": kv_sharing_target_layer_name is not None,
            "attention sinks": sinks is not None,
        }
        bad = [name for name, hit in refused.items() if hit]
        if bad:
            raise UnsupportedConfigError(f"megatron-consistent attention does not support: {', '.join(bad)}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.fp8_kv = kv_cache_dtype != "auto"  # E4M3 cache, fixed scale kernels.fp8.KV_SCALE (issue #9)
        # Testing only: fill the output buffer with NaN before every forward, as uninitialised memory may hold;
        # a test proves that no such value survives (the dummy run writes zeros, every real row is written).
        self.poison_output = os.environ.get(POISON_ENV, "0") == "1"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.fp8_kv:
            from ..kernels.fp8 import kv_quantize

            write_kv(kv_cache.view(torch.float8_e4m3fn), slot_mapping[: key.shape[0]], kv_quantize(key), kv_quantize(value))
            return
        write_kv(kv_cache, slot_mapping[: key.shape[0]], key, value)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if self.poison_output:  # testing (MEGATRON_CONSISTENT_POISON_ATTN_OUTPUT=1): stand-in for unwritten memory
            output.fill_(float("nan"))
        if attn_metadata is None:  # profiling / dummy run: no K/V, but the output must never be unwritten memory
            return output.zero_()
        # Rows past the scheduled tokens (padding) are not computed: zeros, never unwritten memory.
        output[attn_metadata.num_actual_tokens :] = 0
        starts = attn_metadata.query_start_loc.to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        seq_lens = attn_metadata.seq_lens.to(torch.int64)
        # Decode requests (one new token) share one call; each prefill chunk gets its own.
        # The kernel's result for a query does not depend on this grouping.
        groups = [torch.nonzero(q_lens == 1).flatten()] + [r.view(1) for r in torch.nonzero(q_lens > 1).flatten()]
        for reqs in groups:
            if reqs.numel() == 0:
                continue
            qlen = int(q_lens[reqs].max())
            offs = torch.arange(qlen)
            valid = offs[None, :] < q_lens[reqs][:, None]
            rows = torch.where(valid, starts[reqs][:, None] + offs[None, :], 0)
            positions = torch.where(valid, seq_lens[reqs][:, None] - q_lens[reqs][:, None] + offs[None, :], -1)
            if self.fp8_kv:  # gather the E4M3 pages, dequantize to the model dtype, then the same attention
                from ..kernels.fp8 import kv_dequantize

                k, v = gather_kv(kv_cache.view(torch.float8_e4m3fn), attn_metadata.block_table[reqs], seq_lens[reqs])
                k, v = kv_dequantize(k, query.dtype), kv_dequantize(v, query.dtype)
            else:
                k, v = gather_kv(kv_cache, attn_metadata.block_table[reqs], seq_lens[reqs])
            out = attention(query[rows], k, v, positions, seq_lens[reqs], scale=self.scale)
            output[rows[valid]] = out[valid].reshape(-1, *output.shape[1:]).to(output.dtype)
        return output


class ConsistentAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the consistent implementation (any head size)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # no restriction: the kernel takes any head size

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ConsistentAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ConsistentAttentionMetadataBuilder
