"""The dense decoder layer of the vLLM plugin, op for op the Megatron-Core layer of :mod:`megatron_consistent.layers`:

    x = rms_norm(h); qkv = linear(x, W_qkv, b_qkv)
    [q, k = rms_norm(q), rms_norm(k) per head — Qwen3]; q, k = rope(q, k)
    h = add_residual(row_parallel_linear(attention(q, k, v), W_o), h)
    h = add_residual(row_parallel_linear(silu_and_mul(linear(rms_norm(h), W_gate_up)), W_down), h)

Parameters in vLLM's fused layout (qkv, gate_up); the linear's output columns are independent of each
other, so fusing q/k/v (and gate/up) rows in a different order than Megatron does changes no bit.
Every kernel is one opaque custom op (:mod:`..kernels.inference_ops`) so vLLM can compile the model; the attention
residual add and the post-attention norm are one (``add_rms_norm``, the bits of the pair).
Diagnostic hooks (op probe, injected fault): :mod:`.probe`.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention

from ..config import ArchConfig
from ..kernels import add_residual, inference_ops
from . import probe
from .compat import attention_backend_class
from .parallel import row_parallel_for, tp_rank_size

logger = init_logger("vllm.plugins.megatron_consistent.model")


def _fault_linear(x, w, b=None):
    """Deliberately outside the contract: split-K matmul, each half's partial sum rounded to the model dtype."""
    k = x.shape[-1] // 2
    y = (x[..., :k].float() @ w[:, :k].float().t()).to(x.dtype) + (x[..., k:].float() @ w[:, k:].float().t()).to(x.dtype)
    return y if b is None else (y.float() + b.float()).to(x.dtype)


def _fault_router(x, w):
    """The same fault for an MoE router: the split-K matmul above, widened to the router logits' float32."""
    return _fault_linear(x, w).float()


def _linears(arch: ArchConfig, idx: int, tp_size: int = 1) -> dict:
    """The contract's linears of layer ``idx`` (an injected fault in place of one: :mod:`.probe`); the row-parallel
    ones with the model's S (``arch.row_parallel_segments``)."""
    fault = os.environ.get(probe.FAULT_ENV, "")
    if fault:
        logger.warning("megatron-consistent: %s=%s — injected fault active", probe.FAULT_ENV, fault)
    # TP > 1: this rank's K shard, subtrees all-gathered (vllm_plugin/parallel.py)
    row = row_parallel_for(arch.row_parallel_segments, tp_size)
    contract = {"qkv": inference_ops.linear, "o_proj": row, "gate_up": inference_ops.linear, "down": row,
                "router_logits": inference_ops.router_logits}
    faulty = {"router_logits": _fault_router}
    return {op: faulty.get(op, _fault_linear) if fault == f"layer{idx}.{op}" else fn for op, fn in contract.items()}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class ConsistentDecoderLayer(nn.Module):
    """One pre-norm decoder layer; parameters in vLLM's fused layout (qkv, gate_up).

    At tensor-parallel size t the layer holds this rank's heads / KV heads / MLP columns (column-parallel q|k|v and
    gate|up) and the matching K shards of o_proj and down (row-parallel); the model checks these shapes against the
    weight table's shard rules (``hf_targets``)."""

    MLP_OPS = ("gate_up", "act", "down")  # the op probe's names of what mlp_forward returns

    def __init__(self, arch: ArchConfig, cache_config, prefix: str):
        super().__init__()
        a, dt = arch, arch.torch_dtype
        self.arch = arch
        self.idx = int(prefix.rsplit(".", 1)[-1])
        _, tp = tp_rank_size()
        self.lin = _linears(arch, self.idx, tp)
        self.num_heads, self.num_kv_heads, inter = a.num_heads // tp, a.num_kv_heads // tp, a.intermediate_size // tp
        self.q_size, self.kv_size = self.num_heads * a.head_dim, self.num_kv_heads * a.head_dim
        self.input_layernorm = _param(a.hidden_size, dtype=dt)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, a.hidden_size, dtype=dt)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dt) if a.qkv_bias else None
        self.q_norm = _param(a.head_dim, dtype=dt) if a.qk_norm else None
        self.k_norm = _param(a.head_dim, dtype=dt) if a.qk_norm else None
        self.o_proj = _param(a.hidden_size, self.q_size, dtype=dt)
        self.post_attention_layernorm = _param(a.hidden_size, dtype=dt)
        self.gate_up_proj = _param(2 * inter, a.hidden_size, dtype=dt)
        self.down_proj = _param(a.hidden_size, inter, dtype=dt)
        self.attn = Attention(self.num_heads, a.head_dim, a.softmax_scale, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, prefix=f"{prefix}.self_attn.attn",
                              attn_backend=attention_backend_class())

    def mlp_forward(self, x: torch.Tensor, positions: torch.Tensor):
        """(gate_up, act, down) of the dense SwiGLU MLP; the MoE layer (vllm_plugin/moe.py) overrides it (and records
        routes at ``positions``)."""
        gu = self.lin["gate_up"](x, self.gate_up_proj)
        act = inference_ops.silu_and_mul(gu)
        return gu, act, self.lin["down"](act, self.down_proj)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One layer; ``rope``: the float32 (cos, sin) table rows at each token's position."""
        a, lin, cap, i = self.arch, self.lin, probe.PROBE, self.idx
        t = h.shape[0]
        x = inference_ops.rms_norm(h, self.input_layernorm, a.rms_norm_eps)
        qkv = lin["qkv"](x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, a.head_dim)
        k = k.reshape(t, self.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = inference_ops.rms_norm(q, self.q_norm, a.rms_norm_eps)
            k = inference_ops.rms_norm(k, self.k_norm, a.rms_norm_eps)
            if cap is not None:
                cap(f"layer{i}.q_norm", q), cap(f"layer{i}.k_norm", k)
        q = inference_ops.rope(q, *rope, a.rope.style)
        k = inference_ops.rope(k, *rope, a.rope.style)
        o = self.attn(q.reshape(t, -1), k.reshape(t, -1), v.contiguous())
        o_proj = lin["o_proj"](o, self.o_proj)
        x2, ho = inference_ops.add_rms_norm(o_proj, h, self.post_attention_layernorm, a.rms_norm_eps)
        gu, act, m = self.mlp_forward(x2, positions)
        out = add_residual(m, ho)
        if cap is not None:
            for name, val in (("input_norm", x), ("qkv", qkv), ("rope_q", q), ("rope_k", k), ("attention", o), ("o_proj", o_proj),
                              ("residual_attn", ho), ("post_norm", x2), *zip(self.MLP_OPS, (gu, act, m)), ("residual_mlp", out)):
                cap(f"layer{i}.{name}", val)
        return out
