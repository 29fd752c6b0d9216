"""Core attention for Megatron's SelfAttention slot: RoPE inside, then :func:`kernels.attention`.

The GPTModel is built with ``position_embedding_type='none'`` so Megatron's
own RoPE never runs; this module rotates q and k itself.  Order (the same as
the vLLM plugin's): ``linear_qkv`` -> q/k RMSNorm per head (Qwen3, done by
SelfAttention before calling us) -> :func:`kernels.apply_rope` (NeoX halves)
-> :func:`kernels.attention`.

Numerics contract:

* positions are ``arange(s)`` for every sequence of an ``[s, b, ...]`` batch
  (training sequences start at position 0) -- at context parallelism CP > 1 the
  rank's tokens are its share of the sequence and their positions absolute
  (:func:`.context_parallel.cp_positions`) --, or, for THD-packed input,
  ``arange(len_i)`` per segment given by ``packed_seq_params.cu_seqlens_q``;
  each packed segment is attended on its own, so packing never changes a row;
* ``q' = apply_rope(q, positions)``, ``k' = apply_rope(k, positions)`` (float32
  rotation, one rounding to the model dtype);
* ``out = attention(q', k', v, positions)`` with k/v unexpanded (the kernel maps
  query head h to kv head ``h // (np/ng)``), causal, scale ``softmax_scale`` or
  ``head_dim**-0.5``; returns ``[sq, b, np*hn]`` in the model dtype.  At CP > 1
  the CP ranks' k' / v are all-gathered in position order first
  (:func:`.context_parallel.cp_attention`): each row's CP = 1 bits.
  ``cp_comm_type`` (Transformer Engine's choice of CP algorithm) is ignored: the
  consistent op is always that all-gather.

Refused by name: non-causal masks, attention dropout, KV-cache inference
(``sq != sk``), packed formats other than THD, packed input at CP > 1.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import kernels
from ..config import UnsupportedConfigError
from ..kernels import RopeConfig
from . import context_parallel
from .parallel import check_parallel_config

__all__ = ["ConsistentCoreAttention", "consistent_core_attention"]


def _is_causal(mask_type) -> bool:
    return getattr(mask_type, "name", str(mask_type)).split(".")[-1] == "causal"


def _check_attention_features(config, attention_type: str, attn_mask_type) -> None:
    """Refuse by name what the consistent core attention does not do: cross attention, non-causal masks,
    attention dropout, sliding windows."""
    if attention_type != "self":
        raise UnsupportedConfigError(f"unsupported attention_type {attention_type!r} (self-attention only)")
    if attn_mask_type is not None and not _is_causal(attn_mask_type):
        raise UnsupportedConfigError(f"unsupported attn_mask_type {attn_mask_type} (causal only)")
    if getattr(config, "attention_dropout", 0.0):
        raise UnsupportedConfigError(f"unsupported feature: attention_dropout={config.attention_dropout} (must be 0)")
    if getattr(config, "window_size", None) is not None:
        raise UnsupportedConfigError(f"unsupported feature: sliding window attention (window_size={config.window_size})")


class ConsistentCoreAttention(nn.Module):
    """Megatron core-attention interface; bind a :class:`RopeConfig` with :func:`consistent_core_attention`."""

    rope: RopeConfig | None = None
    capture = None  # diagnostics: a callable(q_rot, k_rot) set on an instance by verify.diagnose; None = off

    def __init__(
        self,
        *,
        config,
        layer_number: int = 1,
        attn_mask_type=None,
        attention_type: str = "self",
        cp_comm_type=None,
        softmax_scale: float | None = None,
        pg_collection=None,
        rope: RopeConfig | None = None,
        **unused,
    ):
        super().__init__()
        check_parallel_config(config)
        if rope is not None:
            self.rope = rope
        if self.rope is None:
            raise UnsupportedConfigError(
                "ConsistentCoreAttention needs a RopeConfig: use consistent_core_attention(rope) / ConsistentSpecProvider(rope=...)"
            )
        if self.rope.style != "neox":
            raise UnsupportedConfigError(f"unsupported rope style {self.rope.style!r} for the Megatron layers (NeoX only)")
        _check_attention_features(config, attention_type, attn_mask_type)
        head_dim = getattr(config, "kv_channels", None)
        if head_dim is not None and head_dim != self.rope.rotary_dim:
            raise UnsupportedConfigError(f"rope rotary_dim {self.rope.rotary_dim} != kv_channels {head_dim} (partial rotary is not supported)")
        self.layer_number = layer_number
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _rotate(self, q, k, positions):
        """RoPE of q and k (a subclass without rotary embedding returns them as they are)."""
        return kernels.apply_rope(q, positions, self.rope), kernels.apply_rope(k, positions, self.rope)

    def _attend(self, q, k, v):
        """q [B, T, np, hn], k/v [B, T, ng, hn] of whole sequences starting at position 0 (at CP > 1: the CP rank's
        share of them, its tokens at their absolute positions)."""
        positions = context_parallel.cp_positions(q.shape[0], q.shape[1], device=q.device)
        q, k = self._rotate(q, k, positions)
        if getattr(self, "fp8_kv", False):  # FP8 KV cache (issue #9): the engine's cache round trip, on private copies
            from ..kernels.fp8 import kv_round_trip

            k, v = kv_round_trip(k), kv_round_trip(v)
        if self.capture is not None:
            self.capture(q, k)
        return context_parallel.cp_attention(q, k, v, positions, self.softmax_scale)

    @staticmethod
    def _check_mask(attention_mask, b, sq):
        if attention_mask is None:
            return
        causal = torch.ones(sq, sq, dtype=torch.bool, device=attention_mask.device).triu(1)
        if attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != (sq, sq) or not torch.equal(
            attention_mask.expand(*attention_mask.shape[:-2], sq, sq), causal.expand(*attention_mask.shape[:-2], sq, sq)
        ):
            raise UnsupportedConfigError(
                "unsupported attention_mask: the consistent attention is causal only (pass None or the causal mask); "
                "mask padding through the loss instead"
            )

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None, **unused):
        if attention_bias is not None:
            raise UnsupportedConfigError("unsupported feature: attention_bias (additive attention bias)")
        if attn_mask_type is not None and not _is_causal(attn_mask_type):
            raise UnsupportedConfigError(f"unsupported attn_mask_type {attn_mask_type} (causal only)")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
        sq, b, nq, hn = query.shape
        if key.shape[0] != sq:
            raise UnsupportedConfigError(
                f"query length {sq} != key length {key.shape[0]}: KV-cache inference is not supported by the Megatron layers"
            )
        self._check_mask(attention_mask, b, sq)
        out = self._attend(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))  # [b, sq, np, hn]
        return out.transpose(0, 1).reshape(sq, b, nq * hn)

    def _forward_packed(self, query, key, value, psp):
        if context_parallel.cp_size() > 1:
            raise UnsupportedConfigError("packed (thd) input at context parallelism > 1 is not supported (the consistent "
                                         "CP layout splits whole [s, b] sequences)")
        fmt = getattr(psp, "qkv_format", "thd")
        if fmt != "thd":
            raise UnsupportedConfigError(f"unsupported packed_seq_params.qkv_format {fmt!r} (thd only)")
        cu_q, cu_kv = psp.cu_seqlens_q, psp.cu_seqlens_kv
        if cu_q is None:
            raise UnsupportedConfigError("packed input without packed_seq_params.cu_seqlens_q is not supported")
        if cu_kv is not None and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise UnsupportedConfigError("packed input with cu_seqlens_kv != cu_seqlens_q is not supported")
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            padded = getattr(psp, name, None)
            if padded is not None and not torch.equal(padded.cpu(), cu_q.cpu()):
                raise UnsupportedConfigError(f"packed input with padded segments ({name}) is not supported")
        if query.dim() == 4:  # [t, 1, np, hn]
            if query.shape[1] != 1:
                raise UnsupportedConfigError(f"packed (thd) input must have batch 1, got {query.shape[1]}")
            query, key, value = query[:, 0], key[:, 0], value[:, 0]
        t, nq, hn = query.shape
        bounds = [int(x) for x in cu_q.tolist()]
        if bounds[0] != 0 or bounds[-1] != t or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise UnsupportedConfigError(f"cu_seqlens_q {bounds} does not partition the {t} packed tokens")
        outs = [
            self._attend(query[s0:s1][None], key[s0:s1][None], value[s0:s1][None])[0]
            for s0, s1 in zip(bounds, bounds[1:])
            if s1 > s0
        ]
        return torch.cat(outs, dim=0).reshape(t, nq * hn)


@functools.lru_cache(maxsize=None)
def consistent_core_attention(rope: RopeConfig) -> type:
    """A :class:`ConsistentCoreAttention` subclass bound to ``rope`` (a class, as Megatron's spec slots expect)."""
    return type(f"ConsistentCoreAttention_{abs(hash(rope)):x}", (ConsistentCoreAttention,), {"rope": rope, "__module__": __name__})
