"""vLLM model classes for the hybrid Mamba-2 architectures (``NemotronHForCausalLM``, ``Mamba2ForCausalLM``).

Op for op the Megatron hybrid stack of :mod:`megatron_consistent.layers.hybrid`::

    h = embed(ids)
    per layer:  h = add_residual(mixer(rms_norm(h, W_norm)), h)      mixer by the layer's kind:
        mamba      :class:`.mamba.ConsistentMambaMixer` (state cached by vLLM, chunk replay)
        attention  q|k|v = linear(x, W_qkv); row_parallel_linear(attention(q, k, v), W_o)   (NO rotary embedding)
        mlp        row_parallel_linear(relu_squared(linear(x, W_up)), W_down)
        moe        sigmoid router + selection bias, non-gated relu2 experts + shared expert (kernels.moe)
    logits = compute_logits(rms_norm(h, W_norm_f), W_lm_head)          (float32)

Compiled by vLLM on CUDA (every kernel an opaque op of :mod:`..kernels.inference_ops`), the Mamba mixer core
a splitting op run eagerly between piecewise CUDA graphs (:mod:`.mamba` says why and how).

The op probe (:mod:`.probe`) sees ``embed``, per layer ``layer<i>.norm`` / ``.mixer`` / ``.residual`` (a Mamba mixer
also ``.in_proj`` / ``.dt`` / ``.ssd`` / ``.gated_norm``: :mod:`.mamba`), ``final_norm`` and the logits.

Refused by name: prefix caching (vLLM's mamba "align" cache mode keeps the running
state at block ends, not the chunk-boundary state + pending tokens this path
replays), speculative decoding, ReplaySSM, TP/PP > 1.  Weights: HF names
(``backbone.*``; ``model.*`` / ``embed_tokens`` aliases accepted), loaded and
refitted in place by :meth:`ConsistentForCausalLM.load_weights`.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid

from ..architectures import canonical_hf_name, weight_entries
from ..config import ArchConfig, UnsupportedConfigError
from ..kernels import add_residual, compute_logits, inference_ops
from . import announce, probe
from . import moe as plugin_moe
from .compat import attention_backend_class, compiled_by_vllm
from .decoder_layer import _linears, _param
from .mamba import ConsistentMambaMixer, run_mixer_between_graphs, state_dtypes, state_shapes
from .model import ConsistentForCausalLM, compile_enabled, check_engine_config

logger = init_logger("vllm.plugins.megatron_consistent.hybrid")


class AttentionMixer(nn.Module):
    """Nemotron-H attention: fused q|k|v rows, vLLM's paged attention (consistent backend), no rope."""

    def __init__(self, arch: ArchConfig, cache_config, prefix: str):
        super().__init__()
        a, dt = arch, arch.torch_dtype
        self.q, self.kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = _param(self.q + 2 * self.kv, a.hidden_size, dtype=dt)
        self.o_proj = _param(a.hidden_size, self.q, dtype=dt)
        self.lin = _linears(arch, int(prefix.split(".")[-2]))  # the contract's linears (a fault: vllm_plugin/probe.py)
        self.attn = Attention(a.num_heads, a.head_dim, a.softmax_scale, num_kv_heads=a.num_kv_heads, cache_config=cache_config,
                              prefix=f"{prefix}.attn", attn_backend=attention_backend_class())

    def forward(self, x):
        q, k, v = self.lin["qkv"](x, self.qkv_proj).split([self.q, self.kv, self.kv], dim=-1)
        return self.lin["o_proj"](self.attn(q.contiguous(), k.contiguous(), v.contiguous()), self.o_proj)


class MLPMixer(nn.Module):
    """Nemotron-H non-gated MLP: ``down(relu2(up(x)))``."""

    def __init__(self, arch: ArchConfig, idx: int):
        super().__init__()
        dt = arch.torch_dtype
        self.up_proj = _param(arch.intermediate_size, arch.hidden_size, dtype=dt)
        self.down_proj = _param(arch.hidden_size, arch.intermediate_size, dtype=dt)
        self.down = _linears(arch, idx)["down"]  # the contract's row-parallel linear (a fault: vllm_plugin/probe.py)

    def forward(self, x):
        return self.down(inference_ops.relu_squared(inference_ops.linear(x, self.up_proj)), self.down_proj)


class MoEMixer(nn.Module):
    """Nemotron-H MoE: float32 router logits, sigmoid + e_score_correction_bias selection (group limit, scaling),
    non-gated relu2 experts and an ungated shared expert, combined once (:mod:`kernels.moe`, as opaque ops)."""

    def __init__(self, arch: ArchConfig, idx: int):
        super().__init__()
        a, dt = arch, arch.torch_dtype
        E, inter, s = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
        self.arch, self.idx = a, idx
        self.gate = _param(E, a.hidden_size, dtype=dt)
        self.score_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.experts_up = _param(E, inter, a.hidden_size, dtype=dt)
        self.experts_down = _param(E, a.hidden_size, inter, dtype=dt)
        self.shared_up = _param(s, a.hidden_size, dtype=dt) if s else None
        self.shared_down = _param(a.hidden_size, s, dtype=dt) if s else None

    def forward(self, x, positions):
        a = self.arch
        z = inference_ops.router_logits(x, self.gate)
        w, experts = inference_ops.moe_route(z, a.num_experts_per_tok, a.moe_scoring, self.score_bias, a.norm_topk_prob,
                                             a.moe_n_group, a.moe_topk_group, a.routed_scaling_factor)
        if plugin_moe.RECORDER is not None:
            plugin_moe.RECORDER.record(self.idx, positions, experts)
        return inference_ops.moe_experts(x, experts, w, self.experts_up, self.experts_down, self.shared_up, self.shared_down, None,
                                         "relu2")


class HybridLayer(nn.Module):
    """``h + mixer(rms_norm(h))`` with the mixer of the layer's kind."""

    def __init__(self, arch: ArchConfig, kind: str, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.arch, self.kind = arch, kind
        self.idx = int(prefix.rsplit(".", 1)[-1])
        self.norm = _param(arch.hidden_size, dtype=arch.torch_dtype)
        if kind == "mamba":
            self.mixer = ConsistentMambaMixer(arch, vllm_config, f"{prefix}.mixer")
        elif kind == "attention":
            self.mixer = AttentionMixer(arch, vllm_config.cache_config, f"{prefix}.mixer")
        elif kind == "mlp":
            self.mixer = MLPMixer(arch, self.idx)
        elif kind == "moe":
            self.mixer = MoEMixer(arch, self.idx)
        else:
            raise UnsupportedConfigError(f"unsupported hybrid layer type {kind!r}")

    def forward(self, h, positions):
        x = inference_ops.rms_norm(h, self.norm, self.arch.rms_norm_eps)
        m = self.mixer(x, positions) if self.kind == "moe" else self.mixer(x)
        out = add_residual(m, h)
        cap = probe.PROBE
        if cap is not None:
            for name, val in (("norm", x), ("mixer", m), ("residual", out)):
                cap(f"layer{self.idx}.{name}", val)
        return out


def _check_engine(arch: ArchConfig, vllm_config: VllmConfig) -> None:
    check_engine_config(arch, vllm_config)
    cc = vllm_config.cache_config
    if cc.enable_prefix_caching:
        raise UnsupportedConfigError(
            f"megatron-consistent: prefix caching (enable_prefix_caching=True, vLLM mamba_cache_mode={cc.mamba_cache_mode!r}) is not "
            f"supported for the hybrid Mamba architecture {arch.architecture}: vLLM caches the running SSM state at block ends, the "
            "consistent path needs the chunk-boundary state plus the pending tokens; pass enable_prefix_caching=False")
    if vllm_config.num_speculative_tokens:
        raise UnsupportedConfigError("megatron-consistent: speculative decoding is not supported for hybrid Mamba models")
    if getattr(cc, "use_replayssm", False):
        raise UnsupportedConfigError("megatron-consistent: use_replayssm is not supported (the plugin keeps its own chunk replay)")


@compiled_by_vllm(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=compile_enabled)
class _ConsistentHybridBase(ConsistentForCausalLM):
    """Shared body of the two hybrid model classes (weights / refit / logits inherited from the dense class)."""

    @classmethod
    def _arch(cls, vllm_config: VllmConfig) -> ArchConfig:
        return ArchConfig.from_hf(vllm_config.model_config.hf_config.to_dict())

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(cls._arch(vllm_config).ssm)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(cls._arch(vllm_config).torch_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        raise UnsupportedConfigError("megatron-consistent: hybrid models do not support prefix caching (mamba_cache_mode='align')")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)  # the dense parent's body is not run; this class's own compile wrapper follows it
        arch = self._arch(vllm_config)
        if not arch.is_hybrid:
            raise UnsupportedConfigError(f"{arch.architecture} is not a hybrid architecture")
        _check_engine(arch, vllm_config)  # TP > 1 refused by name (vllm_plugin/parallel.py)
        run_mixer_between_graphs(vllm_config.compilation_config)
        self.arch = arch
        self.tp_rank, self.tp_size = 0, 1
        self._loaded_targets: set[str] = set()
        self._dummy_start = str(getattr(vllm_config.load_config, "load_format", "")).lower().endswith("dummy")
        self.fp8_formats = None
        dt = arch.torch_dtype
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=dt)
        self.layers = nn.ModuleList(HybridLayer(arch, kind, vllm_config, f"{prefix}backbone.layers.{i}")
                                    for i, kind in enumerate(arch.layer_types))
        self.norm = _param(arch.hidden_size, dtype=dt)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _param(arch.vocab_size, arch.hidden_size, dtype=dt)
        if arch.is_moe:
            plugin_moe.start_recorder(arch, vllm_config)  # route recording (vllm_plugin/moe.py)
        probe.install_from_env()
        announce()
        logger.info("megatron-consistent: %s (%s) runs on the consistent kernels, Mamba state replayed from chunk boundaries",
                    arch.architecture, arch.hybrid_pattern)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cap = probe.PROBE
        if cap is not None:
            cap.begin(input_ids, positions)
            cap("embed", h)
        for layer in self.layers:
            h = layer(h, positions)
        out = inference_ops.rms_norm(h, self.norm, self.arch.rms_norm_eps)
        if cap is not None:
            cap("final_norm", out)
            cap.end()
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden_states, self.lm_head)
        if probe.PROBE is not None:
            probe.PROBE.logits(hidden_states, logits)
        return logits

    def hf_wire_dtypes(self) -> dict[str, str]:
        """HF name -> the dtype a checkpoint / weight update carries, for the targets held wider than that: the Mamba
        mixers' float32 small parameters (``A_log``, ``D``, ``dt_bias``, conv, gated norm) arrive in the model dtype
        and the copy widens them exactly."""
        targets = self.hf_targets()
        return {n: e.dtype for e in weight_entries(self.arch) for n in e.hf if str(targets[n].dtype) != f"torch.{e.dtype}"}

    def load_weights(self, weights):
        """:meth:`ConsistentForCausalLM.load_weights` accepting the ``model.*`` / ``embed_tokens`` aliases of the HF names."""
        return super().load_weights((canonical_hf_name(name), t) for name, t in weights)


class ConsistentNemotronHForCausalLM(_ConsistentHybridBase, HasInnerState, IsHybrid):
    """Nemotron-H (layers M * - E) on the consistent kernels."""


class ConsistentMamba2ForCausalLM(_ConsistentHybridBase, HasInnerState, IsAttentionFree):
    """Mamba-2 (every layer M) on the consistent kernels."""
