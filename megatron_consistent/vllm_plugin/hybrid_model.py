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

Tensor parallelism (TP = t dividing the Mamba groups, the attention heads / KV heads, the MLP size and the experts;
:mod:`.parallel`): a Mamba mixer holds its rank's heads and the groups they read (the weight table's ``blocks`` rule
for ``in_proj`` / ``conv1d``) and its state cache only theirs (:mod:`.mamba`); attention holds its heads, the MLP
its columns, the MoE its run of experts (router and shared expert whole); ``o_proj`` / ``down`` / ``out_proj`` run
the row-parallel tree, embedding and lm head are vocabulary-parallel: the bits of TP = 1.

Refused by name: prefix caching (vLLM's mamba "align" cache mode keeps the running
state at block ends, not the chunk-boundary state + pending tokens this path
replays), speculative decoding, ReplaySSM, PP > 1, a TP that does not divide what it cuts.  Weights: HF names
(``backbone.*``; ``model.*`` / ``embed_tokens`` aliases accepted), loaded and
refitted in place by :meth:`ConsistentForCausalLM.load_weights` (at TP > 1 each rank copies its part).
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
from ..kernels import add_residual, inference_ops
from . import probe
from . import moe as plugin_moe
from .compat import attention_backend_class, compiled_by_vllm
from .decoder_layer import _linears, _param
from .mamba import ConsistentMambaMixer, run_mixer_between_graphs, state_dtypes, state_shapes
from .model import ConsistentForCausalLM, compile_enabled, check_engine_config
from .parallel import check_tp, tp_rank_size

logger = init_logger("vllm.plugins.megatron_consistent.hybrid")


class AttentionMixer(nn.Module):
    """Nemotron-H attention: fused q|k|v rows, vLLM's paged attention (consistent backend), no rope.  At TP = t: this
    rank's heads and KV heads (column-parallel q|k|v), ``o_proj`` its K shard (row-parallel tree)."""

    def __init__(self, arch: ArchConfig, cache_config, prefix: str, tp: int):
        super().__init__()
        a, dt = arch, arch.torch_dtype
        heads, kv_heads = a.num_heads // tp, a.num_kv_heads // tp
        self.q, self.kv = heads * a.head_dim, kv_heads * a.head_dim
        self.qkv_proj = _param(self.q + 2 * self.kv, a.hidden_size, dtype=dt)
        self.o_proj = _param(a.hidden_size, self.q, dtype=dt)
        self.lin = _linears(arch, int(prefix.split(".")[-2]), tp)  # the contract's linears (a fault: vllm_plugin/probe.py)
        self.attn = Attention(heads, a.head_dim, a.softmax_scale, num_kv_heads=kv_heads, cache_config=cache_config,
                              prefix=f"{prefix}.attn", attn_backend=attention_backend_class())

    def forward(self, x):
        q, k, v = self.lin["qkv"](x, self.qkv_proj).split([self.q, self.kv, self.kv], dim=-1)
        return self.lin["o_proj"](self.attn(q.contiguous(), k.contiguous(), v.contiguous()), self.o_proj)


class MLPMixer(nn.Module):
    """Nemotron-H non-gated MLP: ``down(relu2(up(x)))``; at TP = t this rank's ``intermediate_size / t`` columns."""

    def __init__(self, arch: ArchConfig, idx: int, tp: int):
        super().__init__()
        dt, inter = arch.torch_dtype, arch.intermediate_size // tp
        self.up_proj = _param(inter, arch.hidden_size, dtype=dt)
        self.down_proj = _param(arch.hidden_size, inter, dtype=dt)
        self.down = _linears(arch, idx, tp)["down"]  # the contract's row-parallel linear (a fault: vllm_plugin/probe.py)

    def forward(self, x):
        return self.down(inference_ops.relu_squared(inference_ops.linear(x, self.up_proj)), self.down_proj)


class MoEMixer(nn.Module):
    """Nemotron-H MoE: float32 router logits, sigmoid + e_score_correction_bias selection (group limit, scaling),
    non-gated relu2 experts and an ungated shared expert, combined once (:mod:`kernels.moe`, as opaque ops).  At
    TP = t rank r holds experts ``[r E/t, (r+1) E/t)``, the router and the shared expert whole
    (:func:`.moe.routed_experts`)."""

    def __init__(self, arch: ArchConfig, idx: int, rank: int, tp: int):
        super().__init__()
        a, dt = arch, arch.torch_dtype
        E, inter, s = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
        self.arch, self.idx, self.tp_size = a, idx, tp
        self.expert_first = rank * (E // tp)
        self.gate = _param(E, a.hidden_size, dtype=dt)
        self.score_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.experts_up = _param(E // tp, inter, a.hidden_size, dtype=dt)
        self.experts_down = _param(E // tp, a.hidden_size, inter, dtype=dt)
        self.shared_up = _param(s, a.hidden_size, dtype=dt) if s else None
        self.shared_down = _param(a.hidden_size, s, dtype=dt) if s else None

    def forward(self, x, positions):
        a = self.arch
        z = inference_ops.router_logits(x, self.gate)
        w, experts = inference_ops.moe_route(z, a.num_experts_per_tok, a.moe_scoring, self.score_bias, a.norm_topk_prob,
                                             a.moe_n_group, a.moe_topk_group, a.routed_scaling_factor)
        if plugin_moe.RECORDER is not None:
            plugin_moe.RECORDER.record(self.idx, positions, experts)
        return plugin_moe.routed_experts(x, experts, w, self.experts_up, self.experts_down,
                                         (self.shared_up, self.shared_down, None), "relu2", self.expert_first, self.tp_size)


class HybridLayer(nn.Module):
    """``h + mixer(rms_norm(h))`` with the mixer of the layer's kind."""

    def __init__(self, arch: ArchConfig, kind: str, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.arch, self.kind = arch, kind
        self.idx = int(prefix.rsplit(".", 1)[-1])
        self.norm = _param(arch.hidden_size, dtype=arch.torch_dtype)
        rank, tp = tp_rank_size()
        if kind == "mamba":
            self.mixer = ConsistentMambaMixer(arch, vllm_config, f"{prefix}.mixer")
        elif kind == "attention":
            self.mixer = AttentionMixer(arch, vllm_config.cache_config, f"{prefix}.mixer", tp)
        elif kind == "mlp":
            self.mixer = MLPMixer(arch, self.idx, tp)
        elif kind == "moe":
            self.mixer = MoEMixer(arch, self.idx, rank, tp)
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
    """Shared body of the two hybrid model classes (weights / refit, the vocabulary-parallel embedding and logits
    inherited from the dense class)."""

    @classmethod
    def _arch(cls, vllm_config: VllmConfig) -> ArchConfig:
        return ArchConfig.from_hf(vllm_config.model_config.hf_config.to_dict())

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        """One request's state slot on one tensor-parallel rank: its heads' and groups' states only (refused by name
        where TP does not divide what it cuts)."""
        arch, tp = cls._arch(vllm_config), vllm_config.parallel_config.tensor_parallel_size
        check_tp(arch, tp)
        return state_shapes(arch.ssm.per_rank(tp))

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
        _check_engine(arch, vllm_config)  # a TP that does not divide what it cuts refused by name (vllm_plugin/parallel.py)
        run_mixer_between_graphs(vllm_config.compilation_config)
        self._hold_rank_and_vocabulary(arch, vllm_config)
        self.fp8_formats = None
        self.layers = nn.ModuleList(HybridLayer(arch, kind, vllm_config, f"{prefix}backbone.layers.{i}")
                                    for i, kind in enumerate(arch.layer_types))
        self.norm = _param(arch.hidden_size, dtype=arch.torch_dtype)
        self._finish_build(vllm_config)
        logger.info("megatron-consistent: %s (%s) runs on the consistent kernels, Mamba state replayed from chunk boundaries, "
                    "TP rank %d of %d", arch.architecture, arch.hybrid_pattern, self.tp_rank, self.tp_size)

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
